/* A whole W8A8 projection in one call (`--quantization w8a8_int8`, w8a8.py): each
 * token's activations (times the inverse smoothing, outlier channels zeroed) quantized to
 * int8 with their own scale, int8 x int8 dot products summed in int32, dequantized with the
 * token's and the output channel's scales, plus the outlier channels' product in fp32;
 * bf16 or fp32 in and out. Built at load by c_build.py (gcc -O3 -march=native -fopenmp).
 *
 * Weights come packed as [N / TILE_N][K / 4][TILE_N channels][4 bytes]: one k-step of a
 * block's channels lies contiguous, 4 bytes per channel as the byte dot products take them
 * (4 unsigned activation bytes x 4 signed weight bytes summed into one 32-bit lane).
 * Activations go in as q + 128 (unsigned); `colsum` holds 128 * sum_k w[n][k] to take back
 * out. A tile is 4 tokens x one block, the k-step's weights loaded once into registers for
 * all four tokens; one OpenMP task per block. Three paths, by what the CPU has:
 * - AVX512-VNNI: vpdpbusd, blocks of 64 channels (four zmm), 8-bit weights; where the CPU
 *   has AMX-INT8 too (Sapphire Rapids on), tiles of 16 tokens x a block through tdpbusd
 *   (see the AMX notes below);
 * - AVX2: vpmaddubsw + vpmaddwd, blocks of 16 channels, 7-bit weights (see its notes);
 * - neither: plain loops over the same layout (for the tests; w8a8.py offers the
 *   kernel only where `w8a8_vectorized()` is not 0).
 * `w8a8_tile_n()` and `w8a8_weight_levels()` tell the packing code which.
 *
 * `w8a16_linear`: the same with 16-bit activations and 8-bit weights, for inputs whose
 * outliers cost W8A8 too much (down_proj's silu(gate) * up). vpmaddwd multiplies int16
 * pairs, 16 products an instruction: per multiply the same rate as vpmaddubsw + vpmaddwd's
 * 32 bytes in two. Weights packed [N / 16][K / 2][16 channels][2 bytes], sign-extended to
 * int16 as they load; activations scaled to `w8a16_activation_levels(K)`, so that the
 * int32 sums cannot overflow. Vectorized wherever the CPU has AVX2. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define W8A8_AMX 1
#include "amx.h"
#endif

/* Output channels per packed block, and the weights' levels ([-WEIGHT_LEVELS, +...]). */
#if defined(__AVX512VNNI__)
#define TILE_N 64
#define WEIGHT_LEVELS 127
#elif defined(__AVX2__)
#define TILE_N 16
#define WEIGHT_LEVELS 63
#else
#define TILE_N 64
#define WEIGHT_LEVELS 127
#endif
#define TILE_M 4

static inline float load1(const void *x, size_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

typedef struct {
    const int8_t *packed;       /* [N / TILE_N][K / 4][TILE_N][4]; W8A16: [N / 16][K / 2][16][2] */
    const int32_t *colsum;      /* [N] 128 * sum_k w[n][k]; NULL for W8A16 (signed activations) */
    const float *scale;         /* [N] per output channel */
    const int32_t *outliers;    /* [n_out] input channels multiplied apart */
    const float *outlier_w;     /* [N / tile][n_out][tile] */
    int n_out;
    int tile;                   /* output channels per packed block */
} Weights;

typedef struct {
    const void *q; /* [M][K] uint8 q + 128, or int16 q for W8A16 */
    const float *scale; /* [M] */
    const float *outlier_x; /* [M][n_out] */
} Activations;

/* Per token: x * inverse_smooth scaled to [-levels, levels] by its largest |value|, as
 * uint8 q + 128 or (`wide`) int16. Each branch of `x_bf16` and `wide` gets its own copy of
 * the loops (inlined with constants), so gcc vectorizes them: scalar, this pass would be a
 * large share of a projection. */
static inline __attribute__((always_inline)) void quantize_rows(const void *x, const int x_bf16, const int wide,
                                                                int M, int K, const float *inverse_smooth,
                                                                const Weights *w, float levels, void *q,
                                                                float *scale, float *outlier_x) {
#pragma omp parallel for schedule(static) if (M >= 64)
    for (int m = 0; m < M; m++) {
        size_t row = (size_t)m * K;
        float amax = 0.f;
        for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(load1(x, row + k, x_bf16) * inverse_smooth[k]));
        float s = amax > 1e-30f ? amax / levels : 1.f, inv = 1.f / s;
        for (int k = 0; k < K; k++) {
            int v = (int)nearbyintf(fminf(fmaxf(load1(x, row + k, x_bf16) * inverse_smooth[k] * inv, -levels), levels));
            if (wide)
                ((int16_t *)q)[row + k] = (int16_t)v;
            else
                ((uint8_t *)q)[row + k] = (uint8_t)(v + 128);
        }
        scale[m] = s;
        for (int o = 0; o < w->n_out; o++) outlier_x[m * w->n_out + o] = load1(x, row + w->outliers[o], x_bf16);
    }
}

