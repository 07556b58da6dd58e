// The C++ CPU ops callable from each other's files (one extension, built by loader.py).
#pragma once
#include <ATen/ATen.h>

namespace tandem_cpu {

// out[i] = attention of query[i] over its first seq_lens[i] cached positions (paged_decode.cpp).
void paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, at::Tensor out);

// x @ weight.T (+ bias) for a few float32 rows, streaming the weight once (small_batch_linear.cpp).
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias);

}  // namespace tandem_cpu
