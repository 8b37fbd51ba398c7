// Paged decode attention (paged_attention.cpp), for the fused decoder layer to call directly.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

at::Tensor paged_decode_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t k_format, int64_t v_format, const std::vector<at::Tensor>& k_residual,
                                  const std::vector<at::Tensor>& v_residual, int64_t residual_format, int64_t window,
                                  const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                                  const c10::optional<at::Tensor>& slots);