static void quantize(const void *x, int x_bf16, int wide, int M, int K, const float *inverse_smooth,
                     const Weights *w, float levels, void *q, float *scale, float *outlier_x) {
    if (wide && x_bf16)
        quantize_rows(x, 1, 1, M, K, inverse_smooth, w, levels, q, scale, outlier_x);
    else if (wide)
        quantize_rows(x, 0, 1, M, K, inverse_smooth, w, levels, q, scale, outlier_x);
    else if (x_bf16)
        quantize_rows(x, 1, 0, M, K, inverse_smooth, w, levels, q, scale, outlier_x);
    else
        quantize_rows(x, 0, 0, M, K, inverse_smooth, w, levels, q, scale, outlier_x);
}

/* Output channel n of token m from its int32 sum: dequantized, plus the outliers. */
static inline float finish1(int32_t sum, int m, int n, const Weights *w, const Activations *a) {
    float v = (float)(sum - (w->colsum ? w->colsum[n] : 0)) * a->scale[m] * w->scale[n];
    const float *ow = w->outlier_w + (size_t)(n / w->tile) * w->n_out * w->tile + n % w->tile;
    for (int o = 0; o < w->n_out; o++) v += a->outlier_x[m * w->n_out + o] * ow[o * w->tile];
    return v;
}

static inline void store1(void *out, size_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[i] = float_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

#ifndef __AVX2__
/* Either layout's tile in plain loops: tokens m0..m0+tile_m-1 x one block of w->tile
 * channels, k-steps of 4 bytes (W8A8, q + 128) or of 2 (`wide`: W8A16, int16 q). */
static void plain_tile(int wide, int tile_m, int m0, int block, int M, int K, int N, const Weights *w,
                       const Activations *a, void *out, int bf16) {
    int step = wide ? 2 : 4, tile = w->tile;
    const int8_t *p = w->packed + (size_t)block * K * tile;
    for (int m = m0; m < m0 + tile_m && m < M; m++) {
        size_t row = (size_t)m * K;
        for (int c = 0; c < tile; c++) {
            int32_t sum = 0;
            for (int k = 0; k < K; k++) {
                int32_t x = wide ? ((const int16_t *)a->q)[row + k] : ((const uint8_t *)a->q)[row + k];
                sum += x * p[(size_t)(k / step) * step * tile + c * step + k % step];
            }
            int n = block * tile + c;
            store1(out, (size_t)m * N + n, finish1(sum, m, n, w, a), bf16);
        }
    }
}
#endif

#ifdef __AVX2__
static inline void store8(void *out, size_t i, __m256 v, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)out + i, v);
        return;
    }
    __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), halves);
}

