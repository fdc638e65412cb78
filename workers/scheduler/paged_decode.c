/* Decode attention over the paged KV cache, read in place (bf16 storage, fp32 math).
 * Built at load by paged_decode.py (gcc -O3 -march=native -ffast-math -fopenmp, linked
 * without -ffast-math); the OpenMP runtime is the one torch already loaded (same soname),
 * so this shares its threads.
 *
 * One task per (sequence, kv head): the group's query heads are scored against the context
 * block by block (each K/V row converted to fp32 once, used by every query of the group),
 * softmaxed in fp32, and V summed with those weights; no gathered copy of the context. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* q: [B, H, D] with rows `q_stride` apart; k, v: [KVH, slots, D]; out: [B, H, D];
 * tables: [B, max_blocks]; lens: [B] (context length, the new token's K/V included). */
int paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                      uint16_t *out, const int32_t *tables, int max_blocks, const int32_t *lens,
                      int B, int H, int KVH, int D, int64_t slots, int block_size, float scale) {
    int G = H / KVH;
    if (D > MAX_HEAD_DIM || G > MAX_GROUP || G * KVH != H) return -1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int task = 0; task < B * KVH; task++) {
        int b = task / KVH, h = task % KVH, len = lens[b];
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];
        float denom[MAX_GROUP];
        float *scores = malloc(sizeof(float) * (size_t)G * (size_t)len);
        if (scores == NULL || len < 1) {
            failed = 1;
            free(scores);
            continue;
        }
        const int32_t *table = tables + (size_t)b * max_blocks;
        const uint16_t *kh = k + (size_t)h * slots * D, *vh = v + (size_t)h * slots * D;
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++)
                qf[g][d] = bf16_to_float(q[b * q_stride + (size_t)(h * G + g) * D + d]) * scale;
        for (int start = 0, blk = 0; start < len; start += block_size, blk++) {
            const uint16_t *kb = kh + (size_t)table[blk] * block_size * D;
            int n = len - start < block_size ? len - start : block_size;
            for (int i = 0; i < n; i++) {
#pragma omp simd
                for (int d = 0; d < D; d++) row[d] = bf16_to_float(kb[(size_t)i * D + d]);
                for (int g = 0; g < G; g++) {
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; d++) s += qf[g][d] * row[d];
                    scores[(size_t)g * len + start + i] = s;
                }
            }
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
            for (int d = 0; d < D; d++) acc[g][d] = 0.f;
        }
        for (int start = 0, blk = 0; start < len; start += block_size, blk++) {
            const uint16_t *vb = vh + (size_t)table[blk] * block_size * D;
            int n = len - start < block_size ? len - start : block_size;
            for (int i = 0; i < n; i++) {
#pragma omp simd
                for (int d = 0; d < D; d++) row[d] = bf16_to_float(vb[(size_t)i * D + d]);
                for (int g = 0; g < G; g++) {
                    float p = scores[(size_t)g * len + start + i];
#pragma omp simd
                    for (int d = 0; d < D; d++) acc[g][d] += p * row[d];
                }
            }
        }
        for (int g = 0; g < G; g++) {
            float inv = 1.f / denom[g];
            uint16_t *o = out + ((size_t)b * H + h * G + g) * D;
            for (int d = 0; d < D; d++) o[d] = float_to_bf16(acc[g][d] * inv);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
