/* A whole step of a Llama-family model over B rows, each a new token at its position of a
 * sequence, in one call (fused_decode.py): the embedding rows, then per layer rmsnorm, the
 * qkv projection, rope, the K/V write into the paged cache, paged attention (paged_decode.c's
 * task), o_proj, the residual, rmsnorm, gate_up, SiLU x up, down_proj and the residual; the
 * final norm last. A decode step has one row a sequence; a prefill chunk brings several rows
 * of one sequence, each attending to its context up to itself: every row's K/V is written
 * before any row attends (the barrier that ends rope_and_store's loop).
 * A torch forward of a decode step runs ~25 ops a layer, each a dispatch that costs more
 * than its arithmetic at these sizes; here they are plain loops inside one OpenMP region,
 * the threads meeting at a barrier between the phases.
 *
 * Projections: int4 weights with a scale and a minimum per group of 32 inputs (Q4_1's
 * layout: w = d * q + m, q in 0..15), in fp16, times activations quantized to int8 per group
 * of 32 (as llama.cpp multiplies a Q4_1 tensor by its Q8_1 activations), summed by
 * AVX512-VNNI: sum(w * x) = d * dx * sum(q * qx) + m * sum(x), where sum(x) is that of the
 * quantized activations. Weights come in tiles of 16 output rows: a 64-byte chunk holds 4
 * bytes of each row, 8 inputs (low nibbles inputs 0-3, high 4-7), so one vpdpbusd takes
 * 16 rows x 4 inputs with the 4 activation bytes broadcast. A tile's group is unpacked once
 * for up to ROWS sequences, so a batch reads the weights once. Residual, norms, rope and
 * attention stay fp32; K and V are stored in the cache's dtype.
 *
 * With AVX2 alone (no VNNI) a chunk goes as two halves of 8 rows, each multiplied by up to 4
 * sequences' activations: vpmaddubsw multiplies the int4 codes by the activations in pairs,
 * whose int16 sums over a group's 32 inputs cannot overflow (16 x 15 x 127 < 2^15), and
 * one vpmaddwd widens them; 8-bit codes go as signed bytes q = u - 128 through vpsignb,
 * 127 x 127 x 2 < 2^15 per pair, and the 128 moves into the minimum's term.
 *
 * Built with AVX512-F/VNNI or AVX2 (with FMA and F16C); elsewhere `fused_available` says 0
 * and the torch forward serves. */
#include "paged_decode.c"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define FUSED 1
#define FUSED_AVX512 1
#define ROWS 8 /* sequences per pass over a tile's weights */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FUSED 1
#define FUSED_AVX512 0
#define ROWS 4 /* 2 x 4 sums, 4 codes and 2 broadcasts fill AVX2's 16 registers */
#else
#define FUSED 0
#endif

int fused_available(void) { return FUSED; }

typedef struct {
    int layers, hidden, inter, heads, kv_heads, head_dim, block_size, kv_bf16;
    int64_t slots;
    float eps;
} Shape;

#define GROUP 32
#define TILE 16

/* One step's activations for B sequences, carved out of the caller's scratch. */
typedef struct {
    float *x, *normed, *qkv, *attended, *gate_up; /* [B][hidden | qkv | H * D | 2 * inter] */
    int8_t *q;                                    /* [B][widest input]: int8 activations */
    float *scale, *sum; /* [B][widest input / 32]: dx and dx * sum(q) per group */
    int32_t *lens;      /* [B] */
    int widest;
} Scratch;

static size_t aligned(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static int widest_input(const Shape *s) {
    int q_size = s->heads * s->head_dim, widest = s->hidden > s->inter ? s->hidden : s->inter;
    return widest > q_size ? widest : q_size;
}

/* Lays the scratch out at `base` (64-aligned), or with base NULL only sizes it. */
static size_t carve(const Shape *s, int B, char *base, Scratch *w) {
    int qkv = (s->heads + 2 * s->kv_heads) * s->head_dim, widest = widest_input(s);
    size_t sizes[] = {
        sizeof(float) * s->hidden,     sizeof(float) * s->hidden, sizeof(float) * qkv,
        sizeof(float) * s->heads * s->head_dim, sizeof(float) * 2 * s->inter, (size_t)widest,
        sizeof(float) * (widest / GROUP), sizeof(float) * (widest / GROUP), sizeof(int32_t),
    };
    void **slots[] = {(void **)&w->x, (void **)&w->normed, (void **)&w->qkv,
                      (void **)&w->attended, (void **)&w->gate_up, (void **)&w->q,
                      (void **)&w->scale, (void **)&w->sum, (void **)&w->lens};
    size_t offset = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        if (base != NULL) *slots[i] = base + offset;
        offset += aligned(sizes[i] * (size_t)B);
    }
    w->widest = widest;
    return offset;
}