/* 8 channels n.. of token m from their int32 sums. */
static void finish8(__m256i sum, int m, int n, const Weights *w, const Activations *a,
                    void *out, int N, int bf16) {
    __m256i centred = w->colsum ? _mm256_sub_epi32(sum, _mm256_loadu_si256((const __m256i *)(w->colsum + n))) : sum;
    __m256 scale = _mm256_mul_ps(_mm256_set1_ps(a->scale[m]), _mm256_loadu_ps(w->scale + n));
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(centred), scale);
    const float *ow = w->outlier_w + (size_t)(n / w->tile) * w->n_out * w->tile + n % w->tile;
    for (int o = 0; o < w->n_out; o++)
        v = _mm256_fmadd_ps(_mm256_set1_ps(a->outlier_x[m * w->n_out + o]), _mm256_loadu_ps(ow + o * w->tile), v);
    store8(out, (size_t)m * N + n, v, bf16);
}

#endif

#ifdef __AVX512VNNI__

static inline void store16(void *out, size_t i, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(rounded));
}

/* 16 channels n.. of token m from their int32 sums. */
static void finish16(__m512i sum, int m, int n, const Weights *w, const Activations *a,
                     void *out, int N, int bf16) {
    __m512i centred = _mm512_sub_epi32(sum, _mm512_loadu_si512(w->colsum + n));
    __m512 scale = _mm512_mul_ps(_mm512_set1_ps(a->scale[m]), _mm512_loadu_ps(w->scale + n));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(centred), scale);
    const float *ow = w->outlier_w + (size_t)(n / TILE_N) * w->n_out * TILE_N + n % TILE_N;
    for (int o = 0; o < w->n_out; o++)
        v = _mm512_fmadd_ps(_mm512_set1_ps(a->outlier_x[m * w->n_out + o]), _mm512_loadu_ps(ow + o * TILE_N), v);
    store16(out, (size_t)m * N + n, v, bf16);
}

#define DOT4(s0, s1, s2, s3, row)                                                    \
    do {                                                                             \
        __m512i xb = _mm512_set1_epi32(*(const int32_t *)((row) + 4 * k4));           \
        s0 = _mm512_dpbusd_epi32(s0, xb, w0);                                        \
        s1 = _mm512_dpbusd_epi32(s1, xb, w1);                                        \
        s2 = _mm512_dpbusd_epi32(s2, xb, w2);                                        \
        s3 = _mm512_dpbusd_epi32(s3, xb, w3);                                        \
    } while (0)

/* Tokens m0..m0+3 (past M: token M-1 again, not stored) x channels 64 * block... */
static void tile(int m0, int block, int M, int K, int N, const Weights *w, const Activations *a,
                 void *out, int bf16) {
    const uint8_t *r0 = (const uint8_t *)a->q + (size_t)m0 * K;
    const uint8_t *r1 = (const uint8_t *)a->q + (size_t)(m0 + 1 < M ? m0 + 1 : M - 1) * K;
    const uint8_t *r2 = (const uint8_t *)a->q + (size_t)(m0 + 2 < M ? m0 + 2 : M - 1) * K;
    const uint8_t *r3 = (const uint8_t *)a->q + (size_t)(m0 + 3 < M ? m0 + 3 : M - 1) * K;
    __m512i s00 = _mm512_setzero_si512(), s01 = s00, s02 = s00, s03 = s00;
    __m512i s10 = s00, s11 = s00, s12 = s00, s13 = s00;
    __m512i s20 = s00, s21 = s00, s22 = s00, s23 = s00;
    __m512i s30 = s00, s31 = s00, s32 = s00, s33 = s00;
    const int8_t *p = w->packed + (size_t)block * (K / 4) * 4 * TILE_N;
    for (int k4 = 0; k4 < K / 4; k4++, p += 4 * TILE_N) {
        __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 64);
        __m512i w2 = _mm512_loadu_si512(p + 128), w3 = _mm512_loadu_si512(p + 192);
        /* In registers for all four tokens (gcc would fold them into each vpdpbusd as
         * memory operands: four times the loads). */
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
        for (int ahead = 2048; ahead < 2048 + 4 * TILE_N; ahead += 64) _mm_prefetch((const char *)(p + ahead), _MM_HINT_T0);
        DOT4(s00, s01, s02, s03, r0);
        DOT4(s10, s11, s12, s13, r1);
        DOT4(s20, s21, s22, s23, r2);
        DOT4(s30, s31, s32, s33, r3);
    }
    __m512i sums[TILE_M][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23}, {s30, s31, s32, s33}};
    for (int i = 0; i < TILE_M && m0 + i < M; i++)
        for (int j = 0; j < 4; j++) finish16(sums[i][j], m0 + i, block * TILE_N + 16 * j, w, a, out, N, bf16);
}

