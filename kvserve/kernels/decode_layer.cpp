// A Llama-family decoder layer for a step of a few rows: before attention, RMSNorm, the q/k/v projection and
// RoPE; after it, the output projection and residual, RMSNorm, gate/up, SiLU-and-mul, down and residual (with
// Qwen3's and Gemma 3's extra norms and Gemma's GELU where set). Where the
// KV cache's backend can run attention natively (decodes over a float, fp8, int8 or int4 cache: it says so, and hands over its
// stores), the whole layer is one call; otherwise two calls around the backend's attention, so any KV layout
// works. Each call replaces a dozen Python-dispatched ops with the same arithmetic (the same kernels, adds and
// norms, in the same order), so a fused step gives the module path's numbers. A feature draft's block, all of its
// guesses, is one call too (FeatureDraft, at the end).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <pybind11/numpy.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/python.h>

#include <algorithm>
#include <string>
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
    void apply(const float* x, int64_t T, int64_t K, int64_t activations, float* y) const {
        int64_t col = 0;
        for (size_t i = 0; i < parts.size(); ++i) {
            kvq::matmul(types[i], x, T, K, parts[i], rows[i], activations, y + col, out);
            col += rows[i];
        }
        if (bias)
            kvp::for_rows(T, [&](int64_t t) {
                for (int64_t n = 0; n < out; ++n) y[t * out + n] += bias[n];
            });
    }
};

void check_rows(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), name,
                " must be contiguous fp32 [T, width] on the CPU");
}

// Row `token` of a packed embedding [V, row bytes] of GGUF type `type`, H values, dequantized into `out`.
void embedding_row(const at::Tensor& embed, int64_t type, int64_t H, int64_t token, float* out) {
    TORCH_CHECK(token >= 0 && token < embed.size(0), "token id ", token, " is past the embedding's ", embed.size(0), " rows");
    kvq::dequantize_f32(int(type), embed.data_ptr<uint8_t>(), kvq::layout(int(type), H), embed.size(0), token, token + 1, out);
}

struct DecodeLayer;

// A decode step's arguments, checked and contiguous: x [T, H]; per rotary table cos/sin [T, D]; per KV group the
// block tables [T, W], context lengths [T] and the slots [T] the new K/V go to; the keys each row skips (kva::attend).
struct DecodeStep {
    int64_t T, H, D;
    std::vector<at::Tensor> cos, sin, tables, lens, slots;
    c10::optional<at::Tensor> hidden;
    // their data, read once: each layer's run would otherwise chase every tensor's pointers anew, through caches the
    // layer before swept
    std::vector<const float*> cos_at, sin_at;
    std::vector<const int64_t*> tables_at, lens_at, slots_at;
    std::vector<int64_t> widths;  // the block tables'
    const int64_t* hidden_at = nullptr;

    DecodeStep(const at::Tensor& x, const std::vector<at::Tensor>& cos_, const std::vector<at::Tensor>& sin_,
               const std::vector<at::Tensor>& tables_, const std::vector<at::Tensor>& lens_, const std::vector<at::Tensor>& slots_,
               const c10::optional<at::Tensor>& hidden_) : hidden(hidden_) {
        check_rows(x, "x");
        T = x.size(0), H = x.size(1), D = cos_.empty() ? 0 : cos_[0].size(-1);
        TORCH_CHECK(cos_.size() == sin_.size() && tables_.size() == lens_.size() && tables_.size() == slots_.size(), "step arguments do not pair up");
        for (size_t i = 0; i < cos_.size(); ++i) {
            TORCH_CHECK(cos_[i].scalar_type() == at::kFloat && sin_[i].scalar_type() == at::kFloat && cos_[i].numel() == T * D &&
                        sin_[i].numel() == T * D, "cos/sin must be fp32 [T, D]");
            cos.push_back(cos_[i].contiguous()), sin.push_back(sin_[i].contiguous());
        }
        for (size_t g = 0; g < tables_.size(); ++g) {
            TORCH_CHECK(tables_[g].dim() == 2 && tables_[g].size(0) == T && slots_[g].numel() == T, "one block table row and slot per row of x");
            tables.push_back(tables_[g].contiguous()), lens.push_back(lens_[g].contiguous()), slots.push_back(slots_[g].contiguous());
        }
        for (size_t r = 0; r < cos.size(); ++r) cos_at.push_back(cos[r].data_ptr<float>()), sin_at.push_back(sin[r].data_ptr<float>());
        for (size_t g = 0; g < tables.size(); ++g)
            tables_at.push_back(tables[g].data_ptr<int64_t>()), lens_at.push_back(lens[g].data_ptr<int64_t>()),
                slots_at.push_back(slots[g].data_ptr<int64_t>()), widths.push_back(tables[g].size(1));
        if (hidden.has_value()) hidden_at = hidden->data_ptr<int64_t>();
    }

