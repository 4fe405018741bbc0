/* Byte-run copies for kvplane's CPU transports: see kvplane/transports/native_copy.py.
 *
 * kvp_copy_window copies bytes [lo, hi) of n runs laid end to end: run i is ends[i] - ends[i-1]
 * bytes (or `length` bytes each when ends is NULL) from src + src_off[i] to dst + dst_off[i].
 * The caller has checked every run against both buffers and that no destination byte is
 * written twice or read as a source. Several threads may copy disjoint windows of one move.
 *
 * With `stream` set, runs of at least STREAM_MIN_RUN bytes are written with non-temporal
 * (streaming) stores: a large move then costs one read and one write per byte instead of a
 * read, a read-for-ownership and a write-back, and does not evict the caches the caller's
 * compute lives in. A store fence ends every streaming window, so the bytes are visible before
 * the caller reports the copy done.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define STREAM_MIN_RUN 256

static void stream_copy(uint8_t *dst, const uint8_t *src, int64_t n) {
#if defined(__AVX2__)
  int64_t head = (int64_t)((32 - ((uintptr_t)dst & 31)) & 31);
  memcpy(dst, src, (size_t)head);
  int64_t i = head;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
    __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
    _mm256_stream_si256((__m256i *)(dst + i), a);
    _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    _mm256_stream_si256((__m256i *)(dst + i + 64), c);
    _mm256_stream_si256((__m256i *)(dst + i + 96), d);
  }
  memcpy(dst + i, src + i, (size_t)(n - i));
#elif defined(__SSE2__)
  int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
  memcpy(dst, src, (size_t)head);
  int64_t i = head;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
    _mm_stream_si128((__m128i *)(dst + i), a);
    _mm_stream_si128((__m128i *)(dst + i + 16), b);
    _mm_stream_si128((__m128i *)(dst + i + 32), c);
    _mm_stream_si128((__m128i *)(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, (size_t)(n - i));
#else
  memcpy(dst, src, (size_t)n);
#endif
}

static void fence(void) {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/* The first run whose end lies past `at` (runs of length zero are skipped). */
static int64_t first_run(const int64_t *ends, int64_t length, int64_t n, int64_t at) {
  if (ends == NULL) {
    return at / length;
  }
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (ends[mid] <= at) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

void kvp_copy_window(const uint8_t *src, uint8_t *dst, const int64_t *src_off,
                     const int64_t *dst_off, const int64_t *ends, int64_t length, int64_t n,
                     int64_t lo, int64_t hi, int stream) {
  if (lo >= hi || n <= 0 || (ends == NULL && length <= 0)) {
    return;
  }
  for (int64_t i = first_run(ends, length, n, lo); i < n && lo < hi; i++) {
    int64_t end = ends == NULL ? (i + 1) * length : ends[i];
    int64_t start = ends == NULL ? i * length : (i == 0 ? 0 : ends[i - 1]);
    int64_t a = lo - start, b = (hi < end ? hi : end) - start;
    uint8_t *d = dst + dst_off[i] + a;
    const uint8_t *s = src + src_off[i] + a;
    if (stream && b - a >= STREAM_MIN_RUN) {
      stream_copy(d, s, b - a);
    } else {
      memcpy(d, s, (size_t)(b - a));
    }
    lo = start + b;
  }
  if (stream) {
    fence();
  }
}
