/* kvplane cpu_fused: fused flash-decoding absorbed MLA over a paged latent cache.
 *
 * Theory of operation
 * -------------------
 * One work item is (request b, key range [j0, j1)). It walks the range in blocks of KB keys
 * read straight from their pages (no gather): scores of every query row against the block
 * (4x3 register tiles, vectorised along the latent dimension), the per-row visibility range
 * [first, limit) applied (first > 0 under a sliding window; an item starts at its rows' first), then an online-softmax update of the item's running (m, l, acc) and the values
 * product (6 rows x 16 columns register tiles). A block is ~KB * D * 4 bytes, so the values
 * pass re-reads it from L1/L2: the cache is read from memory once, and while the values pass
 * computes, the next block's lines are prefetched one per step, so the next scores pass finds
 * them in cache. Keys at or past kv_len are never touched, so whatever sits there (NaN,
 * another request) cannot leak.
 * Items are shared by a few POSIX threads through an atomic counter; each thread owns its
 * scores and running-sum scratch. Each item writes its normalised out = acc / l and
 * lse = m + log l (rows that saw no key: 0 and -inf); items of one request are merged by LSE
 * by the caller.
 *
 * Element types: the cache is float32 (suffix f32) or bfloat16 (suffix bf16, widened on load);
 * queries, scores and outputs are float32. Compiled with GCC/Clang vector extensions, so the
 * same source builds AVX2+FMA code on x86-64 and plain code elsewhere.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KB 64
#define MAX_THREADS 64

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

static inline v8 load_f32(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f32(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float one_f32(const float *p) { return *p; }
static inline v8 load_bf16(const uint16_t *p) {
    v8u16 h; memcpy(&h, p, sizeof h);
    v8i w = __builtin_convertvector(h, v8i) << 16;
    return (v8)w;
}
static inline float one_bf16(const uint16_t *p) {
    uint32_t w = (uint32_t)*p << 16; float f; memcpy(&f, &w, sizeof f); return f;
}
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* e^x for x <= 0 (scores minus their running maximum); x < -87 (and -inf) gives exactly 0. */
static inline v8 exp8(v8 x) {
    const v8 lo = splat(-87.0f);
    v8i dead = x < lo;
    x = (v8)(((v8i)lo & dead) | ((v8i)x & ~dead));
    v8 t = x * splat(1.44269504088896341f);
    v8 n = (t + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest */
    v8 f = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8 p = splat(1.0f / 720);
    p = p * f + splat(1.0f / 120);
    p = p * f + splat(1.0f / 24);
    p = p * f + splat(1.0f / 6);
    p = p * f + splat(0.5f);
    p = p * f + splat(1.0f);
    p = p * f + splat(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8i bits = (v8i)(p * (v8)e) & ~dead;
    return (v8)bits;
}

typedef struct {
    const void *pool;
    int64_t page_stride, row_stride, page_size, dim, rank;
    const float *q; /* [B, rows, dim] */
    int64_t rows;
    const int64_t *table; /* [B, table_stride] */
    int64_t table_stride;
    const int64_t *kv_lens; /* [B] */
    const int64_t *limits;  /* [B, rows] keys visible to each row */
    const int64_t *firsts;  /* [B, rows] first key visible to each row; NULL: all 0 */
    const int64_t *items;   /* [n_items, 3]: b, j0, j1 */
    int64_t n_items;
    float *out; /* [n_items, rows, rank] */
    float *lse; /* [n_items, rows] */
    int bf16;
    atomic_long next;
} job_t;

/* Online-softmax update of one row for the block's scores s[0:nk]; turns s into p; returns
 * the factor the row's accumulator must be scaled by (1 when unchanged). */
static float softmax_row(float *s, int64_t nk, float *m, float *l) {
    v8 vm = splat(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= nk; j += 8) {
        const v8 x = load_f32(s + j);
        const v8i gt = x > vm;
        vm = (v8)(((v8i)x & gt) | ((v8i)vm & ~gt));
    }
    float bm = -INFINITY;
    for (int c = 0; c < 8; c++) bm = vm[c] > bm ? vm[c] : bm;
    for (; j < nk; j++) bm = s[j] > bm ? s[j] : bm;
    if (bm == -INFINITY) { memset(s, 0, (size_t)nk * sizeof *s); return 1.0f; }
    float mn = bm > *m ? bm : *m;
    float alpha = *m == -INFINITY ? 0.0f : expf(*m - mn);
    v8 sum = splat(0.0f);
    for (j = 0; j + 8 <= nk; j += 8) {
        v8 p = exp8(load_f32(s + j) - splat(mn));
        store_f32(s + j, p);
        sum += p;
    }
    float tail = 0.0f;
    for (; j < nk; j++) { s[j] = expf(s[j] - mn); tail += s[j]; }
    *l = *l * alpha + hsum(sum) + tail;
    *m = mn;
    return alpha;
}

#define INLINE static inline __attribute__((always_inline))

/* Element i of a cache row, and 8 elements from i, widened to float32 (bf16: constant). */
INLINE float one(const void *row, int64_t i, const int bf16) {
    return bf16 ? one_bf16((const uint16_t *)row + i) : one_f32((const float *)row + i);
}
INLINE v8 load8(const void *row, int64_t i, const int bf16) {
    return bf16 ? load_bf16((const uint16_t *)row + i) : load_f32((const float *)row + i);
}

/* Scores of NR query rows (q rows apart by dim) against NK keys: s[r * KB + c]. */
INLINE void scores_tile(const float *q, int64_t d, const void *const *k, float *s,
                        const int NR, const int NK, const int bf16) {
    v8 acc[4][3];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NK; c++) acc[r][c] = splat(0.0f);
    const int64_t dv = d & ~(int64_t)7;
    for (int64_t x = 0; x < dv; x += 8) {
        v8 kx[3];
        for (int c = 0; c < NK; c++) kx[c] = load8(k[c], x, bf16);
        for (int r = 0; r < NR; r++) {
            const v8 y = load_f32(q + r * d + x);
            for (int c = 0; c < NK; c++) acc[r][c] += y * kx[c];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NK; c++) {
            float t = hsum(acc[r][c]);
            for (int64_t x = dv; x < d; x++) t += q[r * d + x] * one(k[c], x, bf16);
            s[r * KB + c] = t;
        }
}

INLINE void scores_rows(const float *q, int64_t d, const void *const *k, float *s, int nr,
                        const int NK, const int bf16) {
    switch (nr) {
    case 4: scores_tile(q, d, k, s, 4, NK, bf16); break;
    case 3: scores_tile(q, d, k, s, 3, NK, bf16); break;
    case 2: scores_tile(q, d, k, s, 2, NK, bf16); break;
    default: scores_tile(q, d, k, s, 1, NK, bf16); break;
    }
}

/* s[r * KB + j] = q_r . k_j for every row and the block's nk keys. */
INLINE void scores(const job_t *a, const float *q, const void *const *k, int64_t nk, float *s,
                   const int bf16) {
    const int64_t d = a->dim, rows = a->rows;
    for (int64_t j = 0; j < nk; j += 3) {
        const int64_t kn = nk - j < 3 ? nk - j : 3;
        for (int64_t r = 0; r < rows; r += 4) {
            const int nr = rows - r < 4 ? (int)(rows - r) : 4;
            float *out = s + r * KB + j;
            if (kn == 3) scores_rows(q + r * d, d, k + j, out, nr, 3, bf16);
            else if (kn == 2) scores_rows(q + r * d, d, k + j, out, nr, 2, bf16);
            else scores_rows(q + r * d, d, k + j, out, nr, 1, bf16);
        }
    }
}

/* A walk over the cache lines of the next block's nb key rows: one prefetch per step. */
typedef struct { const void *const *next; int64_t row, nb; size_t off, bytes; } pf_t;
INLINE void pf_step(pf_t *f) {
    if (f->row >= f->nb) return;
    __builtin_prefetch((const char *)f->next[f->row] + f->off, 0, 3);
    f->off += 64;
    if (f->off >= f->bytes) { f->off = 0; f->row++; }
}

/* acc[r * rank + c .. c+16] += sum_j p[r * KB + j] * v_j[c .. c+16] for NR rows. */
INLINE void values_tile(const void *const *k, int64_t nk, const float *p, float *acc,
                        int64_t rank, int64_t c, const int NR, const int bf16, pf_t *pf) {
    v8 o[6][2];
    for (int r = 0; r < NR; r++) {
        o[r][0] = load_f32(acc + r * rank + c);
        o[r][1] = load_f32(acc + r * rank + c + 8);
    }
    for (int64_t j = 0; j < nk; j++) {
        const v8 v0 = load8(k[j], c, bf16), v1 = load8(k[j], c + 8, bf16);
        pf_step(pf);
        for (int r = 0; r < NR; r++) {
            const v8 w = splat(p[r * KB + j]);
            o[r][0] += w * v0;
            o[r][1] += w * v1;
        }
    }
    for (int r = 0; r < NR; r++) {
        store_f32(acc + r * rank + c, o[r][0]);
        store_f32(acc + r * rank + c + 8, o[r][1]);
    }
}

/* acc += p . v over the block; meanwhile the next block's nb key rows `next` are prefetched,
 * one cache line per key step of the tiles (a burst of prefetches would fill the miss buffers
 * and stall the arithmetic), so memory is busy while this pass computes from cache. */
INLINE void values(const job_t *a, const void *const *k, int64_t nk, const float *p,
                   float *acc, const void *const *next, int64_t nb, const int bf16) {
    const int64_t rank = a->rank, rows = a->rows, cv = rank & ~(int64_t)15;
    const size_t bytes = (size_t)a->dim * (bf16 ? 2 : 4);
    pf_t pf = {next, 0, nb, 0, bytes};
    if (cv == 0)
        while (pf.row < nb) pf_step(&pf);
    for (int64_t c = 0; c < cv; c += 16) {
        int64_t r = 0;
        for (; r + 6 <= rows; r += 6) values_tile(k, nk, p + r * KB, acc + r * rank, rank, c, 6, bf16, &pf);
        const float *pr = p + r * KB;
        float *ar = acc + r * rank;
        switch (rows - r) {
        case 5: values_tile(k, nk, pr, ar, rank, c, 5, bf16, &pf); break;
        case 4: values_tile(k, nk, pr, ar, rank, c, 4, bf16, &pf); break;
        case 3: values_tile(k, nk, pr, ar, rank, c, 3, bf16, &pf); break;
        case 2: values_tile(k, nk, pr, ar, rank, c, 2, bf16, &pf); break;
        case 1: values_tile(k, nk, pr, ar, rank, c, 1, bf16, &pf); break;
        default: break;
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nk; j++) {
            const float w = p[r * KB + j];
            for (int64_t c = cv; c < rank; c++) acc[r * rank + c] += w * one(k[j], c, bf16);
        }
}

static void scores_f32(const job_t *a, const float *q, const void *const *k, int64_t nk,
                       float *s) {
    scores(a, q, k, nk, s, 0);
}
static void scores_bf16(const job_t *a, const float *q, const void *const *k, int64_t nk,
                        float *s) {
    scores(a, q, k, nk, s, 1);
}
static void values_f32(const job_t *a, const void *const *k, int64_t nk, const float *p,
                       float *acc, const void *const *next, int64_t nb) {
    values(a, k, nk, p, acc, next, nb, 0);
}
static void values_bf16(const job_t *a, const void *const *k, int64_t nk, const float *p,
                        float *acc, const void *const *next, int64_t nb) {
    values(a, k, nk, p, acc, next, nb, 1);
}

/* kp[j] = the cache row of position pos + j of request b, for j < nk. */
static void key_rows(const job_t *a, int64_t b, int64_t pos, int64_t nk, const void **kp) {
    const size_t esize = a->bf16 ? 2 : 4;
    for (int64_t j = 0; j < nk; j++) {
        const int64_t page = a->table[b * a->table_stride + (pos + j) / a->page_size];
        const int64_t off = page * a->page_stride + ((pos + j) % a->page_size) * a->row_stride;
        kp[j] = (const char *)a->pool + (size_t)off * esize;
    }
}

/* One item: the running (m, l, acc) live in its lse and out rows and the thread's l. */
static void attend_item(job_t *a, int64_t it, float *s, const void **kp, float *l) {
    const int64_t b = a->items[it * 3], j1 = a->items[it * 3 + 2];
    const int64_t rows = a->rows, rank = a->rank, kv = a->kv_lens[b];
    const int64_t *lim = a->limits + b * rows, *fst = a->firsts ? a->firsts + b * rows : NULL;
    float *acc = a->out + it * rows * rank, *m = a->lse + it * rows;
    memset(acc, 0, (size_t)(rows * rank) * sizeof *acc);
    int64_t end = 0, begin = kv;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY; l[r] = 0.0f;
        end = lim[r] > end ? lim[r] : end;
        const int64_t f = fst ? fst[r] : 0;
        begin = lim[r] > f && f < begin ? f : begin;
    }
    end = end < kv ? end : kv;
    end = end < j1 ? end : j1;
    const int64_t j0 = a->items[it * 3 + 1] > begin ? a->items[it * 3 + 1] : begin;
    const float *q = a->q + b * rows * a->dim;
    for (int64_t jb = j0; jb < end; jb += KB) {
        const int64_t nk = end - jb < KB ? end - jb : KB;
        if (jb == j0) key_rows(a, b, jb, nk, kp);
        const int64_t nb = end - jb - nk < KB ? end - jb - nk : KB;
        key_rows(a, b, jb + nk, nb, kp + KB);
        if (a->bf16) scores_bf16(a, q, kp, nk, s);
        else scores_f32(a, q, kp, nk, s);
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * KB;
            int64_t vis = (lim[r] < kv ? lim[r] : kv) - jb;
            for (int64_t j = vis < 0 ? 0 : vis; j < nk; j++) sr[j] = -INFINITY;
            const int64_t skip = fst ? fst[r] - jb : 0;
            for (int64_t j = 0; j < skip && j < nk; j++) sr[j] = -INFINITY;
            float alpha = softmax_row(sr, nk, m + r, l + r);
            if (alpha != 1.0f)
                for (int64_t c = 0; c < rank; c++) acc[r * rank + c] *= alpha;
        }
        if (a->bf16) values_bf16(a, kp, nk, s, acc, kp + KB, nb);
        else values_f32(a, kp, nk, s, acc, kp + KB, nb);
        memcpy(kp, kp + KB, (size_t)nb * sizeof *kp);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t c = 0; c < rank; c++) acc[r * rank + c] *= inv;
        m[r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    }
}

static void *worker(void *arg) {
    job_t *a = arg;
    float *s = malloc((size_t)(a->rows * KB) * sizeof *s);
    const void **kp = malloc(2 * KB * sizeof *kp); /* this block, the next */
    float *l = malloc((size_t)a->rows * sizeof *l);
    if (s != NULL && kp != NULL && l != NULL) {
        for (;;) {
            long it = atomic_fetch_add(&a->next, 1);
            if (it >= a->n_items) break;
            attend_item(a, it, s, kp, l);
        }
    }
    free(l);
    free(s);
    free((void *)kp);
    return NULL;
}

/* Returns 0 on success, 1 when no thread could get its scratch memory (items left undone). */
int kvp_mla_attend(const void *pool, int64_t page_stride, int64_t row_stride, int64_t page_size,
                   int64_t dim, int64_t rank, int bf16, const float *q, int64_t rows,
                   const int64_t *table, int64_t table_stride, const int64_t *kv_lens,
                   const int64_t *limits, const int64_t *firsts, const int64_t *items,
                   int64_t n_items, float *out, float *lse, int threads) {
    job_t a = {.pool = pool, .page_stride = page_stride, .row_stride = row_stride,
               .page_size = page_size, .dim = dim, .rank = rank, .q = q, .rows = rows,
               .table = table, .table_stride = table_stride, .kv_lens = kv_lens,
               .limits = limits, .firsts = firsts, .items = items, .n_items = n_items, .out = out, .lse = lse,
               .bf16 = bf16};
    atomic_init(&a.next, 0);
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    threads = threads > n_items ? (int)n_items : threads;
    pthread_t tid[MAX_THREADS];
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tid[started], NULL, worker, &a) != 0) break;
        started++;
    }
    worker(&a);
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    return atomic_load(&a.next) < n_items;
}