/* Bytes of scratch a step of up to `B` sequences needs. */
int64_t fused_scratch_bytes(const Shape *shape, int B) {
    Scratch w;
    return (int64_t)carve(shape, B, NULL, &w);
}

#if FUSED
typedef struct {
    const uint8_t *packed;  /* [n / 16][k / 32][4 (int4) or 8 (8-bit) chunks][16 rows][4 bytes] */
    const uint16_t *scales; /* fp16 [n / 16][k / 32][16] */
    const uint16_t *mins;   /* fp16 [n / 16][k / 32][16] */
    int bits;               /* 4: a byte holds two inputs' codes; 8: one */
} Codes;

/* Per layer, in this order (fused_decode.py's LAYER_POINTERS). */
enum { QKV, O, GATE_UP, DOWN, PROJECTIONS };
enum { INPUT_NORM = 3 * PROJECTIONS, POST_NORM, K_CACHE, V_CACHE, LAYER_POINTERS };

/* Row b of x [B][k] (k floats apart) into int8 groups of 32: w->q, w->scale, w->sum. Each
 * value x / dx rounded to the nearest integer (ties to even, as lrintf), dx the group's
 * largest |x| / 127; 8 lanes at a time (gcc leaves the rounding loop scalar). */
static void quantize_row(const float *x, int k, Scratch *w, int b) {
    int8_t *q = w->q + (size_t)b * w->widest;
    float *scale = w->scale + (size_t)b * (w->widest / GROUP);
    float *sum = w->sum + (size_t)b * (w->widest / GROUP);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        __m256 v[4], top = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xg + 8 * j);
            top = _mm256_max_ps(top, _mm256_and_ps(v[j], magnitude));
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
        float dx = _mm_cvtss_f32(half) / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        __m256i n[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
            total = _mm256_add_epi32(total, n[j]);
        }
        /* packs interleave the 128-bit lanes: 32-bit groups come out as 0 4 1 5 2 6 3 7 */
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                           _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP),
                            _mm256_permutevar8x32_epi32(bytes, order));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        scale[g] = dx;
        sum[g] = dx * (float)_mm_cvtsi128_si32(t);
    }
}

#if FUSED_AVX512
/* y[b][t * 16 .. +16) for rows `first`..`first + R` of the batch: one tile's groups,
 * unpacked once for all R rows. R and bits are constants in each inlined copy, so the
 * accumulators stay in registers. An 8-bit group is 8 chunks of 4 inputs; an int4 one is 4
 * chunks, each byte's low nibble one input and its high nibble the input 4 on. */
INLINE void tile_rows(const uint8_t *p, const uint16_t *scales, const uint16_t *mins,
                      const Scratch *w, int first, int R, int bits, int groups, float *y, int n,
                      int t) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int per_row = w->widest / GROUP;
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i codes[8]; /* codes[j]: inputs 4j..4j+3 of each of the 16 rows */
        for (int c = 0; c < 4; c++) {
            if (bits == 8) {
                codes[2 * c] = _mm512_loadu_si512(p + (size_t)(g * 8 + 2 * c) * 64);
                codes[2 * c + 1] = _mm512_loadu_si512(p + (size_t)(g * 8 + 2 * c + 1) * 64);
            } else {
                __m512i bytes = _mm512_loadu_si512(p + (size_t)(g * 4 + c) * 64);
                codes[2 * c] = _mm512_and_si512(bytes, nibble);
                codes[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * TILE)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g * TILE)));
        for (int r = 0; r < R; r++) {
            int b = first + r;
            const int32_t *xq = (const int32_t *)(w->q + (size_t)b * w->widest + g * GROUP);
            __m512i dot = _mm512_setzero_si512();
            if (R == 1) { /* one chain: a lone row's step is bound by reading the weights */
                for (int j = 0; j < 8; j++)
                    dot = _mm512_dpbusd_epi32(dot, codes[j], _mm512_set1_epi32(xq[j]));
            } else { /* two chains of 4 (each vpdpbusd waits on the last): ~5% faster here */
                __m512i odd = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    dot = _mm512_dpbusd_epi32(dot, codes[j], _mm512_set1_epi32(xq[j]));
                    odd = _mm512_dpbusd_epi32(odd, codes[j + 1], _mm512_set1_epi32(xq[j + 1]));
                }
                dot = _mm512_add_epi32(dot, odd);
            }
            float dx = w->scale[(size_t)b * per_row + g], sx = w->sum[(size_t)b * per_row + g];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)(first + r) * n + t * TILE, acc[r]);
}

