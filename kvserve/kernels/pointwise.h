// The decode step's small fp32 row operations, shared by their own ops (pointwise.cpp) and the fused decoder
// layer ops (decode_layer.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace kvp {

// f(t) for each row t < T, the rows shared among the threads where there are enough of them (a prompt chunk's
// norms, RoPE and activations ran on one thread while the other waited; a decode step's few rows stay on the
// caller's). Each row's arithmetic is its own, so the numbers do not depend on the split. f runs on the workers:
// it must not reach the caller's thread_local buffers by name.
template <typename F>
inline void for_rows(int64_t T, const F& f, int64_t grain = 8) {
    at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) f(t);
    });
}

// out = x / rms(x) * w over n values. The sum of squares runs in four 8-wide chains: one scalar chain of n
// dependent adds took ~1 us a norm, two norms a layer, on a decode step's critical path.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * j), _mm256_loadu_ps(x + i + 8 * j), acc[j]);
    for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc[0]);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; ++i) sum += x[i] * x[i];
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

// out[i] = gelu(g[i]) * u[i] for n values, GELU's tanh approximation as torch's gelu(approximate="tanh"):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with tanh(y) = 1 - 2 / (exp(2y) + 1).
inline void gelu_tanh_mul_row(const float* g, const float* u, int64_t n, float* out) {
    const float k = 0.7978845608028654f, c = 0.044715f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i);
        const __m256 y = _mm256_mul_ps(_mm256_set1_ps(k), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c), gi), _mm256_mul_ps(gi, gi), gi));
        const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                                           _mm256_add_ps(exp_ps(_mm256_add_ps(y, y)), _mm256_set1_ps(1.0f))));
        const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gi), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) out[i] = 0.5f * g[i] * (1.0f + std::tanh(k * (g[i] + c * g[i] * g[i] * g[i]))) * u[i];
}

}  // namespace kvp