    // TORCH_CHECKs group g's tables, lengths and slots against a layer's stores (a few loads per block table entry).
    void check(const kva::KVStores& kv, int64_t g, int64_t window) const {
        TORCH_CHECK(kva::head_dim(kv) == D, "the KV stores do not hold heads of ", D);
        kva::check_step(kv, tables[g], lens[g], window, &slots[g]);
        kva::check_hidden(hidden, lens[g]);
    }

    // The layer over y in place, with rotary table r and KV group g.
    void run(const DecodeLayer& layer, const kva::KVStores& kv, int64_t r, int64_t g, int64_t window, float* y) const;
};

// A norm over each row of n values, in place, where the layer has it (undefined weight: none).
struct RowNorm {
    at::Tensor weight;
    const float* w = nullptr;  // weight's data
    double eps = 0;

    void set(const at::Tensor& weight_, double e) {
        weight = weight_.contiguous(), eps = e;
        w = weight.scalar_type() == at::kFloat ? weight.data_ptr<float>() : nullptr;  // check() names another type
    }

    void check(int64_t n, const char* name) const {
        TORCH_CHECK(!weight.defined() || (weight.scalar_type() == at::kFloat && weight.numel() == n), name, " must be fp32 [", n, "]");
    }

    void apply(float* rows, int64_t count, int64_t n, int64_t stride) const {
        if (w == nullptr) return;
        kvp::for_rows(count, [&](int64_t r) { kvp::rms_norm_row(rows + r * stride, w, n, float(eps), rows + r * stride); });
    }
};

// The MLP block of a decoder layer or a feature draft over T rows of H: y += down(act(gate(n)) * up(n)) with
// n = rms_norm(y), the MLP's output normed by out_norm first where it has a weight; act is SiLU or GELU-tanh.
void mlp_rows(float* y, int64_t T, int64_t H, const float* w, double eps, const Linear& gate_up, const Linear& down, int64_t activations,
              bool gelu, const RowNorm& out_norm) {
    const int64_t I = gate_up.out / 2;
    thread_local std::vector<float> h, gu, act, proj;
    h.resize(T * H), gu.resize(T * 2 * I), act.resize(T * I), proj.resize(T * H);
    float *hp = h.data(), *gp = gu.data(), *ap = act.data(), *pp = proj.data();  // this thread's buffers, for the workers
    kvp::for_rows(T, [&](int64_t t) { kvp::rms_norm_row(y + t * H, w, H, float(eps), hp + t * H); });
    gate_up.apply(hp, T, H, activations, gp);
    kvp::for_rows(T, [&](int64_t t) {
        const float* g = gp + t * 2 * I;
        gelu ? kvp::gelu_tanh_mul_row(g, g + I, I, ap + t * I) : kvp::silu_mul_row(g, g + I, I, ap + t * I);
    });
    down.apply(ap, T, I, activations, pp);
    out_norm.apply(pp, T, H, H);
    kvp::for_rows(T, [&](int64_t t) {
        for (int64_t i = t * H; i < (t + 1) * H; ++i) y[i] += pp[i];
    });
}

// One layer's weights, set once; `pre` and `post` run around the backend's attention, `forward` runs attention too
// with the native decode kernel's arguments for this layer and step (its K/V stores and formats, the step's block
// tables, context lengths, window, and the slots its new K/V go to). Each works on raw rows (the *_rows methods);
// the tensor methods check their arguments and call them. Options other families add, set after construction:
// norms over each head of q and k before RoPE (Qwen3, Gemma 3), norms over the attention's and the MLP's outputs
// before their residual adds (Gemma 3), GELU-tanh instead of SiLU.
struct DecodeLayer : torch::CustomClassHolder {
    at::Tensor norm1, norm2;
    const float *norm1_w, *norm2_w;  // their data
    double eps1, eps2, scale;
    Linear qkv, o, gate_up, down;
    int64_t activations;  // kvq::matmul's
    int64_t heads, kv_heads;
    RowNorm q_norm, k_norm, attn_out_norm, mlp_out_norm;
    bool gelu = false;