#else
/* With AVX2, both halves of a tile (rows 0-7 and 8-15, 32 bytes of each chunk) go as an
 * outer product with R sequences: each chunk's codes and each sequence's broadcast
 * activation bytes are loaded once for 2 x R products (AVX2 takes no broadcast operand, and
 * one load per product bound the tile). A group's integer sums stay in registers, then
 * add_group scales them into the fp32 sums. */

/* acc[h][r] += d * dx * dots[h][r] + (m + offset * d) * sx for group g of both halves. */
INLINE void add_group(__m256 acc[2][ROWS], __m256i dots[2][ROWS], const uint16_t *scales,
                      const uint16_t *mins, float offset, const Scratch *w, int first, int R,
                      int g) {
    const int per_row = w->widest / GROUP;
    for (int h = 0; h < 2; h++) {
        const int at_ = g * TILE + h * 8;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + at_)));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + at_)));
        if (offset != 0.f) m = _mm256_fmadd_ps(d, _mm256_set1_ps(offset), m);
        for (int r = 0; r < R; r++) {
            size_t at_x = (size_t)(first + r) * per_row + g;
            __m256 dx = _mm256_set1_ps(w->scale[at_x]), sx = _mm256_set1_ps(w->sum[at_x]);
            acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[h][r]), _mm256_mul_ps(d, dx),
                                        acc[h][r]);
            acc[h][r] = _mm256_fmadd_ps(m, sx, acc[h][r]);
        }
    }
}

/* Row b's 4 activation bytes at input 4 * j of group g, in every lane. */
INLINE __m256i activations(const Scratch *w, int b, int g, int j) {
    return _mm256_set1_epi32(((const int32_t *)(w->q + (size_t)b * w->widest + g * GROUP))[j]);
}

/* An int4 chunk holds inputs 8c..8c+3 (low nibbles) and 8c+4..8c+7 (high). The int16 pair
 * sums of a group cannot overflow: 16 x 15 x 127 < 2^15. */
INLINE void int4_group(const uint8_t *p, const Scratch *w, int first, int R, int g,
                       __m256i dots[2][ROWS]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i sums[2][ROWS];
    for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const uint8_t *chunk = p + (size_t)(g * 4 + c) * 64;
        __m256i low[2], high[2];
        for (int h = 0; h < 2; h++) {
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(chunk + h * 32));
            low[h] = _mm256_and_si256(bytes, nibble);
            high[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        }
        for (int r = 0; r < R; r++) {
            __m256i a = activations(w, first + r, g, 2 * c);
            __m256i b = activations(w, first + r, g, 2 * c + 1);
            for (int h = 0; h < 2; h++) {
                sums[h][r] = _mm256_add_epi16(
                    sums[h][r], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], a),
                                                 _mm256_maddubs_epi16(high[h], b)));
                /* In a register now: else gcc computes all of a group's products first,
                 * spills them, and adds them as a tree. */
                __asm__("" : "+x"(sums[h][r]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) dots[h][r] = _mm256_madd_epi16(sums[h][r], ones);
}

/* An 8-bit chunk holds 4 inputs, codes u = q + 128 multiplied as |q| times the activation
 * with q's sign (vpsignb); a pair of products can reach 2 x 127 x 127, so each vpmaddubsw
 * is widened to int32 at once. */
