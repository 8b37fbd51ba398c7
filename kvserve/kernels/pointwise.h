// The decode step's small fp32 row operations, shared by their own ops (pointwise.cpp) and the fused decoder
// layer ops (decode_layer.cpp).
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace kvp {

// out = x / rms(x) * w over n values.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(sum / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Rotate-half RoPE of one head's D values in place.
inline void rope_head(float* v, const float* c, const float* s, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

// out[i] = silu(g[i]) * u[i] for n values.
inline void silu_mul_row(const float* g, const float* u, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gi));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

}  // namespace kvp