    DecodeLayer(at::Tensor norm1, double eps1, std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_types, c10::optional<at::Tensor> qkv_bias,
                at::Tensor norm2, double eps2, std::vector<at::Tensor> o, std::vector<int64_t> o_types, c10::optional<at::Tensor> o_bias,
                std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_types, std::vector<at::Tensor> down,
                std::vector<int64_t> down_types, int64_t activations, int64_t heads, int64_t kv_heads, double scale)
        : norm1(norm1.contiguous()), norm2(norm2.contiguous()), norm1_w(this->norm1.data_ptr<float>()),
          norm2_w(this->norm2.data_ptr<float>()), eps1(eps1), eps2(eps2), scale(scale), qkv(qkv, qkv_types, qkv_bias),
          o(o, o_types, o_bias), gate_up(gate_up, gate_up_types, c10::nullopt), down(down, down_types, c10::nullopt),
          activations(activations), heads(heads), kv_heads(kv_heads) {}

    void qk_norms(const at::Tensor& q, double q_eps, const at::Tensor& k, double k_eps) { q_norm.set(q, q_eps), k_norm.set(k, k_eps); }

    void output_norms(const at::Tensor& attn, double attn_eps, const at::Tensor& mlp, double mlp_eps) {
        attn_out_norm.set(attn, attn_eps), mlp_out_norm.set(mlp, mlp_eps);
    }

    void activation(const std::string& name) {
        TORCH_CHECK(name == "silu" || name == "gelu_pytorch_tanh", "the fused layer runs silu or gelu_pytorch_tanh, not ", name);
        gelu = name == "gelu_pytorch_tanh";
    }

    // TORCH_CHECKs that rows of H values with heads of D values fit this layer's weights.
    void check(int64_t H, int64_t D) const {
        qkv.check(H), gate_up.check(H), down.check(gate_up.out / 2);
        TORCH_CHECK(norm1.numel() == H && norm2.numel() == H && o.out == H && down.out == H, "the layer's width is not ", H);
        TORCH_CHECK((heads + 2 * kv_heads) * D == qkv.out && gate_up.out % 2 == 0, "the q/k/v projection does not give heads of ", D);
        o.check(heads * D);
        q_norm.check(D, "q_norm"), k_norm.check(D, "k_norm"), attn_out_norm.check(H, "attn_out_norm"), mlp_out_norm.check(H, "mlp_out_norm");
    }

    // rms_norm(x) projected to q/k/v [T, (heads + 2 kv_heads) D], q's and k's heads normed (where the layer does) and
    // rotated (cos/sin [T, D]).
    void pre_rows(const float* x, int64_t T, int64_t H, const float* cos, const float* sin, int64_t D, float* out) const {
        thread_local std::vector<float> h;
        h.resize(T * H);
        float* hp = h.data();  // this thread's buffer, for the workers
        kvp::for_rows(T, [&](int64_t t) { kvp::rms_norm_row(x + t * H, norm1_w, H, float(eps1), hp + t * H); });
        qkv.apply(hp, T, H, activations, out);
        kvp::for_rows(T, [&](int64_t t) {
            float* row = out + t * qkv.out;
            q_norm.apply(row, heads, D, D), k_norm.apply(row + heads * D, kv_heads, D, D);
            for (int64_t head = 0; head < heads + kv_heads; ++head) kvp::rope_head(row + head * D, cos + t * D, sin + t * D, D);
        });
    }

    // y = x + o(attn); y + down(act(gate(n)) * up(n)) with n = rms_norm(y), for attn [T, A] (each output normed first
    // where the layer does); y may be x.
    void post_rows(const float* x, const float* attn, int64_t T, int64_t H, int64_t A, float* y) const {
        thread_local std::vector<float> proj;
        proj.resize(T * H);
        float* pp = proj.data();  // this thread's buffer, for the workers
        o.apply(attn, T, A, activations, pp);
        attn_out_norm.apply(pp, T, H, H);
        kvp::for_rows(T, [&](int64_t t) {
            for (int64_t i = t * H; i < (t + 1) * H; ++i) y[i] = x[i] + pp[i];
        });
        mlp_rows(y, T, H, norm2_w, eps2, gate_up, down, activations, gelu, mlp_out_norm);
    }