INLINE void int8_group(const uint8_t *p, const Scratch *w, int first, int R, int g,
                       __m256i dots[2][ROWS]) {
    const __m256i sign = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) dots[0][r] = dots[1][r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const uint8_t *chunk = p + (size_t)(g * 8 + j) * 64;
        __m256i q[2], magnitude[2];
        for (int h = 0; h < 2; h++) {
            q[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(chunk + h * 32)), sign);
            magnitude[h] = _mm256_abs_epi8(q[h]);
        }
        for (int r = 0; r < R; r++) {
            __m256i x = activations(w, first + r, g, j);
            for (int h = 0; h < 2; h++) {
                __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(x, q[h]));
                dots[h][r] = _mm256_add_epi32(dots[h][r], _mm256_madd_epi16(pairs, ones));
                __asm__("" : "+x"(dots[h][r])); /* as in int4_group */
            }
        }
    }
}

INLINE void tile_rows(const uint8_t *p, const uint16_t *scales, const uint16_t *mins,
                      const Scratch *w, int first, int R, int bits, int groups, float *y, int n,
                      int t) {
    __m256 acc[2][ROWS];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i dots[2][ROWS];
        if (bits == 4)
            int4_group(p, w, first, R, g, dots);
        else
            int8_group(p, w, first, R, g, dots);
        add_group(acc, dots, scales, mins, bits == 8 ? 128.f : 0.f, w, first, R, g);
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + (size_t)(first + r) * n + t * TILE + h * 8, acc[h][r]);
}
#endif

INLINE void tiles_of(Codes w, const Scratch *x, int B, int n, int bits, int groups,
                     float *y) {
    const size_t tile_bytes = (size_t)groups * GROUP * TILE * bits / 8;
#pragma omp for schedule(static)
    for (int t = 0; t < n / TILE; t++) {
        const uint8_t *p = w.packed + (size_t)t * tile_bytes;
        const uint16_t *scales = w.scales + (size_t)t * groups * TILE;
        const uint16_t *mins = w.mins + (size_t)t * groups * TILE;
        for (int first = 0; first < B; first += ROWS) {
            switch (B - first < ROWS ? B - first : ROWS) {
#define ROWS_CASE(R) \
    case R: tile_rows(p, scales, mins, x, first, R, bits, groups, y, n, t); break;
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#if ROWS > 4
                ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#endif
#undef ROWS_CASE
            }
        }
    }
}

/* y [B][n] = x W^T for W an n x k matrix of int4 or 8-bit codes and x the B quantized rows;
 * the tiles shared out among the threads. */
static void gemm(Codes w, const Scratch *x, int B, int n, int k, float *y) {
    if (w.bits == 8)
        tiles_of(w, x, B, n, 8, k / GROUP, y);
    else
        tiles_of(w, x, B, n, 4, k / GROUP, y);
}

static void rms_norm(const float *x, const float *weight, int n, float eps, float *out) {
    float sum = 0.f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* HF's rotate-half rope on `heads` heads of D at `x`; sin's first half comes negated. */
static void rope(float *x, int heads, int D, const float *cos, const float *sin) {
    float row[MAX_HEAD_DIM];
    for (int h = 0; h < heads; h++, x += D) {
        memcpy(row, x, sizeof(float) * (size_t)D);
        for (int d = 0; d < D; d++) x[d] = row[d] * cos[d] + row[(d + D / 2) % D] * sin[d];
    }
}

static void store_rows(const float *x, int heads, int D, void *cache, int64_t slots,
                       int64_t slot, int bf16) {
    for (int h = 0; h < heads; h++)
        for (int d = 0; d < D; d++) {
            size_t at_ = ((size_t)h * slots + slot) * D + d;
            if (bf16)
                ((uint16_t *)cache)[at_] = float_to_bf16(x[h * D + d]);
            else
                ((float *)cache)[at_] = x[h * D + d];
        }
}

static Codes matrix(const void *const *layer, int which) {
    return (Codes){layer[3 * which], layer[3 * which + 1], layer[3 * which + 2], 4};
}

typedef struct { /* one step's sequences */
    int B, max_blocks;
    const int32_t *positions, *tables; /* [B], [B][max_blocks] */
    const float *cos, *sin;            /* rope tables [positions][D] */
} Step;

/* Each row's rmsnorm of w->x into w->normed, quantized. */
static void norm_rows(const Shape *s, Scratch *w, const float *weight, int B) {
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        float *normed = w->normed + (size_t)b * s->hidden;
        rms_norm(w->x + (size_t)b * s->hidden, weight, s->hidden, s->eps, normed);
        quantize_row(normed, s->hidden, w, b);
    }
}

