// A Llama-family decoder layer for a step of a few rows: before attention, RMSNorm, the q/k/v projection and
// RoPE; after it, the output projection and residual, RMSNorm, gate/up, SiLU-and-mul, down and residual. Where the
// KV cache's backend can run attention natively (decodes over a float cache: it says so, and hands over its
// stores), the whole layer is one call; otherwise two calls around the backend's attention, so any KV layout
// works. Each call replaces a dozen Python-dispatched ops with the same arithmetic (the same kernels, adds and
// norms, in the same order), so a fused step gives the module path's numbers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "paged_attention.h"
#include "pointwise.h"
#include "quants.h"

namespace {

// A linear layer's packed parts (consecutive output rows, each of one GGUF type) and optional bias.
struct Linear {
    std::vector<at::Tensor> tensors;  // held: the pointers below are theirs
    std::vector<const uint8_t*> parts;
    std::vector<int64_t> rows;
    std::vector<int> types;
    const float* bias = nullptr;
    int64_t out = 0;

    Linear() = default;

    Linear(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& type_ids, const c10::optional<at::Tensor>& b) : tensors(weights) {
        TORCH_CHECK(!weights.empty() && weights.size() == type_ids.size(), "one GGUF type per packed part");
        for (size_t i = 0; i < weights.size(); ++i) {
            TORCH_CHECK(weights[i].scalar_type() == at::kByte && weights[i].is_contiguous(), "packed parts must be contiguous uint8");
            parts.push_back(weights[i].data_ptr<uint8_t>()), rows.push_back(weights[i].size(0)), types.push_back(int(type_ids[i]));
            out += weights[i].size(0);
        }
        if (b.has_value()) {
            TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == out, "bias must be fp32 [out]");
            bias = b->data_ptr<float>();
            tensors.push_back(*b);
        }
    }

    void check(int64_t K) const {
        for (size_t i = 0; i < parts.size(); ++i) {
            const int64_t row_bytes = kvq::checked_layout(types[i], K).row_bytes;
            TORCH_CHECK(tensors[i].size(1) == row_bytes, "weights do not match K=", K, ": expected packed rows of ", row_bytes, " bytes");
        }
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

// rms_norm(x) projected to q/k/v [T, (H + 2 KVH) D], RoPE applied to the first rotary_heads heads of each row
// (q's and k's) with cos/sin [T, 1, D].
at::Tensor pre_attention(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& norm_weight,
                         double eps, const Linear& proj, bool int8, int64_t rotary_heads) {
    check_rows(x, "x");
    const int64_t T = x.size(0), H = x.size(1), D = cos.size(-1);
    TORCH_CHECK(norm_weight.numel() == H && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
                "norm weight or cos/sin do not match x");
    proj.check(H);
    TORCH_CHECK(rotary_heads * D <= proj.out, "more rotary heads than the projection has");
    thread_local std::vector<float> h;
    h.resize(T * H);
    const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) kvp::rms_norm_row(xp + t * H, norm_weight.data_ptr<float>(), H, float(eps), h.data() + t * H);
    at::Tensor out = at::empty({T, proj.out}, x.options());
    float* op = out.data_ptr<float>();
    proj.apply(h.data(), T, H, int8, op);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t head = 0; head < rotary_heads; ++head) kvp::rope_head(op + t * proj.out + head * D, cp + t * D, sp + t * D, D);
    return out;
}

// The layer's output from its input x [T, hidden] and attention's output attn [T, H D]:
// y = x + o(attn); y + down(silu(gate(n)) * up(n)) with n = rms_norm(y).
at::Tensor post_attention(const at::Tensor& x, const at::Tensor& attn, const Linear& out_proj, const at::Tensor& norm_weight,
                          double eps, const Linear& up, const Linear& down_proj, bool int8) {
    check_rows(x, "x"), check_rows(attn, "attn");
    const int64_t T = x.size(0), H = x.size(1), A = attn.size(1), I = up.out / 2;
    TORCH_CHECK(attn.size(0) == T && out_proj.out == H && down_proj.out == H && norm_weight.numel() == H, "shapes do not agree");
    out_proj.check(A), up.check(H), down_proj.check(I);
    thread_local std::vector<float> proj, h, gu, act;
    proj.resize(T * H), h.resize(T * H), gu.resize(T * 2 * I), act.resize(T * I);
    at::Tensor y = at::empty({T, H}, x.options());
    float* yp = y.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    out_proj.apply(attn.data_ptr<float>(), T, A, int8, proj.data());
    for (int64_t i = 0; i < T * H; ++i) yp[i] = xp[i] + proj[i];
    for (int64_t t = 0; t < T; ++t) kvp::rms_norm_row(yp + t * H, norm_weight.data_ptr<float>(), H, float(eps), h.data() + t * H);
    up.apply(h.data(), T, H, int8, gu.data());
    for (int64_t t = 0; t < T; ++t) kvp::silu_mul_row(gu.data() + t * 2 * I, gu.data() + t * 2 * I + I, I, act.data() + t * I);
    down_proj.apply(act.data(), T, I, int8, proj.data());
    for (int64_t i = 0; i < T * H; ++i) yp[i] += proj[i];
    return y;
}