    // The whole layer for T decoding rows, x -> y (may be x): q/k/v, the new K/V written at their slots and attention
    // over the stores (arguments that passed kva::check_step), then the rest.
    void forward_rows(const float* x, int64_t T, int64_t H, const float* cos, const float* sin, int64_t D, const kva::KVStores& kv,
                      const int64_t* tables, int64_t W, const int64_t* lens, int64_t window, const int64_t* slots, const int64_t* hidden,
                      float* y) const {
        thread_local std::vector<float> projected, attn;
        projected.resize(T * qkv.out), attn.resize(T * heads * D);
        kva::prefetch_context(kv, T, tables, W, lens, window);
        pre_rows(x, T, H, cos, sin, D, projected.data());
        const float* k_new = projected.data() + heads * D;
        const kva::NewKV fresh{k_new, k_new + kv_heads * D, qkv.out, D, qkv.out, D, slots};
        kva::attend(kv, projected.data(), qkv.out, &fresh, T, heads, tables, W, lens, scale, window, hidden, attn.data());
        post_rows(x, attn.data(), T, H, heads * D, y);
    }

    at::Tensor pre(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
        check_rows(x, "x");
        const int64_t T = x.size(0), H = x.size(1), D = cos.size(-1);
        TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D, "cos/sin do not match x");
        check(H, D);
        at::Tensor out = at::empty({T, qkv.out}, x.options());
        pre_rows(x.data_ptr<float>(), T, H, cos.data_ptr<float>(), sin.data_ptr<float>(), D, out.data_ptr<float>());
        return out;
    }

    at::Tensor post(const at::Tensor& x, const at::Tensor& attn) {
        check_rows(x, "x"), check_rows(attn, "attn");
        const int64_t T = x.size(0), H = x.size(1), A = attn.size(1);
        TORCH_CHECK(attn.size(0) == T && A % heads == 0, "shapes do not agree");
        check(H, A / heads);
        at::Tensor y = at::empty({T, H}, x.options());
        post_rows(x.data_ptr<float>(), attn.data_ptr<float>(), T, H, A, y.data_ptr<float>());
        return y;
    }

    at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k,
                       const std::vector<at::Tensor>& v, int64_t k_format, int64_t v_format, const std::vector<at::Tensor>& k_residual,
                       const std::vector<at::Tensor>& v_residual, int64_t residual_format, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, int64_t window, const at::Tensor& slots, const c10::optional<at::Tensor>& hidden) {
        const auto kv = kva::kv_stores(k, v, k_format, v_format, k_residual, v_residual, residual_format);
        const DecodeStep step(x, {cos}, {sin}, {block_tables}, {context_lens}, {slots}, hidden);
        check(step.H, step.D);
        step.check(*kv, 0, window);
        at::Tensor y = x.clone();
        step.run(*this, *kv, 0, 0, window, y.data_ptr<float>());
        return y;
    }
};

void DecodeStep::run(const DecodeLayer& layer, const kva::KVStores& kv, int64_t r, int64_t g, int64_t window, float* y) const {
    layer.forward_rows(y, T, H, cos_at[r], sin_at[r], D, kv, tables_at[g], widths[g], lens_at[g], window, slots_at[g], hidden_at, y);
}

// A model's fused layers bound to their KV stores, with its rotary tables and final norm: a decode step's whole
// layer loop in one call, without a Python-dispatched call (and its boxed arguments) per layer or per table lookup,
// the step's arguments checked once.
struct DecodeStack : torch::CustomClassHolder {
    struct Entry {
        c10::intrusive_ptr<DecodeLayer> layer;
        std::shared_ptr<const kva::KVStores> kv;
        int64_t group, rope;
        int64_t checked = -1;  // the width and head size (H << 16 | D) the layer's weights were last checked against
    };
    std::vector<Entry> layers;
    std::vector<at::Tensor> cos_tables, sin_tables;  // per rotary table: [positions, D]
    RowNorm norm;  // the model's final norm
    // For decode (set_ends): the token embedding (packed rows of embed_type), scaled by embed_scale where that is
    // not 1, and the LM head.
    at::Tensor embed;
    int64_t embed_type = 0;
    double embed_scale = 1;
    Linear head;
    int64_t head_activations = kvq::FP32_ROWS;

