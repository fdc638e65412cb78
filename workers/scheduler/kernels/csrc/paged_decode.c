/* Decode attention over the paged KV cache, read in place (bf16 or fp32 storage, fp32 math;
 * queries bf16 over bf16, fp32 over fp32 or fp32 over bf16).
 * Built at load by paged_decode.py (gcc -O3 -march=native -ffast-math -fopenmp, linked
 * without -ffast-math); the OpenMP runtime is the one torch already loaded (same soname),
 * so this shares its threads.
 *
 * One task per (sequence, kv head): the group's query heads are scored against the context
 * block by block, softmaxed in fp32, and V summed with those weights; no gathered copy of
 * the context. The next block is prefetched while one is worked on (a context's blocks lie
 * apart in the cache, so cold reads would stall it). With AVX-512, a block's K rows
 * are widened to fp32 once for every query of the group, 16 dot products are summed in one
 * transpose-and-add tree, and (head_dim 64, at most 4 queries per kv head, as SmolLM2's)
 * the weighted V sum stays in registers. With AVX2 alone the same in 8 lanes: 8 dot products
 * a tree, the V sum of one query (head_dim 64) in registers, where the plain loops' horizontal
 * sum per row and copy of every row run far below the CPU's rate. Elsewhere plain loops that
 * gcc vectorizes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16


#define INLINE static inline __attribute__((always_inline))

/* Storage: bf16 (2 bytes an element) or fp32. Every function below takes `bf16` as a
 * constant from one of the two entry points, so gcc builds each path apart. */
INLINE const void *at(const void *base, size_t index, int bf16) {
    return (const char *)base + index * (bf16 ? sizeof(uint16_t) : sizeof(float));
}

INLINE float load1(const void *base, size_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

INLINE void prefetch_block(const void *block, int rows, int D, int bf16) {
    const char *p = (const char *)block;
    size_t bytes = (size_t)rows * D * (bf16 ? sizeof(uint16_t) : sizeof(float));
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

#ifdef __AVX512F__
INLINE __m512 load16(const void *base, size_t index, int bf16) { /* 16 elements as fp32 */
    if (!bf16) return _mm512_loadu_ps((const float *)base + index);
    const __m256i *p = (const __m256i *)((const uint16_t *)base + index);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
}

/* Lane j of the result: the sum of the 16 lanes of v[j] (45 shuffles and adds for 16 dot
 * products instead of 16 horizontal sums). */
INLINE __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4], x[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: pairs of partial sums */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: one partial sum of each of 4 inputs */
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* lanes 0+2 and 1+3 */
        x[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* scores[i] = q . k_i for the first n <= 16 fp32 rows of k (D a multiple of 16). */
INLINE void score16(const float *q, const float *k, int n, int D, float *scores) {
    __m512 parts[16];
    for (int i = 0; i < 16; i++) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; i < n && d < D; d += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(k + (size_t)i * D + d),
                                  _mm512_loadu_ps(q + d), acc);
        parts[i] = acc;
    }
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << n) - 1u), sum16(parts));
}

