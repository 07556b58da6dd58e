// The C++ CPU ops callable from each other's files (one extension, built by loader.py).
#pragma once
#include <ATen/ATen.h>

#include <cmath>

namespace tandem_cpu {

// out[i] = attention of query[i] over its first seq_lens[i] cached positions (paged_decode.cpp).
void paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, at::Tensor out);

// x @ weight.T (+ bias) for a few float32 rows, streaming the weight once (small_batch_linear.cpp).
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias);

// RMSNorm of float32 rows x [T, H] (contiguous rows) times weight [H] (elementwise.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// SiLU(gate) * up of float32 rows gate_up [T, 2I] as a new [T, I] (elementwise.cpp).
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// RoPE in place on the first num_heads heads of each float32 row of qkv by cos and signed
// sin [T, 1, D] (elementwise.cpp).
void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t num_heads, int64_t head_dim);

// Softmax's middle step: s[i] = exp(s[i] - top) for i < n; returns their sum.
inline float exp_shifted_sum(float* s, int64_t n, float top) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(s[i] - top);
    s[i] = e;
    sum += e;
  }
  return sum;
}

}  // namespace tandem_cpu