    // The next layer, its stores (NativeCPUBackend.stores), its KV group and its rotary table's index. A group's
    // layers hold blocks of one pool (the same counts, block size, heads and formats), so a step's block tables and
    // slots are checked once per group.
    void add(const c10::intrusive_ptr<DecodeLayer>& layer, std::vector<at::Tensor> k, std::vector<at::Tensor> v, int64_t k_format,
             int64_t v_format, std::vector<at::Tensor> k_residual, std::vector<at::Tensor> v_residual, int64_t residual_format,
             int64_t group, int64_t rope) {
        TORCH_CHECK(group >= 0 && rope >= 0, "bad KV group or rotary table index");
        auto kv = kva::kv_stores(k, v, k_format, v_format, k_residual, v_residual, residual_format);
        for (const Entry& e : layers)
            TORCH_CHECK(e.group != group || kva::same_pool(*e.kv, *kv), "layer ", layers.size(), "'s KV stores are not its group's pool");
        layers.push_back({layer, kv, group, rope});
    }

    // The next rotary table (a layer's rope index counts them): cos and sin of every position, [positions, D].
    void add_rope(const at::Tensor& cos, const at::Tensor& sin) {
        TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.device().is_cpu() && sin.device().is_cpu(), "rotary tables must be fp32 [positions, D] on the CPU");
        cos_tables.push_back(cos.contiguous()), sin_tables.push_back(sin.contiguous());
    }

    void set_norm(const at::Tensor& weight, double eps) { norm.set(weight, eps); }

    // The embedding and the head, for decode (after set_norm, whose width they must have).
    void set_ends(const at::Tensor& embedding, int64_t type, double scale, std::vector<at::Tensor> head_parts,
                  std::vector<int64_t> head_types, int64_t activations) {
        TORCH_CHECK(norm.weight.defined(), "set_ends comes after set_norm");
        const int64_t H = norm.weight.numel();
        TORCH_CHECK(embedding.dim() == 2 && embedding.device().is_cpu() && embedding.scalar_type() == at::kByte &&
                    embedding.size(1) == kvq::checked_layout(type, H).row_bytes, "the embedding must be packed rows of ", H, " on the CPU");
        head = Linear(head_parts, head_types, c10::nullopt);
        TORCH_CHECK(head.parts.size() == 1, "the head must be one packed part (its argmax is found as its outputs land)");
        head.check(H);
        embed = embedding.contiguous(), embed_type = type, embed_scale = scale, head_activations = activations;
    }

    // A step of B decoding rows whole: each row's token embedded, every layer, the final norm and the head, each
    // row's argmax found as the head's outputs land. tokens and positions [B]; per KV group g, tables + g * B * W
    // holds the rows' block tables [B, W] (entries a sliding group gave back may be any block: they lie before its
    // window, never read); each row's context is its position + 1 tokens and its new K/V go to its position's
    // slot. Returns the hidden states [B, H], the logits [B, V] and the argmax [B].
    std::tuple<at::Tensor, at::Tensor, at::Tensor> decode(const int64_t* tokens, const int64_t* positions, int64_t B, const int64_t* tables,
                                                          int64_t G, int64_t W, const std::vector<int64_t>& windows, int64_t block_size) {
        TORCH_CHECK(embed.defined(), "decode needs the embedding and the head (set_ends)");
        const int64_t H = norm.weight.numel();
        const auto opts = embed.options().dtype(at::kLong);
        at::Tensor x = at::empty({B, H}, embed.options().dtype(at::kFloat));
        for (int64_t b = 0; b < B; ++b) {
            float* row = x.data_ptr<float>() + b * H;
            embedding_row(embed, embed_type, H, tokens[b], row);
            if (embed_scale != 1)
                for (int64_t i = 0; i < H; ++i) row[i] *= float(embed_scale);
        }
        std::vector<at::Tensor> group_tables, lens, slots;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t* table = tables + g * B * W;
            group_tables.push_back(at::from_blob(const_cast<int64_t*>(table), {B, W}, opts));
            lens.push_back(at::empty({B}, opts)), slots.push_back(at::empty({B}, opts));
            for (int64_t b = 0; b < B; ++b) {
                const int64_t p = positions[b];
                TORCH_CHECK(block_size > 0 && p >= 0 && p / block_size < W, "position ", p, " lies past the block table's ", W, " blocks");
                lens.back().data_ptr<int64_t>()[b] = p + 1;
                slots.back().data_ptr<int64_t>()[b] = table[b * W + p / block_size] * block_size + p % block_size;
            }
        }
        const at::Tensor pos = at::from_blob(const_cast<int64_t*>(positions), {B}, opts);
        at::Tensor y = forward(x, pos, group_tables, lens, windows, slots, int64_t(layers.size()), c10::nullopt);
        at::Tensor logits = at::empty({B, head.out}, x.options()), argmax = at::empty({B}, opts);
        kvq::matmul(head.types[0], y.data_ptr<float>(), B, H, head.parts[0], head.out, head_activations, logits.data_ptr<float>(), head.out,
                    argmax.data_ptr<int64_t>());
        return {y, logits, argmax};
    }

    // The first num_layers layers over x, then the final norm; the rotary tables' rows at `positions` [T]; per KV
    // group the step's block tables, context lengths, window and slots (checked against the group's pool); the keys each row skips (kva::attend; None: none).
    at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const std::vector<at::Tensor>& tables,
                       const std::vector<at::Tensor>& lens, const std::vector<int64_t>& windows, const std::vector<at::Tensor>& slots,
                       int64_t num_layers, const c10::optional<at::Tensor>& hidden) {
        TORCH_CHECK(num_layers >= 0 && num_layers <= int64_t(layers.size()), "the stack has ", layers.size(), " layers, not ", num_layers);
        check_rows(x, "x");
        const int64_t T = x.size(0);
        TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T && positions.device().is_cpu(), "one int64 position per row of x");
        const at::Tensor pos = positions.contiguous();
        std::vector<at::Tensor> cos, sin;  // the tables' rows of this step's positions, [T, D]
        for (size_t r = 0; r < cos_tables.size(); ++r) {
            const int64_t rows = cos_tables[r].size(0), D = cos_tables[r].size(1);
            cos.push_back(at::empty({T, D}, x.options())), sin.push_back(at::empty({T, D}, x.options()));
            for (int64_t t = 0; t < T; ++t) {
                const int64_t p = pos.data_ptr<int64_t>()[t];
                TORCH_CHECK(p >= 0 && p < rows, "position ", p, " is past the rotary tables' ", rows);
                std::copy_n(cos_tables[r].data_ptr<float>() + p * D, D, cos.back().data_ptr<float>() + t * D);
                std::copy_n(sin_tables[r].data_ptr<float>() + p * D, D, sin.back().data_ptr<float>() + t * D);
            }
        }
        const DecodeStep step(x, cos, sin, tables, lens, slots, hidden);
        TORCH_CHECK(windows.size() == tables.size(), "one window per KV group");
        norm.check(step.H, "the final norm");
        std::vector<bool> checked_groups(tables.size());
        for (int64_t i = 0; i < num_layers; ++i) {
            Entry& e = layers[i];
            TORCH_CHECK(e.rope < int64_t(cos.size()) && e.group < int64_t(tables.size()), "missing rotary tables or step arguments for layer ", i);
            if (e.checked != (step.H << 16 | step.D)) e.layer->check(step.H, step.D), e.checked = step.H << 16 | step.D;
            if (!checked_groups[e.group]) step.check(*e.kv, e.group, windows[e.group]), checked_groups[e.group] = true;
        }
        at::Tensor y = x.clone();
        for (int64_t i = 0; i < num_layers; ++i)
            step.run(*layers[i].layer, *layers[i].kv, layers[i].rope, layers[i].group, windows[layers[i].group], y.data_ptr<float>());
        norm.apply(y.data_ptr<float>(), T, step.H, step.H);
        return y;
    }
};

