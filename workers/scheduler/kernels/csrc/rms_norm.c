/* RMSNorm of bf16 rows in one pass (rms_norm.py): out = w * bf16(x * rsqrt(mean(x^2) + eps)),
 * the sum and the scaling in fp32, both roundings where the eager torch ops (and Hugging
 * Face's LlamaRMSNorm) round. Built at load like the other kernels (c_build.py); OpenMP
 * (torch's runtime) only over many rows: a decode's few rows stay on the calling thread. */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define PARALLEL_ROWS 32

int rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                  int64_t dim, float eps) {
    if (rows < 0 || dim <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        uint16_t *dst = out + r * dim;
        float sum = 0.0f;
        for (int64_t j = 0; j < dim; j++) {
            float v = bf16_to_float(row[j]);
            sum += v * v;
        }
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t j = 0; j < dim; j++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(row[j]) * scale));
            dst[j] = float_to_bf16(bf16_to_float(weight[j]) * normed);
        }
    }
    return 0;
}
