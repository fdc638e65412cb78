/* A whole one-token decode step of a Llama-family model in one call (fused_decode.py): the
 * embedding row, then per layer rmsnorm, the qkv projection, rope, the K/V write into the
 * paged cache, paged attention (paged_decode.c's task), o_proj, the residual, rmsnorm,
 * gate_up, SiLU x up, down_proj and the residual; the final norm last. A torch forward of
 * one token runs ~25 ops a layer, each a dispatch that costs more than its arithmetic; here
 * they are plain loops inside one OpenMP region, the threads meeting at a barrier between
 * the phases.
 *
 * Projections: int4 weights with a scale and a minimum per group of 32 inputs (Q4_1's
 * layout: w = d * q + m, q in 0..15), in fp16, times activations quantized to int8 per group
 * of 32 (as llama.cpp multiplies a Q4_1 tensor by its Q8_1 activations), summed by
 * AVX512-VNNI: sum(w * x) = d * dx * sum(q * qx) + m * sum(x), where sum(x) is that of the
 * quantized activations. Weights come in tiles of 16 output rows: a 64-byte chunk holds 4
 * bytes of each row, 8 inputs (low nibbles inputs 0-3, high 4-7), so one vpdpbusd takes
 * 16 rows x 4 inputs with the 4 activation bytes broadcast. Residual, norms, rope and
 * attention stay fp32; K and V are stored in the cache's dtype.
 *
 * Built with AVX512-F/VNNI only; elsewhere `fused_available` says 0 and the torch forward
 * serves. */
#include "paged_decode.c"

#ifdef __AVX512VNNI__
#define FUSED 1
#else
#define FUSED 0
#endif

int fused_available(void) { return FUSED; }

#if FUSED
#define GROUP 32
#define TILE 16
#define MAX_DIM 16384

typedef struct {
    const uint8_t *packed;  /* [n / 16][k / 32][4 chunks][16 rows][4 bytes] */
    const uint16_t *scales; /* fp16 [n / 16][k / 32][16] */
    const uint16_t *mins;   /* fp16 [n / 16][k / 32][16] */
} Int4Matrix;

typedef struct { /* a vector quantized to int8 per group of 32 */
    int8_t q[MAX_DIM];
    float scale[MAX_DIM / GROUP]; /* dx */
    float sum[MAX_DIM / GROUP];   /* dx * sum(q): the group's sum as quantized */
} QuantizedVector;

/* Per layer, in this order (fused_decode.py's LAYER_POINTERS). */
enum { QKV, O, GATE_UP, DOWN, PROJECTIONS };
enum { INPUT_NORM = 3 * PROJECTIONS, POST_NORM, K_CACHE, V_CACHE, LAYER_POINTERS };

static void quantize(const float *x, int k, QuantizedVector *out) {
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        float top = 0.f;
        for (int j = 0; j < GROUP; j++) top = fmaxf(top, fabsf(xg[j]));
        float dx = top / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        int sum = 0;
        for (int j = 0; j < GROUP; j++) {
            int q = (int)lrintf(xg[j] * inv);
            out->q[g * GROUP + j] = (int8_t)q;
            sum += q;
        }
        out->scale[g] = dx;
        out->sum[g] = dx * (float)sum;
    }
}

/* y[0..n) = W x for W an n x k Int4Matrix; the tiles shared out among the threads. */
static void gemv_int4(Int4Matrix w, const QuantizedVector *x, int n, int k, float *y) {
    const int groups = k / GROUP;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma omp for schedule(static)
    for (int t = 0; t < n / TILE; t++) {
        const uint8_t *p = w.packed + (size_t)t * groups * GROUP * TILE / 2;
        const uint16_t *scales = w.scales + (size_t)t * groups * TILE;
        const uint16_t *mins = w.mins + (size_t)t * groups * TILE;
        __m512 acc = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++) {
            const int32_t *xq = (const int32_t *)(x->q + g * GROUP);
            __m512i dot = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i bytes = _mm512_loadu_si512(p + (size_t)(g * 4 + c) * 64);
                __m512i low = _mm512_and_si512(bytes, nibble);
                __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
                dot = _mm512_dpbusd_epi32(dot, low, _mm512_set1_epi32(xq[2 * c]));
                dot = _mm512_dpbusd_epi32(dot, high, _mm512_set1_epi32(xq[2 * c + 1]));
            }
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * TILE)));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g * TILE)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                  _mm512_mul_ps(d, _mm512_set1_ps(x->scale[g])), acc);
            acc = _mm512_fmadd_ps(m, _mm512_set1_ps(x->sum[g]), acc);
        }
        _mm512_storeu_ps(y + t * TILE, acc);
    }
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

typedef struct {
    int layers, hidden, inter, heads, kv_heads, head_dim, block_size, kv_bf16;
    int64_t slots;
    float eps;
} Shape;

typedef struct { /* one step's activations */
    float x[MAX_DIM], normed[MAX_DIM], qkv[MAX_DIM], attended[MAX_DIM], gate_up[2 * MAX_DIM];
    QuantizedVector quantized;
} Scratch;

static Int4Matrix matrix(const void *const *layer, int which) {
    return (Int4Matrix){layer[3 * which], layer[3 * which + 1], layer[3 * which + 2]};
}

/* One layer; called by every thread of the region. 0, or 1 if this thread's attention ran
 * out of memory (the region ORs them). */