// A feature draft (spec_decode/eagle.py) making k guesses in one call. Per step and row: the embedding of the
// newest token beside the hidden state, fc; x + down(silu(gate(n)) * up(n)) with n = rms_norm(x); the output norm
// (the next step's hidden state); the head over the draft's vocabulary, and the first of its largest logits. The
// same kernels and order as the module path, so the guesses are its guesses.
struct FeatureDraft : torch::CustomClassHolder {
    Linear fc, gate_up, down, head;
    at::Tensor norm, out_norm, vocab, embed;  // vocab: the token id of each head row; embed: the packed embedding rows
    double eps, out_eps;
    int64_t embed_type;
    int64_t activations;  // kvq::matmul's

    FeatureDraft(std::vector<at::Tensor> fc, std::vector<int64_t> fc_types, at::Tensor norm, double eps, std::vector<at::Tensor> gate_up,
                 std::vector<int64_t> gate_up_types, std::vector<at::Tensor> down, std::vector<int64_t> down_types, at::Tensor out_norm,
                 double out_eps, std::vector<at::Tensor> head, std::vector<int64_t> head_types, at::Tensor vocab, at::Tensor embed,
                 int64_t embed_type, int64_t activations)
        : fc(fc, fc_types, c10::nullopt), gate_up(gate_up, gate_up_types, c10::nullopt), down(down, down_types, c10::nullopt),
          head(head, head_types, c10::nullopt), norm(norm.contiguous()), out_norm(out_norm.contiguous()), vocab(vocab.contiguous()),
          embed(embed.contiguous()), eps(eps), out_eps(out_eps), embed_type(embed_type), activations(activations) {
        const int64_t H = this->fc.out;
        this->fc.check(2 * H), this->gate_up.check(H), this->down.check(this->gate_up.out / 2), this->head.check(H);
        TORCH_CHECK(this->norm.numel() == H && this->out_norm.numel() == H && this->down.out == H && this->gate_up.out % 2 == 0,
                    "the draft's block is not ", H, " wide");
        TORCH_CHECK(this->vocab.scalar_type() == at::kLong && this->vocab.numel() == this->head.out, "one token id per head row");
        TORCH_CHECK(this->embed.scalar_type() == at::kByte && this->embed.dim() == 2 &&
                    this->embed.size(1) == kvq::checked_layout(embed_type, H).row_bytes, "the embedding is not packed rows of ", H);
    }