// One layer's weights, set once; `pre` and `post` run around the backend's attention, `forward` runs attention too
// with the native decode kernel's arguments for this layer and step (its K/V stores and formats, the step's block
// tables, context lengths, window, and the slots its new K/V go to).
struct DecodeLayer : torch::CustomClassHolder {
    at::Tensor norm1, norm2;
    double eps1, eps2, scale;
    Linear qkv, o, gate_up, down;
    bool int8;
    int64_t heads, kv_heads;

    DecodeLayer(at::Tensor norm1, double eps1, std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_types, c10::optional<at::Tensor> qkv_bias,
                at::Tensor norm2, double eps2, std::vector<at::Tensor> o, std::vector<int64_t> o_types, c10::optional<at::Tensor> o_bias,
                std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_types, std::vector<at::Tensor> down,
                std::vector<int64_t> down_types, bool int8_activations, int64_t heads, int64_t kv_heads, double scale)
        : norm1(norm1.contiguous()), norm2(norm2.contiguous()), eps1(eps1), eps2(eps2), scale(scale), qkv(qkv, qkv_types, qkv_bias),
          o(o, o_types, o_bias), gate_up(gate_up, gate_up_types, c10::nullopt), down(down, down_types, c10::nullopt),
          int8(int8_activations), heads(heads), kv_heads(kv_heads) {}

    at::Tensor pre(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
        return pre_attention(x, cos, sin, norm1, eps1, qkv, int8, heads + kv_heads);
    }

    at::Tensor post(const at::Tensor& x, const at::Tensor& attn) {
        return post_attention(x, attn, o, norm2, eps2, gate_up, down, int8);
    }

    at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k,
                       const std::vector<at::Tensor>& v, int64_t k_format, int64_t v_format, const std::vector<at::Tensor>& k_residual,
                       const std::vector<at::Tensor>& v_residual, int64_t residual_format, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, int64_t window, const at::Tensor& slots) {
        const int64_t T = x.size(0), D = cos.size(-1);
        const at::Tensor projected = pre(x, cos, sin);
        const at::Tensor q = projected.narrow(1, 0, heads * D).view({T, heads, D});
        const at::Tensor k_new = projected.narrow(1, heads * D, kv_heads * D).view({T, kv_heads, D});
        const at::Tensor v_new = projected.narrow(1, (heads + kv_heads) * D, kv_heads * D).view({T, kv_heads, D});
        const at::Tensor attn = paged_decode_attention(q, k, v, block_tables, context_lens, scale, k_format, v_format, k_residual,
                                                       v_residual, residual_format, window, k_new, v_new, slots);
        return post(x, attn.view({T, heads * D}));
    }
};

// A model's fused layers bound to their KV stores: a decode step's whole layer loop in one call, without a
// Python-dispatched call (and its boxed arguments) per layer.
struct DecodeStack : torch::CustomClassHolder {
    struct Entry {
        c10::intrusive_ptr<DecodeLayer> layer;
        std::vector<at::Tensor> k, v, k_residual, v_residual;
        int64_t k_format, v_format, residual_format, group, rope;
    };
    std::vector<Entry> layers;

    // The next layer, its stores (NativeCPUBackend.stores), its KV group and its rotary table's index.
    void add(const c10::intrusive_ptr<DecodeLayer>& layer, std::vector<at::Tensor> k, std::vector<at::Tensor> v, int64_t k_format,
             int64_t v_format, std::vector<at::Tensor> k_residual, std::vector<at::Tensor> v_residual, int64_t residual_format,
             int64_t group, int64_t rope) {
        layers.push_back({layer, k, v, k_residual, v_residual, k_format, v_format, residual_format, group, rope});
    }

    // The first num_layers layers over x; per rotary table cos/sin, per KV group the step's block tables, context
    // lengths, window and slots.
    at::Tensor forward(at::Tensor x, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                       const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& lens, const std::vector<int64_t>& windows,
                       const std::vector<at::Tensor>& slots, int64_t num_layers) {
        TORCH_CHECK(num_layers >= 0 && num_layers <= int64_t(layers.size()), "the stack has ", layers.size(), " layers, not ", num_layers);
        for (int64_t i = 0; i < num_layers; ++i) {
            const Entry& e = layers[i];
            TORCH_CHECK(e.rope < int64_t(cos.size()) && e.rope < int64_t(sin.size()) && e.group < int64_t(tables.size()) &&
                        e.group < int64_t(lens.size()) && e.group < int64_t(windows.size()) && e.group < int64_t(slots.size()),
                        "missing rotary tables or step arguments for layer ", i);
            x = e.layer->forward(x, cos[e.rope], sin[e.rope], e.k, e.v, e.k_format, e.v_format, e.k_residual, e.v_residual,
                                 e.residual_format, tables[e.group], lens[e.group], windows[e.group], slots[e.group]);
        }
        return x;
    }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.class_<DecodeLayer>("DecodeLayer")
        .def(torch::init<at::Tensor, double, std::vector<at::Tensor>, std::vector<int64_t>, c10::optional<at::Tensor>, at::Tensor, double,
                         std::vector<at::Tensor>, std::vector<int64_t>, c10::optional<at::Tensor>, std::vector<at::Tensor>,
                         std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, bool, int64_t, int64_t, double>())
        .def("pre", &DecodeLayer::pre)
        .def("post", &DecodeLayer::post)
        .def("forward", &DecodeLayer::forward);
    m.class_<DecodeStack>("DecodeStack")  // after DecodeLayer: add takes one
        .def(torch::init<>())
        .def("add", &DecodeStack::add)
        .def("forward", &DecodeStack::forward);
}