static int layer_step(const void *const *layer, const Shape *s, Scratch *w, const float *cos,
                      const float *sin, const int32_t *table, int blocks, int pos) {
    const int H = s->heads, KVH = s->kv_heads, D = s->head_dim, q_size = H * D;
    int failed = 0, len = pos + 1;
#pragma omp single
    {
        rms_norm(w->x, layer[INPUT_NORM], s->hidden, s->eps, w->normed);
        quantize(w->normed, s->hidden, &w->quantized);
    }
    gemv_int4(matrix(layer, QKV), &w->quantized, q_size + 2 * KVH * D, s->hidden, w->qkv);
#pragma omp single
    {
        rope(w->qkv, H + KVH, D, cos, sin);
        int64_t slot = (int64_t)table[pos / s->block_size] * s->block_size + pos % s->block_size;
        store_rows(w->qkv + q_size, KVH, D, (void *)layer[K_CACHE], s->slots, slot, s->kv_bf16);
        store_rows(w->qkv + q_size + KVH * D, KVH, D, (void *)layer[V_CACHE], s->slots, slot,
                   s->kv_bf16);
    }
    float scale = 1.f / sqrtf((float)D);
#pragma omp for schedule(static)
    for (int h = 0; h < KVH; h++)
        failed |= s->kv_bf16
            ? decode_task(0, h, w->qkv, q_size, layer[K_CACHE], layer[V_CACHE], w->attended,
                          table, blocks, &len, H, KVH, D, s->slots, s->block_size, scale, 0, 1)
            : decode_task(0, h, w->qkv, q_size, layer[K_CACHE], layer[V_CACHE], w->attended,
                          table, blocks, &len, H, KVH, D, s->slots, s->block_size, scale, 0, 0);
#pragma omp single
    quantize(w->attended, q_size, &w->quantized);
    gemv_int4(matrix(layer, O), &w->quantized, s->hidden, q_size, w->normed);
#pragma omp single
    {
        for (int i = 0; i < s->hidden; i++) w->x[i] += w->normed[i];
        rms_norm(w->x, layer[POST_NORM], s->hidden, s->eps, w->normed);
        quantize(w->normed, s->hidden, &w->quantized);
    }
    gemv_int4(matrix(layer, GATE_UP), &w->quantized, 2 * s->inter, s->hidden, w->gate_up);
#pragma omp single
    {
        for (int i = 0; i < s->inter; i++) {
            float gate = w->gate_up[i];
            w->gate_up[i] = gate / (1.f + expf(-gate)) * w->gate_up[s->inter + i];
        }
        quantize(w->gate_up, s->inter, &w->quantized);
    }
    gemv_int4(matrix(layer, DOWN), &w->quantized, s->hidden, s->inter, w->normed);
#pragma omp single
    for (int i = 0; i < s->hidden; i++) w->x[i] += w->normed[i];
    return failed;
}
#endif

int64_t fused_scratch_bytes(void) {
#if FUSED
    return (int64_t)sizeof(Scratch);
#else
    return 0;
#endif
}

/* The final normed hidden state of token `token` at position `pos` of a sequence whose
 * cache blocks are `table` [blocks], written to `out` [hidden] (bf16 if out_bf16, else
 * fp32); its K/V land in the cache. `layers` holds LAYER_POINTERS per layer; `embed` is
 * the bf16 or fp32 embedding table (embed_bf16); rope tables fp32 [positions, D].
 * `scratch`: fused_scratch_bytes() bytes, 64-aligned, used by one call at a time.
 * Returns 0, -1 for shapes it does not take (or no AVX512-VNNI), -2 when out of memory. */
int fused_decode(const void *const *layers, const Shape *shape, const void *embed, int embed_bf16,
                 const float *final_norm, const float *rope_cos, const float *rope_sin,
                 int token, int pos, const int32_t *table, int blocks, void *out, int out_bf16,
                 void *scratch) {
#if FUSED
    const Shape *s = shape;
    int H = s->heads, KVH = s->kv_heads, D = s->head_dim;
    if (s->hidden > MAX_DIM || s->inter > MAX_DIM || (H + 2 * KVH) * D > MAX_DIM ||
        bad_shape(&(int){pos + 1}, 1, H, KVH, D) || D % 2 || pos / s->block_size >= blocks)
        return -1;
    Scratch *w = scratch;
    for (int i = 0; i < s->hidden; i++)
        w->x[i] = embed_bf16 ? bf16_to_float(((const uint16_t *)embed)[(size_t)token * s->hidden + i])
                             : ((const float *)embed)[(size_t)token * s->hidden + i];
    const float *cos = rope_cos + (size_t)pos * D, *sin = rope_sin + (size_t)pos * D;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    for (int l = 0; l < s->layers; l++)
        failed |= layer_step(layers + (size_t)l * LAYER_POINTERS, s, w, cos, sin, table, blocks, pos);
    if (!failed) {
        rms_norm(w->x, final_norm, s->hidden, s->eps, w->normed);
        for (int i = 0; i < s->hidden; i++) {
            if (out_bf16)
                ((uint16_t *)out)[i] = float_to_bf16(w->normed[i]);
            else
                ((float *)out)[i] = w->normed[i];
        }
    }
    return failed ? -2 : 0;
#else
    (void)layers, (void)shape, (void)embed, (void)embed_bf16, (void)final_norm, (void)rope_cos;
    (void)rope_sin, (void)token, (void)pos, (void)table, (void)blocks, (void)out, (void)out_bf16;
    (void)scratch;
    return -1;
#endif
}