#ifdef W8A8_AMX
/* AMX: tdpbusd multiplies a tile of 16 tokens x 64 activation bytes (unsigned) by one of
 * 16 k-steps x 16 channels x 4 weight bytes (signed) into 16 x 16 int32 sums: 16,384
 * products an instruction, where vpdpbusd does 64. The VNNI layout above is already the
 * weight tile's: channels 16j.. of a block over 16 k-steps lie 4 * TILE_N bytes apart, the
 * stride tileloadd takes. Tile registers: 0-3 the sums of the block's four 16-channel
 * quarters, 4 the activations, 5 and 6 weights (loaded alternately, so a load overlaps the
 * previous product). Linux hands tile state out per process on request (`amx_granted`);
 * each thread loads its own tile configuration. K must be whole 64-byte tile rows. */
#define AMX_M 16
#define AMX_K 64

static void amx_configure(int rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) config.rows[t] = (uint8_t)rows, config.colsb[t] = 64; /* sums */
    config.rows[4] = (uint8_t)rows, config.colsb[4] = AMX_K;                          /* activations */
    config.rows[5] = config.rows[6] = AMX_K / 4, config.colsb[5] = config.colsb[6] = 4 * 16; /* weights */
    _tile_loadconfig(&config);
}

/* Tokens m0..m0+rows-1 (rows <= 16) x channels 64 * block... */
static void amx_tile(int m0, int rows, int block, int K, int N, const Weights *w, const Activations *a,
                     void *out, int bf16) {
    int32_t sums[AMX_M * TILE_N] __attribute__((aligned(64)));
    const uint8_t *x = (const uint8_t *)a->q + (size_t)m0 * K;
    const int8_t *p = w->packed + (size_t)block * (K / 4) * 4 * TILE_N;
    const size_t weight_stride = 4 * TILE_N, step = (size_t)(AMX_K / 4) * 4 * TILE_N;
    amx_configure(rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += AMX_K, p += step) {
        _tile_loadd(4, x + k, K);
        _tile_loadd(5, p, weight_stride);
        _tile_dpbusd(0, 4, 5);
        _tile_loadd(6, p + 64, weight_stride);
        _tile_dpbusd(1, 4, 6);
        _tile_loadd(5, p + 128, weight_stride);
        _tile_dpbusd(2, 4, 5);
        _tile_loadd(6, p + 192, weight_stride);
        _tile_dpbusd(3, 4, 6);
    }
    _tile_stored(0, sums, 4 * TILE_N);
    _tile_stored(1, sums + 16, 4 * TILE_N);
    _tile_stored(2, sums + 32, 4 * TILE_N);
    _tile_stored(3, sums + 48, 4 * TILE_N);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            finish16(_mm512_load_si512(sums + i * TILE_N + 16 * j), m0 + i, block * TILE_N + 16 * j, w, a, out, N,
                     bf16);
}
#endif
#elif defined(__AVX2__)
/* AVX2 has no vpdpbusd; its vpmaddubsw (unsigned x signed bytes, pairs summed into int16,
 * then vpmaddwd by ones sums the two pairs into int32) saturates at 32767, which
 * 255 * 127 * 2 overflows. So this build takes weights in 7 bits, [-63, 63]: pairs stay
 * within 255 * 63 * 2, exact (fbgemm keeps 7 bits of the activations instead). The exact
 * 8 x 8-bit alternative, llama.cpp's (the activation's sign moved onto the weight with
 * vpsignb, its magnitude unsigned), takes more instructions and runs much slower
 * (bench/README.md). 16 ymm registers hold 4 tokens x 16 channels, so a block is 16
 * channels here. */