    // k greedy steps, then the first step's next width - 1 likeliest tokens, likeliest first: [B, k + width - 1]
    // guesses, flat, from each sequence's newest token and the hidden state that gave it (row rows[b] of states[b]).
    // Plain lists in and out: as a TorchScript method taking and giving tensors, the Python around it took ~0.25 ms a
    // step and the call ~0.2 ms beyond its kernels, on the caches a step leaves (now ~0.01 and ~0.06; ad hoc, AMX Xeon).
    std::vector<int64_t> propose(const std::vector<int64_t>& tokens, const std::vector<at::Tensor>& states, const std::vector<int64_t>& rows,
                                 int64_t k, int64_t width) {
        const int64_t B = int64_t(tokens.size()), H = fc.out, V = head.out, K = k + width - 1;
        TORCH_CHECK(int64_t(states.size()) == B && int64_t(rows.size()) == B && k >= 1 && width >= 1 && width <= V,
                    "propose takes a token, a states tensor and its row per sequence, k >= 1 and 1 <= width <= ", V);
        std::vector<int64_t> guess(B * K);
        std::vector<float> in(B * 2 * H), x(B * H), h(B * H), logits(B * V);
        for (int64_t b = 0; b < B; ++b) {
            check_rows(states[b], "states");
            TORCH_CHECK(states[b].size(1) == H && rows[b] >= 0 && rows[b] < states[b].size(0), "a state is row < ", states[b].size(0),
                        " of [rows, ", H, "] states");
            std::copy_n(states[b].data_ptr<float>() + rows[b] * H, H, in.data() + b * 2 * H + H);
        }
        for (int64_t step = 0; step < k; ++step) {
            for (int64_t b = 0; b < B; ++b) {
                embedding_row(embed, embed_type, H, step == 0 ? tokens[b] : guess[b * K + step - 1], in.data() + b * 2 * H);
            }
            fc.apply(in.data(), B, 2 * H, activations, x.data());
            mlp_rows(x.data(), B, H, norm.data_ptr<float>(), eps, gate_up, down, activations, false, RowNorm{});
            for (int64_t b = 0; b < B; ++b)
                kvp::rms_norm_row(x.data() + b * H, out_norm.data_ptr<float>(), H, float(out_eps), in.data() + b * 2 * H + H);
            for (int64_t b = 0; b < B; ++b) std::copy_n(in.data() + b * 2 * H + H, H, h.data() + b * H);
            head.apply(h.data(), B, H, activations, logits.data());
            for (int64_t b = 0; b < B; ++b) {
                const float* row = logits.data() + b * V;
                const int64_t* ids = vocab.data_ptr<int64_t>();
                if (step > 0 || width == 1) {
                    guess[b * K + step] = ids[std::max_element(row, row + V) - row];  // the first largest, as argmax
                    continue;
                }
                std::vector<int64_t> top;  // the width largest, by value, the first of equal ones first
                for (int64_t i = 0; i < V; ++i) {
                    if (int64_t(top.size()) == width && !(row[i] > row[top.back()])) continue;
                    top.insert(std::find_if(top.begin(), top.end(), [&](int64_t j) { return row[i] > row[j]; }), i);
                    if (int64_t(top.size()) > width) top.pop_back();
                }
                guess[b * K] = ids[top[0]];
                for (int64_t a = 1; a < width; ++a) guess[b * K + k + a - 1] = ids[top[a]];
            }
        }
        return guess;
    }
};

