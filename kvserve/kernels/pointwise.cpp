// The decode step's small fp32 ops as one call each: RMSNorm, RoPE in place on q or k (a strided view of the
// fused qkv output) and SiLU(gate) * up. A decode step runs them on a few rows, where ATen's composites
// (pow, mean, rsqrt, mul; slice, neg, cat, mul, mul, add; chunk, silu, mul) cost more in dispatch than in arithmetic.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "pointwise.h"

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
    TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && input.device().is_cpu(),
                "rms_norm takes fp32 CPU tensors");
    const at::Tensor x = input.contiguous(), w = weight.contiguous();
    const int64_t n = w.numel(), rows = x.numel() / n;
    TORCH_CHECK(x.size(-1) == n, "weight does not match the last dimension");
    at::Tensor out = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) kvp::rms_norm_row(xp + r * n, wp, n, float(eps), op + r * n);
    });
    return out;
}

// x [T, heads, D] (rows and heads strided, D contiguous) rotated in place by cos/sin [T, 1, D]: rotate-half RoPE.
void rope_(at::Tensor x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.device().is_cpu(), "x must be fp32 [T, heads, D]");
    const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.numel() == T * D && sin.numel() == T * D, "cos/sin must be fp32 [T, 1, D]");
    float* xp = x.data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t row = x.stride(0), head = x.stride(1);
    at::parallel_for(0, T * heads, 64, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t t = item / heads;
            kvp::rope_head(xp + t * row + item % heads * head, cp + t * D, sp + t * D, D);
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
        for (int64_t t = begin; t < end; ++t) kvp::silu_mul_row(xp + t * 2 * I, xp + t * 2 * I + I, I, op + t * I);
    });
    return out;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
    m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rope_);
    m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
}