/* Tokens m0..m0+T-1 x channels 16 * block...: per k-step two ymm of weights, then per
 * token and register a vpmaddubsw, a vpmaddwd and a vpaddd. */
static inline __attribute__((always_inline)) void tile_of(const int T, int m0, int block, int K, int N,
                                                          const Weights *w, const Activations *a,
                                                          void *out, int bf16) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int32_t *rows[TILE_M];
    __m256i sums[TILE_M][2];
    for (int t = 0; t < T; t++) {
        rows[t] = (const int32_t *)((const uint8_t *)a->q + (size_t)(m0 + t) * K);
        sums[t][0] = sums[t][1] = _mm256_setzero_si256();
    }
    int n0 = block * TILE_N;
    const int8_t *p = w->packed + (size_t)block * (K / 4) * 4 * TILE_N;
    for (int k4 = 0; k4 < K / 4; k4++, p += 4 * TILE_N) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)p), w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        for (int t = 0; t < T; t++) {
            __m256i xb = _mm256_set1_epi32(rows[t][k4]);
            __m256i p0 = _mm256_maddubs_epi16(xb, w0), p1 = _mm256_maddubs_epi16(xb, w1);
            sums[t][0] = _mm256_add_epi32(sums[t][0], _mm256_madd_epi16(p0, ones));
            sums[t][1] = _mm256_add_epi32(sums[t][1], _mm256_madd_epi16(p1, ones));
        }
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < 2; j++) finish8(sums[t][j], m0 + t, n0 + 8 * j, w, a, out, N, bf16);
}

#define MADD2(s0, s1, row)                                                                \
    do {                                                                                  \
        __m256i xb = _mm256_set1_epi32((row)[k4]);                                        \
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones)); \
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones)); \
    } while (0)

/* tile_of(4, ...) with the eight sums in named registers: as an array gcc keeps them in
 * memory, a store and a reload in every k-step's dependency chain. With `prefetch_next` (a
 * block's second tile, its own weights in L1 by then) it pulls the next block's weights in,
 * one line per k-step, so memory streams while it multiplies. Both measured in
 * bench/README.md. */
static void tile4(int m0, int block, int K, int N, const Weights *w, const Activations *a, void *out, int bf16,
                  int prefetch_next) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int32_t *r0 = (const int32_t *)((const uint8_t *)a->q + (size_t)m0 * K), *r1 = r0 + K / 4, *r2 = r1 + K / 4, *r3 = r2 + K / 4;
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    const int8_t *p = w->packed + (size_t)block * (K / 4) * 4 * TILE_N;
    for (int k4 = 0; k4 < K / 4; k4++, p += 4 * TILE_N) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)p), w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        __asm__("" : "+x"(w0), "+x"(w1));
        if (prefetch_next) _mm_prefetch((const char *)(p + (size_t)K * TILE_N), _MM_HINT_T0);
        MADD2(s00, s01, r0);
        MADD2(s10, s11, r1);
        MADD2(s20, s21, r2);
        MADD2(s30, s31, r3);
    }
    __m256i sums[TILE_M][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
    for (int t = 0; t < TILE_M; t++)
        for (int j = 0; j < 2; j++) finish8(sums[t][j], m0 + t, block * TILE_N + 8 * j, w, a, out, N, bf16);
}

static void tile(int m0, int block, int M, int K, int N, const Weights *w, const Activations *a,
                 void *out, int bf16) {
    switch (M - m0 >= TILE_M ? TILE_M : M - m0) {
    case 4: tile4(m0, block, K, N, w, a, out, bf16, m0 == TILE_M); break;
    case 3: tile_of(3, m0, block, K, N, w, a, out, bf16); break;
    case 2: tile_of(2, m0, block, K, N, w, a, out, bf16); break;
    default: tile_of(1, m0, block, K, N, w, a, out, bf16);
    }
}
#else