// A DecodeStack's decode as a plain Python method (pybind11), bound once to the stack, its KV groups' windows and
// the block size: after a step's weights have swept the caches, a TorchScript method call took ~0.4 ms to reach a
// near-empty body where a pybind11 call took ~0.04 (ad hoc, a 2-core AVX2 EPYC). The GIL is released while it runs.
struct WholeStep {
    c10::intrusive_ptr<DecodeStack> stack;
    std::vector<int64_t> windows;
    int64_t block_size;

    WholeStep(const pybind11::handle& stack, std::vector<int64_t> windows, int64_t block_size)
        : stack(torch::jit::toCustomClass<DecodeStack>(stack)), windows(std::move(windows)), block_size(block_size) {}

    // Each row's token and position [B], the block tables [groups, B, W] (see DecodeStack::decode).
    std::tuple<at::Tensor, at::Tensor, at::Tensor> decode(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                                          const pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>& tables) {
        const int64_t B = int64_t(tokens.size());
        TORCH_CHECK(positions.size() == tokens.size() && tables.ndim() == 3 && tables.shape(1) == B && tables.shape(0) == int64_t(windows.size()),
                    "decode takes a token and a position per row and block tables [", windows.size(), " groups, rows, blocks]");
        const pybind11::gil_scoped_release unlocked;
        return stack->decode(tokens.data(), positions.data(), B, tables.data(), tables.shape(0), tables.shape(2), windows, block_size);
    }
};

// A FeatureDraft's propose as a plain Python method, as WholeStep is a DecodeStack's decode.
struct DraftStep {
    c10::intrusive_ptr<FeatureDraft> draft;

    explicit DraftStep(const pybind11::handle& draft) : draft(torch::jit::toCustomClass<FeatureDraft>(draft)) {}

    std::vector<int64_t> propose(const std::vector<int64_t>& tokens, const std::vector<at::Tensor>& states, const std::vector<int64_t>& rows,
                                 int64_t k, int64_t width) {
        const pybind11::gil_scoped_release unlocked;
        return draft->propose(tokens, states, rows, k, width);
    }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    pybind11::class_<WholeStep>(m, "WholeStep")
        .def(pybind11::init<const pybind11::handle&, std::vector<int64_t>, int64_t>())
        .def("decode", &WholeStep::decode);
    pybind11::class_<DraftStep>(m, "DraftStep")
        .def(pybind11::init<const pybind11::handle&>())
        .def("propose", &DraftStep::propose);
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.class_<DecodeLayer>("DecodeLayer")
        .def(torch::init<at::Tensor, double, std::vector<at::Tensor>, std::vector<int64_t>, c10::optional<at::Tensor>, at::Tensor, double,
                         std::vector<at::Tensor>, std::vector<int64_t>, c10::optional<at::Tensor>, std::vector<at::Tensor>,
                         std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double>())
        .def("qk_norms", &DecodeLayer::qk_norms)
        .def("output_norms", &DecodeLayer::output_norms)
        .def("activation", &DecodeLayer::activation)
        .def("pre", &DecodeLayer::pre)
        .def("post", &DecodeLayer::post)
        .def("forward", &DecodeLayer::forward);
    m.class_<DecodeStack>("DecodeStack")  // after DecodeLayer: add takes one
        .def(torch::init<>())
        .def("add", &DecodeStack::add)
        .def("add_rope", &DecodeStack::add_rope)
        .def("set_norm", &DecodeStack::set_norm)
        .def("set_ends", &DecodeStack::set_ends)
        .def("forward", &DecodeStack::forward);
    m.class_<FeatureDraft>("FeatureDraft")
        .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, double, std::vector<at::Tensor>, std::vector<int64_t>,
                         std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, double, std::vector<at::Tensor>, std::vector<int64_t>,
                         at::Tensor, at::Tensor, int64_t, int64_t>());
}
