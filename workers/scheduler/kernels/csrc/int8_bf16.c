/* x @ w.T with w in int8 per output channel (w = q * scale) and x in bf16, through AMX-BF16
 * tiles (`--quantization w8a8_int8`'s down_proj on CPUs with AMX, int8_bf16.py): half the
 * bytes of bf16 weights, and the activations as they are (down_proj's outliers are what
 * 8-bit activations lose). Built at load by c_build.py (gcc -O3 -march=native -fopenmp).
 *
 * Weights come packed as [N / 16][K / 2][16 channels][2 bytes] (a bf16 weight tile's rows:
 * 16 channels x 2 consecutive inputs). Per 32-input chunk of a 16-channel block the chunk's
 * 16 rows are widened to bf16 once (|q| <= 127: exact in bf16's 8 significant bits) into a
 * 1 KB buffer, then tdpbf16ps multiplies up to 4 tiles of 16 tokens by it into fp32 sums
 * (tile registers 0-3; 4 the activations, 5 the weights). The tokens are copied as bf16
 * into rows padded with zeros to whole tiles, so every tile has 16 rows. The channel's scale
 * is applied to the sums. K must be whole 32-input chunks and N whole 16-channel blocks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define INT8_BF16_AMX 1
#include <immintrin.h>

#include "amx.h"
#endif

#define BLOCK_N 16 /* channels per block (a tile's fp32 columns) */
#define CHUNK_K 32 /* inputs per tile row (64 bytes of bf16) */
#define TILE_ROWS 16
#define GROUP_TILES 4 /* tiles of tokens per pass over a chunk's widened weights */

#ifdef INT8_BF16_AMX
static void configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t++) config.rows[t] = TILE_ROWS, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* One chunk's 16 weight rows (16 channels x 2 inputs each) widened to bf16. */
static inline void widen(const int8_t *q, uint16_t *dst) {
    for (int r = 0; r < CHUNK_K / 2; r++, q += 2 * BLOCK_N, dst += 2 * BLOCK_N) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

#define DOT(t)                                                                     \
    do {                                                                           \
        if (tiles > (t)) {                                                         \
            _tile_loadd(4, x + (size_t)(m0 + (t) * TILE_ROWS) * K + k, 2 * K);     \
            _tile_dpbf16ps(t, 4, 5);                                               \
        }                                                                          \
    } while (0)

/* Tokens m0.. (`tiles` tiles of 16, padded rows included) x channels 16 * block... */
static void group(int m0, int tiles, int block, int M, int K, int N, const uint16_t *x, const int8_t *packed,
                  const float *scale, void *out, int out_bf16) {
    uint16_t widened[CHUNK_K / 2 * 2 * BLOCK_N] __attribute__((aligned(64)));
    float sums[GROUP_TILES * TILE_ROWS * BLOCK_N] __attribute__((aligned(64)));
    const int8_t *q = packed + (size_t)block * K * BLOCK_N;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += CHUNK_K, q += CHUNK_K * BLOCK_N) {
        widen(q, widened);
        /* gcc's tileloadd asm names no memory it reads: without this the stores above are
         * dead to it (garbage sums at -O3) */
        __asm__ volatile("" ::: "memory");
        _tile_loadd(5, widened, 2 * 2 * BLOCK_N);
        DOT(0);
        DOT(1);
        DOT(2);
        DOT(3);
    }
    _tile_stored(0, sums, 4 * BLOCK_N);
    _tile_stored(1, sums + TILE_ROWS * BLOCK_N, 4 * BLOCK_N);
    _tile_stored(2, sums + 2 * TILE_ROWS * BLOCK_N, 4 * BLOCK_N);
    _tile_stored(3, sums + 3 * TILE_ROWS * BLOCK_N, 4 * BLOCK_N);
    __m512 s = _mm512_loadu_ps(scale + block * BLOCK_N);
    for (int i = 0; i < tiles * TILE_ROWS && m0 + i < M; i++) {
        __m512 v = _mm512_mul_ps(_mm512_load_ps(sums + i * BLOCK_N), s);
        size_t at = (size_t)(m0 + i) * N + block * BLOCK_N;
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_storeu_ps((float *)out + at, v);
    }
}
#endif

/* 1 where this build has the AMX-BF16 path and the kernel lets this process use it. */
int int8_bf16_available(void) {
#ifdef INT8_BF16_AMX
    return amx_granted();
#else
    return 0;
#endif
}

/* out[M][N] = (x[M][K] in bf16) @ (q * scale).T; x and out bf16 or fp32 (`x_bf16`,
 * `out_bf16`). 0, 1 where this build or shape cannot, 2 out of memory. */
int int8_bf16_linear(const void *x, int x_bf16, int M, int K, const int8_t *packed, const float *scale, void *out,
                     int out_bf16, int N) {
#ifdef INT8_BF16_AMX
    if (M < 1 || K % CHUNK_K || N % BLOCK_N || !amx_granted()) return 1;
    int padded = (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    uint16_t *rows = calloc((size_t)padded * K, sizeof(uint16_t));
    if (!rows) return 2;
    if (x_bf16)
        memcpy(rows, x, (size_t)M * K * sizeof(uint16_t));
    else
        for (size_t i = 0; i < (size_t)M * K; i++) rows[i] = float_to_bf16(((const float *)x)[i]);
    int tiles_total = padded / TILE_ROWS;
#pragma omp parallel
    {
        configure();
#pragma omp for schedule(static)
        for (int block = 0; block < N / BLOCK_N; block++)
            for (int t0 = 0; t0 < tiles_total; t0 += GROUP_TILES) {
                int tiles = tiles_total - t0 < GROUP_TILES ? tiles_total - t0 : GROUP_TILES;
                group(t0 * TILE_ROWS, tiles, block, M, K, N, rows, packed, scale, out, out_bf16);
            }
    }
    free(rows);
    return 0;
#else
    (void)x, (void)x_bf16, (void)M, (void)K, (void)packed, (void)scale, (void)out, (void)out_bf16, (void)N;
    return 1;
#endif
}
