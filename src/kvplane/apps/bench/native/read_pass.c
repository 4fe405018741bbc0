/* The attention bench's read-only limit: stream every byte of a buffer once, writing nothing.
 *
 * kvp_read_pass(p, n, threads) folds the buffer's 64-bit words with XOR (the compiler
 * vectorizes the loop into wide loads with independent accumulators) over `threads` pthreads,
 * each taking one contiguous share, and returns the fold so no load can be elided. Trailing
 * bytes past the last whole 64-byte line are folded one by one into the low byte. Shares are
 * whole lines but the last, so the fold does not depend on `threads`.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define KVP_MAX_THREADS 64

typedef struct {
    const uint8_t *p;
    int64_t n;
    uint64_t out;
} kvp_share;

static uint64_t kvp_fold(const uint8_t *p, int64_t n) {
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t words = n / 64 * 8;
    for (int64_t i = 0; i < words; i += 8) {
        for (int j = 0; j < 8; j++) {
            uint64_t w;
            memcpy(&w, p + 8 * (i + j), 8); /* any alignment; compiles to one load */
            acc[j] ^= w;
        }
    }
    uint64_t out = 0;
    for (int j = 0; j < 8; j++) out ^= acc[j];
    for (int64_t i = words * 8; i < n; i++) out ^= p[i];
    return out;
}

static void *kvp_run(void *arg) {
    kvp_share *s = (kvp_share *)arg;
    s->out = kvp_fold(s->p, s->n);
    return NULL;
}

uint64_t kvp_read_pass(const uint8_t *p, int64_t n, int32_t threads) {
    if (threads < 1) threads = 1;
    if (threads > KVP_MAX_THREADS) threads = KVP_MAX_THREADS;
    if (threads == 1 || n < (1 << 20)) return kvp_fold(p, n);
    kvp_share shares[KVP_MAX_THREADS];
    pthread_t ids[KVP_MAX_THREADS];
    int started[KVP_MAX_THREADS];
    int64_t step = (n / threads + 63) / 64 * 64; /* whole cache lines per share */
    for (int t = 0; t < threads; t++) {
        int64_t begin = step * t < n ? step * t : n;
        int64_t end = begin + step < n ? begin + step : n;
        shares[t] = (kvp_share){p + begin, end - begin, 0};
        started[t] = t > 0 && pthread_create(&ids[t], NULL, kvp_run, &shares[t]) == 0;
    }
    uint64_t out = 0;
    for (int t = 0; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        } else {
            kvp_run(&shares[t]); /* share 0, or a thread that could not start */
        }
        out ^= shares[t].out;
    }
    return out;
}
