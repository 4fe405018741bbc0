/* kvplane synthetic KV: whole blocks of the synthetic value function written straight into a
 * pool -- see kvplane/serving/producers/synthetic_native.py.
 *
 * kvp_xor_blocks writes dst[n][r][t][x] = row[n][t] ^ cols[r][x] for n < nblocks, r < reps,
 * t < tokens, x < width, all int64 words, every array contiguous in that order (a block-major
 * pool of n blocks x (layers * components) x block tokens x (heads * word dim)). It is the
 * broadcast XOR of the Python path, written with non-temporal (streaming) stores where the
 * destination is 32-byte aligned: the step's values are read by the transfer, never by this
 * thread again, so writing around the caches halves the memory traffic of the write (no
 * read-for-ownership of every destination line) and leaves the bandwidth to the copy that
 * runs beside it. A store fence ends the call, so the bytes are visible to other threads
 * once it returns.
 */
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* One destination row of `width` words: v ^ c[x]. */
static void write_row(int64_t *d, int64_t v, const int64_t *c, int64_t width) {
    int64_t x = 0;
#if defined(__AVX2__)
    while (x < width && ((uintptr_t)(d + x) & 31) != 0) {
        d[x] = v ^ c[x];
        x++;
    }
    const __m256i vv = _mm256_set1_epi64x(v);
    for (; x + 4 <= width; x += 4) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(c + x));
        _mm256_stream_si256((__m256i *)(d + x), _mm256_xor_si256(w, vv));
    }
#endif
    for (; x < width; x++) d[x] = v ^ c[x];
}

void kvp_xor_blocks(int64_t *dst, const int64_t *row, const int64_t *cols, int64_t nblocks,
                    int64_t reps, int64_t tokens, int64_t width) {
    for (int64_t n = 0; n < nblocks; n++) {
        for (int64_t r = 0; r < reps; r++) {
            const int64_t *c = cols + r * width;
            for (int64_t t = 0; t < tokens; t++) {
                int64_t *d = dst + ((n * reps + r) * tokens + t) * width;
                write_row(d, row[n * tokens + t], c, width);
            }
        }
    }
#if defined(__AVX2__)
    _mm_sfence();
#endif
}