/* acc[g][0..63] += sum_i p[g * p_stride + i] * v_i over n rows of v (D 64, G <= 4). */
INLINE void weigh64(const void *v, int n, const float *p, size_t p_stride, int G,
                    float (*acc)[MAX_HEAD_DIM], int bf16) {
    __m512 a[4][4];
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 4; j++)
            a[g][j] = g < G ? _mm512_loadu_ps(acc[g] + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < n; i++) {
        __m512 row[4];
        for (int j = 0; j < 4; j++) row[j] = load16(v, (size_t)i * 64 + 16 * j, bf16);
        for (int g = 0; g < 4 && g < G; g++) {
            __m512 w = _mm512_set1_ps(p[g * p_stride + i]);
            for (int j = 0; j < 4; j++) a[g][j] = _mm512_fmadd_ps(row[j], w, a[g][j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc[g] + 16 * j, a[g][j]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__)
INLINE __m256 load8(const void *base, size_t index, int bf16) { /* 8 elements as fp32 */
    if (!bf16) return _mm256_loadu_ps((const float *)base + index);
    const __m128i *p = (const __m128i *)((const uint16_t *)base + index);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
}
/* Lane j of the result: the sum of the 8 lanes of v[j]. */
INLINE __m256 sum8(const __m256 v[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* scores[i] = q . k_i for the first n <= 8 fp32 rows of k (D a multiple of 8). */
INLINE void score8(const float *q, const float *k, int n, int D, float *scores) {
    __m256 parts[8];
    for (int i = 0; i < 8; i++) {
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; i < n && d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(k + (size_t)i * D + d), _mm256_loadu_ps(q + d), acc);
        parts[i] = acc;
    }
    float all[8];
    _mm256_storeu_ps(all, sum8(parts));
    memcpy(scores, all, sizeof(float) * (size_t)n);
}
/* acc[0..63] += sum_i p[i] * v_i over n fp32 rows of v (D 64). */
INLINE void weigh8x64(const float *v, int n, const float *p, float *acc) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + 8 * j);
    for (int i = 0; i < n; i++) {
        __m256 w = _mm256_set1_ps(p[i]);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(v + (size_t)i * 64 + 8 * j), w, a[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + 8 * j, a[j]);
}
/* n rows of D elements as fp32: `rows` itself when fp32, else widened into `buffer`. */
INLINE const float *as_f32(const void *rows, int n, int D, float *buffer, int bf16) {
    if (!bf16) return (const float *)rows;
    for (int i = 0; i < n * D; i += 8) _mm256_storeu_ps(buffer + i, load8(rows, (size_t)i, bf16));
    return buffer;
}
#endif
/* scores[g * len + start + i] = qf[g] . k_i for the n rows of one K block. */
INLINE void score_block(const void *kb, int n, int D, int G, float (*qf)[MAX_HEAD_DIM],
                        float *scores, int len, int start, int bf16) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        float kf[16 * MAX_HEAD_DIM]; /* bf16 rows widened once for every query of the group */
        for (int first = 0; first < n; first += 16) {
            int rows = n - first < 16 ? n - first : 16;
            const float *k = (const float *)at(kb, (size_t)first * D, bf16);
            if (bf16) {
                for (int i = 0; i < rows * D; i += 16)
                    _mm512_storeu_ps(kf + i, load16(kb, (size_t)first * D + i, bf16));
                k = kf;
            }
            for (int g = 0; g < G; g++)
                score16(qf[g], k, rows, D, scores + (size_t)g * len + start + first);
        }
        return;
    }
#elif defined(__AVX2__)
    if (D % 8 == 0) {
        float kf[8 * MAX_HEAD_DIM]; /* bf16 rows widened once for every query of the group */
        for (int first = 0; first < n; first += 8) {
            int rows = n - first < 8 ? n - first : 8;
            const float *k = as_f32(at(kb, (size_t)first * D, bf16), rows, D, kf, bf16);
            for (int g = 0; g < G; g++) score8(qf[g], k, rows, D, scores + (size_t)g * len + start + first);
        }
        return;
    }
#endif
    float row[MAX_HEAD_DIM];
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int d = 0; d < D; d++) row[d] = load1(kb, (size_t)i * D + d, bf16);
        for (int g = 0; g < G; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qf[g][d] * row[d];
            scores[(size_t)g * len + start + i] = s;
        }
    }
}

/* acc[g] += sum_i p_g[start + i] * v_i for the n rows of one V block. */
INLINE void weigh_block(const void *vb, int n, int D, int G, const float *scores, int len,
                        int start, float (*acc)[MAX_HEAD_DIM], int bf16) {
#ifdef __AVX512F__
    if (D == 64 && G <= 4) {
        weigh64(vb, n, scores + start, (size_t)len, G, acc, bf16);
        return;
    }
#elif defined(__AVX2__)
    if (D == 64) {
        float vf[8 * 64];
        for (int first = 0; first < n; first += 8) {
            int rows = n - first < 8 ? n - first : 8;
            const float *v = as_f32(at(vb, (size_t)first * D, bf16), rows, D, vf, bf16);
            for (int g = 0; g < G; g++) weigh8x64(v, rows, scores + (size_t)g * len + start + first, acc[g]);
        }
        return;
    }
#endif
    float row[MAX_HEAD_DIM];
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int d = 0; d < D; d++) row[d] = load1(vb, (size_t)i * D + d, bf16);
        for (int g = 0; g < G; g++) {
            float p = scores[(size_t)g * len + start + i];
#pragma omp simd
            for (int d = 0; d < D; d++) acc[g][d] += p * row[d];
        }
    }
}

