// The decode step's small fp32 ops as one call each: RoPE in place on q or k (a strided view of the fused qkv
// output) and SiLU(gate) * up. A decode step runs them on a few rows, where ATen's composites (slice, neg, cat,
// mul, mul, add; chunk, silu, mul) cost more in dispatch than in arithmetic.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "simd.h"

// x [T, heads, D] (rows and heads strided, D contiguous) rotated in place by cos/sin [T, 1, D]: rotate-half RoPE.
void rope_(at::Tensor x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.device().is_cpu(), "x must be fp32 [T, heads, D]");
    const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.numel() == T * D && sin.numel() == T * D, "cos/sin must be fp32 [T, 1, D]");
    float* xp = x.data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t row = x.stride(0), head = x.stride(1);
    at::parallel_for(0, T * heads, 64, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t t = item / heads;
            float* v = xp + t * row + item % heads * head;
            const float *c = cp + t * D, *s = sp + t * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    });
}

// x [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I].
at::Tensor silu_and_mul(const at::Tensor& input) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat && input.device().is_cpu(), "x must be fp32 [T, 2I]");
    const at::Tensor x = input.contiguous();
    const int64_t T = x.size(0), I = x.size(1) / 2;
    at::Tensor out = at::empty({T, I}, x.options());
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float *g = xp + t * 2 * I, *u = g + I;
            float* o = op + t * I;
            int64_t i = 0;
            for (; i + 8 <= I; i += 8) {
                const __m256 gi = _mm256_loadu_ps(g + i);
                const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gi));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u + i)));
            }
            for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        }
    });
    return out;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rope_);
    m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
}
