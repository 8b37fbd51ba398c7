// Paged decode attention (paged_attention.cpp): the op, and the parts the fused decoder layers call directly, on
// a layer's stores checked once and raw step arguments.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

at::Tensor paged_decode_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t k_format, int64_t v_format, const std::vector<at::Tensor>& k_residual,
                                  const std::vector<at::Tensor>& v_residual, int64_t residual_format, int64_t window,
                                  const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                                  const c10::optional<at::Tensor>& slots, const c10::optional<at::Tensor>& hidden);

namespace kva {

struct KVStores;  // a layer's K and V stores (and residual pool's), checked once

// The stores of paged_decode_attention's arguments; they hold the tensors.
std::shared_ptr<const KVStores> kv_stores(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v, int64_t k_format,
                                          int64_t v_format, const std::vector<at::Tensor>& k_residual,
                                          const std::vector<at::Tensor>& v_residual, int64_t residual_format);

int64_t head_dim(const KVStores& s);

// Whether two layers' stores are alike (block and slot counts, block size, KV heads, head size and formats): a
// step's block tables and slots that pass check_step for one pass for the other.
bool same_pool(const KVStores& a, const KVStores& b);

// TORCH_CHECKs a step's block tables [B, W] and context lengths [B] (and slots [B], to be written) against the stores.
void check_step(const KVStores& s, const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window,
                const at::Tensor* slots);

// The step's new K and V rows (fp32, row t of head h at k + t * k_t + h * k_h) and the slots they go to.
struct NewKV {
    const float *k, *v;
    int64_t k_t, k_h, v_t, v_h;
    const int64_t* slots;
};

// TORCH_CHECKs slots [T] (contiguous int64) against the stores: in the pool new tokens land in, which is written.
void check_slots(const KVStores& s, const at::Tensor& slots);

// TORCH_CHECKs a step's hidden keys (see attend), [B] int64, against its context lengths; their data, or nullptr for none.
const int64_t* check_hidden(const c10::optional<at::Tensor>& hidden, const at::Tensor& context_lens);

// Writes the T new tokens' K/V at their slots (checked by check_slots), as the formats' quantize_tokens write them.
void write_new(const KVStores& s, const NewKV& fresh, int64_t T);

// Writes `fresh` (if given), then out [B, H, D] = attention of the B queries (query b's H heads at q + b * q_stride)
// over their blocks; the arguments must have passed check_step. hidden (nullptr: none): per query, bit j set skips
// the key at lens[b] - 2 - j (a tree of guesses: the branches a guess does not descend from).
void attend(const KVStores& s, const float* q, int64_t q_stride, const NewKV* fresh, int64_t B, int64_t H, const int64_t* tables,
            int64_t W, const int64_t* lens, double scale, int64_t window, const int64_t* hidden, float* out);

// Asks for the first blocks of each sequence's context (its window's, in a sliding layer), up to 256 KiB of K and V,
// into L2: called before a decode step's q/k/v projection, it fetches what attention reads first while the
// projection streams its weights, where the weights read since the last step evicted them.
void prefetch_context(const KVStores& s, int64_t B, const int64_t* tables, int64_t W, const int64_t* lens, int64_t window);

}  // namespace kva