/* One (sequence b, kv head h) of a decode step; 0, or 1 if out of memory. */
INLINE int decode_task(int b, int h, const void *q, int64_t q_stride, const void *k,
                       const void *v, void *out, const int32_t *tables, int max_blocks,
                       const int32_t *lens, int H, int KVH, int D, int64_t slots,
                       int block_size, float scale, int q_bf16, int kv_bf16) {
    int G = H / KVH, len = lens[b];
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], denom[MAX_GROUP];
    float *scores = malloc(sizeof(float) * (size_t)G * (size_t)len);
    if (scores == NULL) return 1;
    const int32_t *table = tables + (size_t)b * max_blocks;
    const void *kh = at(k, (size_t)h * slots * D, kv_bf16);
    const void *vh = at(v, (size_t)h * slots * D, kv_bf16);
    size_t block_elems = (size_t)block_size * D;
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++)
            qf[g][d] = load1(q, b * q_stride + (size_t)(h * G + g) * D + d, q_bf16) * scale;
    for (int start = 0, blk = 0; start < len; start += block_size, blk++) {
        int n = len - start < block_size ? len - start : block_size;
        if (start + block_size < len)
            prefetch_block(at(kh, table[blk + 1] * block_elems, kv_bf16), n, D, kv_bf16);
        score_block(at(kh, table[blk] * block_elems, kv_bf16), n, D, G, qf, scores, len, start,
                    kv_bf16);
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + (size_t)g * len, top = sg[0], sum = 0.f;
        for (int t = 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - top);
            sum += sg[t];
        }
        denom[g] = sum;
        memset(acc[g], 0, sizeof(float) * D);
    }
    for (int start = 0, blk = 0; start < len; start += block_size, blk++) {
        int n = len - start < block_size ? len - start : block_size;
        if (start + block_size < len)
            prefetch_block(at(vh, table[blk + 1] * block_elems, kv_bf16), n, D, kv_bf16);
        weigh_block(at(vh, table[blk] * block_elems, kv_bf16), n, D, G, scores, len, start, acc,
                    kv_bf16);
    }
    for (int g = 0; g < G; g++) {
        float inv = 1.f / denom[g];
        size_t row = ((size_t)b * H + h * G + g) * D;
        for (int d = 0; d < D; d++) {
            if (q_bf16)
                ((uint16_t *)out)[row + d] = float_to_bf16(acc[g][d] * inv);
            else
                ((float *)out)[row + d] = acc[g][d] * inv;
        }
    }
    free(scores);
    return 0;
}

static int bad_shape(const int32_t *lens, int B, int H, int KVH, int D) {
    if (KVH < 1 || H % KVH || H / KVH > MAX_GROUP || D > MAX_HEAD_DIM) return 1;
    for (int b = 0; b < B; b++)
        if (lens[b] < 1) return 1;
    return 0;
}

/* q: [B, H, D] with rows `q_stride` elements apart; k, v: [KVH, slots, D]; out: [B, H, D]
 * (q's type); tables: [B, max_blocks]; lens: [B] (context length, the new token's K/V
 * included). Returns 0, -1 for shapes the kernel does not take, -2 when out of memory. */
#define ENTRY_POINT(name, q_elem, kv_elem, q_bf16, kv_bf16)                                     \
    int name(const q_elem *q, int64_t q_stride, const kv_elem *k, const kv_elem *v,            \
             q_elem *out, const int32_t *tables, int max_blocks, const int32_t *lens, int B,   \
             int H, int KVH, int D, int64_t slots, int block_size, float scale) {              \
        if (bad_shape(lens, B, H, KVH, D)) return -1;                                          \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for schedule(dynamic, 1) reduction(| : failed)")                 \
        for (int task = 0; task < B * KVH; task++)                                             \
            failed |= decode_task(task / KVH, task % KVH, q, q_stride, k, v, out, tables,      \
                                  max_blocks, lens, H, KVH, D, slots, block_size, scale,       \
                                  q_bf16, kv_bf16);                                            \
        return failed ? -2 : 0;                                                                \
    }

ENTRY_POINT(paged_decode_bf16, uint16_t, uint16_t, 1, 1)
ENTRY_POINT(paged_decode_f32, float, float, 0, 0)
/* fp32 queries over a bf16 cache (`--kv-cache-dtype bfloat16` on an fp32 model) */
ENTRY_POINT(paged_decode_f32_bf16kv, float, uint16_t, 0, 1)
