// A Llama-family decoder layer for a step of a few rows, as two calls around attention (which stays with the
// KV cache's backend, so any KV layout works): before it, RMSNorm, the q/k/v projection and RoPE; after it,
// the output projection and residual, RMSNorm, gate/up, SiLU-and-mul, down and residual. Each replaces a dozen
// Python-dispatched ops with the same arithmetic (the same kernels, adds and norms, in the same order), so a
// fused step gives the module path's numbers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "pointwise.h"
#include "quants.h"

namespace {

// A linear layer's packed parts (consecutive output rows, each of one GGUF type) and optional bias.
struct Linear {
    std::vector<const uint8_t*> parts;
    std::vector<int64_t> rows;
    std::vector<int> types;
    const float* bias = nullptr;
    int64_t out = 0;

    Linear(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& type_ids, const c10::optional<at::Tensor>& b) {
        TORCH_CHECK(!weights.empty() && weights.size() == type_ids.size(), "one GGUF type per packed part");
        for (size_t i = 0; i < weights.size(); ++i) {
            TORCH_CHECK(weights[i].scalar_type() == at::kByte && weights[i].is_contiguous(), "packed parts must be contiguous uint8");
            parts.push_back(weights[i].data_ptr<uint8_t>()), rows.push_back(weights[i].size(0)), types.push_back(int(type_ids[i]));
            out += weights[i].size(0);
        }
        if (b.has_value()) {
            TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == out, "bias must be fp32 [out]");
            bias = b->data_ptr<float>();
        }
    }

    void check(int64_t K) const {
        for (size_t i = 0; i < parts.size(); ++i)
            TORCH_CHECK(K % kvq::info(types[i]).block_weights == 0, "a row of ", K, " weights is not whole blocks of type ", types[i]);
    }

    // out [T, this->out] = x [T, K] @ W.T (+ bias)
    void apply(const float* x, int64_t T, int64_t K, bool int8, float* y) const {
        int64_t col = 0;
        for (size_t i = 0; i < parts.size(); ++i) {
            kvq::matmul(types[i], x, T, K, parts[i], rows[i], int8, y + col, out);
            col += rows[i];
        }
        if (bias)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t n = 0; n < out; ++n) y[t * out + n] += bias[n];
    }
};

void check_rows(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), name,
                " must be contiguous fp32 [T, width] on the CPU");
}

}  // namespace

// x [T, hidden] -> the q/k/v projection of rms_norm(x) [T, (H + 2 KVH) D], RoPE applied to the first
// rotary_heads heads of each row (q's and k's) with cos/sin [T, 1, D].
at::Tensor decode_pre_attention(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& norm_weight,
                                double eps, const std::vector<at::Tensor>& qkv, const std::vector<int64_t>& qkv_types,
                                const c10::optional<at::Tensor>& qkv_bias, bool int8_activations, int64_t rotary_heads) {
    check_rows(x, "x");
    const int64_t T = x.size(0), H = x.size(1), D = cos.size(-1);
    TORCH_CHECK(norm_weight.numel() == H && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
                "norm weight or cos/sin do not match x");
    const Linear proj(qkv, qkv_types, qkv_bias);
    proj.check(H);
    TORCH_CHECK(rotary_heads * D <= proj.out, "more rotary heads than the projection has");
    thread_local std::vector<float> h;
    h.resize(T * H);
    const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) kvp::rms_norm_row(xp + t * H, norm_weight.data_ptr<float>(), H, float(eps), h.data() + t * H);
    at::Tensor out = at::empty({T, proj.out}, x.options());
    float* op = out.data_ptr<float>();
    proj.apply(h.data(), T, H, int8_activations, op);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t head = 0; head < rotary_heads; ++head) kvp::rope_head(op + t * proj.out + head * D, cp + t * D, sp + t * D, D);
    return out;
}

// x [T, hidden] (the layer's input), attn [T, H D] (attention's output) -> the layer's output:
// y = x + o(attn); y + down(silu(gate(n)) * up(n)) with n = rms_norm(y).
at::Tensor decode_post_attention(const at::Tensor& x, const at::Tensor& attn, const std::vector<at::Tensor>& o,
                                 const std::vector<int64_t>& o_types, const c10::optional<at::Tensor>& o_bias,
                                 const at::Tensor& norm_weight, double eps, const std::vector<at::Tensor>& gate_up,
                                 const std::vector<int64_t>& gate_up_types, const std::vector<at::Tensor>& down,
                                 const std::vector<int64_t>& down_types, bool int8_activations) {
    check_rows(x, "x"), check_rows(attn, "attn");
    const int64_t T = x.size(0), H = x.size(1), A = attn.size(1);
    const Linear out_proj(o, o_types, o_bias), up(gate_up, gate_up_types, c10::nullopt), down_proj(down, down_types, c10::nullopt);
    const int64_t I = up.out / 2;
    TORCH_CHECK(attn.size(0) == T && out_proj.out == H && down_proj.out == H && norm_weight.numel() == H, "shapes do not agree");
    out_proj.check(A), up.check(H), down_proj.check(I);
    thread_local std::vector<float> proj, h, gu, act;
    proj.resize(T * H), h.resize(T * H), gu.resize(T * 2 * I), act.resize(T * I);
    at::Tensor y = at::empty({T, H}, x.options());
    float* yp = y.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    out_proj.apply(attn.data_ptr<float>(), T, A, int8_activations, proj.data());
    for (int64_t i = 0; i < T * H; ++i) yp[i] = xp[i] + proj[i];
    for (int64_t t = 0; t < T; ++t) kvp::rms_norm_row(yp + t * H, norm_weight.data_ptr<float>(), H, float(eps), h.data() + t * H);
    up.apply(h.data(), T, H, int8_activations, gu.data());
    for (int64_t t = 0; t < T; ++t) kvp::silu_mul_row(gu.data() + t * 2 * I, gu.data() + t * 2 * I + I, I, act.data() + t * I);
    down_proj.apply(act.data(), T, I, int8_activations, proj.data());
    for (int64_t i = 0; i < T * H; ++i) yp[i] += proj[i];
    return y;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("decode_pre_attention(Tensor x, Tensor cos, Tensor sin, Tensor norm_weight, float eps, Tensor[] qkv, int[] qkv_types, "
          "Tensor? qkv_bias, bool int8_activations, int rotary_heads) -> Tensor", &decode_pre_attention);
    m.def("decode_post_attention(Tensor x, Tensor attn, Tensor[] o, int[] o_types, Tensor? o_bias, Tensor norm_weight, float eps, "
          "Tensor[] gate_up, int[] gate_up_types, Tensor[] down, int[] down_types, bool int8_activations) -> Tensor",
          &decode_post_attention);
}