/* w->x += w->normed, row by row. No barrier after it: what follows it (norm_rows) shares out
 * the same rows the same static way, so each thread reads back only rows it wrote. */
static void add_rows(const Shape *s, Scratch *w, int B) {
#pragma omp for schedule(static) nowait
    for (int b = 0; b < B; b++)
        for (int i = 0; i < s->hidden; i++)
            w->x[(size_t)b * s->hidden + i] += w->normed[(size_t)b * s->hidden + i];
}

/* Rope on each row's q and k; its K/V into the cache at its position's slot. */
static void rope_and_store(const void *const *layer, const Shape *s, Scratch *w, const Step *t) {
    const int H = s->heads, KVH = s->kv_heads, D = s->head_dim, q_size = H * D;
    const int width = (H + 2 * KVH) * D;
#pragma omp for schedule(static)
    for (int b = 0; b < t->B; b++) {
        float *row = w->qkv + (size_t)b * width;
        int pos = t->positions[b];
        rope(row, H + KVH, D, t->cos + (size_t)pos * D, t->sin + (size_t)pos * D);
        int64_t block = t->tables[(size_t)b * t->max_blocks + pos / s->block_size];
        int64_t slot = block * s->block_size + pos % s->block_size;
        store_rows(row + q_size, KVH, D, (void *)layer[K_CACHE], s->slots, slot, s->kv_bf16);
        store_rows(row + q_size + KVH * D, KVH, D, (void *)layer[V_CACHE], s->slots, slot,
                   s->kv_bf16);
    }
}

/* One layer; called by every thread of the region. 0, or 1 if this thread's attention ran
 * out of memory (the region ORs them). */
static int layer_step(const void *const *layer, const Shape *s, Scratch *w, const Step *t) {
    const int H = s->heads, KVH = s->kv_heads, D = s->head_dim, q_size = H * D, B = t->B;
    const int width = (H + 2 * KVH) * D;
    int failed = 0;
    norm_rows(s, w, layer[INPUT_NORM], B);
    gemm(matrix(layer, QKV), w, B, width, s->hidden, w->qkv);
    rope_and_store(layer, s, w, t);
    float scale = 1.f / sqrtf((float)D);
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < B * KVH; task++)
        failed |= s->kv_bf16
            ? decode_task(task / KVH, task % KVH, w->qkv, width, layer[K_CACHE],
                          layer[V_CACHE], w->attended, t->tables, t->max_blocks, w->lens, H,
                          KVH, D, s->slots, s->block_size, scale, 0, 1)
            : decode_task(task / KVH, task % KVH, w->qkv, width, layer[K_CACHE],
                          layer[V_CACHE], w->attended, t->tables, t->max_blocks, w->lens, H,
                          KVH, D, s->slots, s->block_size, scale, 0, 0);
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++) quantize_row(w->attended + (size_t)b * q_size, q_size, w, b);
    gemm(matrix(layer, O), w, B, s->hidden, q_size, w->normed);
    add_rows(s, w, B);
    norm_rows(s, w, layer[POST_NORM], B);
    gemm(matrix(layer, GATE_UP), w, B, 2 * s->inter, s->hidden, w->gate_up);
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        float *gate = w->gate_up + (size_t)b * 2 * s->inter, *up = gate + s->inter;
        for (int i = 0; i < s->inter; i++) gate[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
        quantize_row(gate, s->inter, w, b);
    }
    gemm(matrix(layer, DOWN), w, B, s->hidden, s->inter, w->normed);
    add_rows(s, w, B);
    return failed;
}

static int bad_step(const Shape *s, const Step *t, const int32_t *lens) {
    int H = s->heads, KVH = s->kv_heads, D = s->head_dim;
    if (t->B < 1 || D % 2 || bad_shape(lens, t->B, H, KVH, D)) return 1;
    for (int b = 0; b < t->B; b++)
        if (t->positions[b] / s->block_size >= t->max_blocks) return 1;
    return 0;
}
#endif