static void tile(int m0, int block, int M, int K, int N, const Weights *w, const Activations *a,
                 void *out, int bf16) {
    plain_tile(0, TILE_M, m0, block, M, K, N, w, a, out, bf16);
}
#endif

/* W8A16: tokens m0..m0+T-1 x channels 16 * block...: per k-step (2 inputs) the block's 32
 * weights sign-extended to int16 once for all the tile's tokens, then per token and register
 * a vpmaddwd and a vpaddd. Up to 3 tokens a tile, where gcc keeps the sums (an array) in
 * registers (at 4 it spilled them in the W8A8 tile above). */
#define W16_TILE_N 16
#define W16_TILE_M 3

#ifdef __AVX2__
static inline __attribute__((always_inline)) void tile16_of(const int T, int m0, int block, int K, int N,
                                                            const Weights *w, const Activations *a, void *out,
                                                            int bf16, int prefetch_next) {
    const int32_t *rows[W16_TILE_M];
    __m256i sums[W16_TILE_M][2];
    for (int t = 0; t < T; t++) {
        rows[t] = (const int32_t *)((const int16_t *)a->q + (size_t)(m0 + t) * K);
        sums[t][0] = sums[t][1] = _mm256_setzero_si256();
    }
    const int8_t *p = w->packed + (size_t)block * K * W16_TILE_N;
    for (int k2 = 0; k2 < K / 2; k2++, p += 2 * W16_TILE_N) {
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
        if (prefetch_next && !(k2 & 1)) _mm_prefetch((const char *)(p + (size_t)K * W16_TILE_N), _MM_HINT_T0);
        for (int t = 0; t < T; t++) {
            __m256i xb = _mm256_set1_epi32(rows[t][k2]);
            sums[t][0] = _mm256_add_epi32(sums[t][0], _mm256_madd_epi16(xb, w0));
            sums[t][1] = _mm256_add_epi32(sums[t][1], _mm256_madd_epi16(xb, w1));
        }
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < 2; j++) finish8(sums[t][j], m0 + t, block * W16_TILE_N + 8 * j, w, a, out, N, bf16);
}

static void tile16(int m0, int block, int M, int K, int N, const Weights *w, const Activations *a, void *out,
                   int bf16) {
    int prefetch_next = m0 == W16_TILE_M;
    switch (M - m0 >= W16_TILE_M ? W16_TILE_M : M - m0) {
    case 3: tile16_of(3, m0, block, K, N, w, a, out, bf16, prefetch_next); break;
    case 2: tile16_of(2, m0, block, K, N, w, a, out, bf16, prefetch_next); break;
    default: tile16_of(1, m0, block, K, N, w, a, out, bf16, prefetch_next);
    }
}
#else
static void tile16(int m0, int block, int M, int K, int N, const Weights *w, const Activations *a, void *out,
                   int bf16) {
    plain_tile(1, W16_TILE_M, m0, block, M, K, N, w, a, out, bf16);
}
#endif

/* Fewest tokens a step takes through AMX tiles: below, vpdpbusd's tiles are as fast or
 * faster, both being bound by reading the weights (measured in bench/README.md). */
#ifndef AMX_MIN_TOKENS
#define AMX_MIN_TOKENS 16
#endif

/* Whether this step's W8A8 tiles go through AMX (asks for the tile state the first time). */
static int use_amx(int M, int K) {
#ifdef W8A8_AMX
    return M >= AMX_MIN_TOKENS && K % AMX_K == 0 && amx_granted();
#else
    (void)M, (void)K;
    return 0;
#endif
}

/* One block's output channels for all M tokens: W8A16's tiles (`wide`), AMX's 16 tokens at
 * a time (`amx`), or vpdpbusd's / AVX2's / the plain loops' tiles of TILE_M. */