/* The final normed hidden states of `tokens` [B], each at its position `positions` [B] of a
 * sequence whose cache blocks are row b of `tables` [B][max_blocks], written to `out`
 * [B][hidden] (bf16 if out_bf16, else fp32); their K/V land in the cache. `layers` holds
 * LAYER_POINTERS per layer; `embed` is the bf16 or fp32 embedding table (embed_bf16); rope
 * tables fp32 [positions, D]. `scratch`: fused_scratch_bytes(shape, B) bytes or more,
 * 64-aligned, used by one call at a time. Returns 0, -1 for shapes it does not take (or no
 * AVX512-VNNI or AVX2), -2 when out of memory. */
int fused_decode(const void *const *layers, const Shape *shape, const void *embed, int embed_bf16,
                 const float *final_norm, const float *rope_cos, const float *rope_sin, int B,
                 const int32_t *tokens, const int32_t *positions, const int32_t *tables,
                 int max_blocks, void *out, int out_bf16, void *scratch) {
#if FUSED
    const Shape *s = shape;
    Scratch w;
    carve(s, B, scratch, &w);
    Step step = {B, max_blocks, positions, tables, rope_cos, rope_sin};
    for (int b = 0; b < B; b++) w.lens[b] = positions[b] + 1;
    if (bad_step(s, &step, w.lens)) return -1;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < s->hidden; i++) {
            size_t from = (size_t)tokens[b] * s->hidden + i;
            w.x[(size_t)b * s->hidden + i] = embed_bf16
                ? bf16_to_float(((const uint16_t *)embed)[from])
                : ((const float *)embed)[from];
        }
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    for (int l = 0; l < s->layers; l++)
        failed |= layer_step(layers + (size_t)l * LAYER_POINTERS, s, &w, &step);
    if (failed) return -2;
    for (int b = 0; b < B; b++) {
        float *normed = w.normed + (size_t)b * s->hidden;
        rms_norm(w.x + (size_t)b * s->hidden, final_norm, s->hidden, s->eps, normed);
        for (int i = 0; i < s->hidden; i++) {
            size_t to = (size_t)b * s->hidden + i;
            if (out_bf16)
                ((uint16_t *)out)[to] = float_to_bf16(normed[i]);
            else
                ((float *)out)[to] = normed[i];
        }
    }
    return 0;
#else
    (void)layers, (void)shape, (void)embed, (void)embed_bf16, (void)final_norm, (void)rope_cos;
    (void)rope_sin, (void)B, (void)tokens, (void)positions, (void)tables, (void)max_blocks;
    (void)out, (void)out_bf16, (void)scratch;
    return -1;
#endif
}

/* y [B][n] (fp32) = x W^T for `x` [B][k] (bf16 if x_bf16, else fp32) and W an n x k matrix in
 * the tiles' layout: `bits` 8 (codes u in 0..255: w = scale * u + min, so a signed int8
 * weight q with its scale is u = q + 128 and min = -128 * scale) or 4. x is quantized to
 * int8 per group of 32 as in the step. `scratch`: fused_linear_scratch_bytes(k, B) bytes,
 * 64-aligned. Returns 0, or -1 for shapes it does not take (or neither AVX512-VNNI nor AVX2). */
int64_t fused_linear_scratch_bytes(int k, int B) {
    Shape s = {0};
    s.hidden = s.inter = k;
    s.heads = s.kv_heads = s.head_dim = 1;
    Scratch w;
    return (int64_t)carve(&s, B, NULL, &w);
}

int fused_linear(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins, int bits,
                 int n, int k, const void *x, int x_bf16, int B, float *y, void *scratch) {
#if FUSED
    if (B < 1 || n % TILE || k % GROUP || (bits != 4 && bits != 8)) return -1;
    Shape s = {0};
    s.hidden = s.inter = k;
    s.heads = s.kv_heads = s.head_dim = 1;
    Scratch w;
    carve(&s, B, scratch, &w);
    Codes weights = {packed, scales, mins, bits};
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *row = w.normed + (size_t)b * k;
            for (int i = 0; i < k; i++)
                row[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[(size_t)b * k + i])
                                : ((const float *)x)[(size_t)b * k + i];
            quantize_row(row, k, &w, b);
        }
        gemm(weights, &w, B, n, k, y);
    }
    return 0;
#else
    (void)packed, (void)scales, (void)mins, (void)bits, (void)n, (void)k, (void)x, (void)x_bf16;
    (void)B, (void)y, (void)scratch;
    return -1;
#endif
}