static void block_tiles(int wide, int amx, int block, int M, int K, int N, const Weights *w,
                        const Activations *a, void *out, int bf16) {
#ifdef W8A8_AMX
    if (amx) {
        for (int m0 = 0; m0 < M; m0 += AMX_M) amx_tile(m0, M - m0 < AMX_M ? M - m0 : AMX_M, block, K, N, w, a, out, bf16);
        return;
    }
#else
    (void)amx;
#endif
    for (int m0 = 0; m0 < M; m0 += wide ? W16_TILE_M : TILE_M)
        if (wide)
            tile16(m0, block, M, K, N, w, a, out, bf16);
        else
            tile(m0, block, M, K, N, w, a, out, bf16);
}

/* The weights' int8 levels this build takes: [-w8a8_weight_levels(), +...]. */
int w8a8_weight_levels(void) { return WEIGHT_LEVELS; }

/* Output channels per packed block: N must be a multiple. */
int w8a8_tile_n(void) { return TILE_N; }

/* 1 where this build multiplies through AMX tiles and the kernel lets it (the first call
 * asks), else 0. */
int w8a8_amx(void) {
#ifdef W8A8_AMX
    return amx_granted();
#else
    return 0;
#endif
}

/* 1: AVX512-VNNI, 2: AVX2, 0: the portable loops. */
int w8a8_vectorized(void) {
#if defined(__AVX512VNNI__)
    return 1;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}

/* W8A16's activation levels for K input channels: K * 127 * levels stays within int32. */
int w8a16_activation_levels(int K) {
    long levels = 2147483647L / (127L * (K > 0 ? K : 1));
    return levels > 32767 ? 32767 : (int)levels;
}

/* W8A16 vectorized: 1 where the CPU has AVX2, else 0 (the portable loops). */
int w8a16_vectorized(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* out[M][N] = W8A8(x[M][K]), or W8A16 if `wide` (no colsum); 0, 1 for a shape it does not
 * take, 2 out of memory. */
static int linear(int wide, const void *x, int x_bf16, int M, int K, const float *inverse_smooth,
                  const int8_t *packed, const int32_t *colsum, const float *scale, const int32_t *outliers,
                  int n_out, const float *outlier_w, void *out, int out_bf16, int N) {
    int tile_n = wide ? W16_TILE_N : TILE_N;
    if (M < 1 || K % (wide ? 2 : 4) || N % tile_n) return 1;
    Weights w = {packed, wide ? NULL : colsum, scale, outliers, outlier_w, n_out, tile_n};
    void *q = malloc((size_t)M * K * (wide ? 2 : 1));
    float *x_scale = malloc(sizeof(float) * M), *outlier_x = malloc(sizeof(float) * M * (n_out + 1));
    int status = 2;
    if (q && x_scale && outlier_x) {
        float levels = wide ? (float)w8a16_activation_levels(K) : 127.f;
        quantize(x, x_bf16, wide, M, K, inverse_smooth, &w, levels, q, x_scale, outlier_x);
        Activations a = {q, x_scale, outlier_x};
        int amx = !wide && use_amx(M, K);
#pragma omp parallel for schedule(static)
        for (int block = 0; block < N / tile_n; block++) block_tiles(wide, amx, block, M, K, N, &w, &a, out, out_bf16);
        status = 0;
    }
    free(q);
    free(x_scale);
    free(outlier_x);
    return status;
}

int w8a8_linear(const void *x, int x_bf16, int M, int K, const float *inverse_smooth, const int8_t *packed,
                const int32_t *colsum, const float *scale, const int32_t *outliers, int n_out,
                const float *outlier_w, void *out, int out_bf16, int N) {
    return linear(0, x, x_bf16, M, K, inverse_smooth, packed, colsum, scale, outliers, n_out, outlier_w, out,
                  out_bf16, N);
}

/* As w8a8_linear, with `packed` in W8A16's layout and no colsum. */
int w8a16_linear(const void *x, int x_bf16, int M, int K, const float *inverse_smooth, const int8_t *packed,
                 const float *scale, const int32_t *outliers, int n_out, const float *outlier_w, void *out,
                 int out_bf16, int N) {
    return linear(1, x, x_bf16, M, K, inverse_smooth, packed, NULL, scale, outliers, n_out, outlier_w, out,
                  out_bf16, N);
}
