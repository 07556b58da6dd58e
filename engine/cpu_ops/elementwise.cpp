// Fused elementwise ops of the CPU model path, float32 and bfloat16: RMSNorm,
// SiLU-and-multiply and RoPE, each one pass over its rows where torch takes 2-7 ops and as
// many temporaries. llama.py's modules call them when the cpu kernels are on
// (engine/model/cpu_kernels.py), and decoder_stack.cpp calls the same functions, so a step
// computes the same bits whichever path runs it. In bfloat16 they round where the torch
// ops round (after each op, computing in float32 between), as transformers' modules do.
// Registered as torch.ops.tandem_cpu.{rms_norm,silu_and_mul,rotary_embedding_}; built by
// loader.py.
#include <ATen/Parallel.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>

namespace {

using c10::BFloat16;
using tandem_cpu::kLanes16;
using tandem_cpu::silu16;
using tandem_cpu::Vec16;

// Rows per task: enough elements that a task outweighs its dispatch (~1-2 us to wake the
// other threads). A decode batch of 8 or 32 rows is split too: from 32,768 elements per
// task it ran inline while the other thread waited; from 4,096, 2 threads (AMD EPYC, one
// call): batch 8 SiLU-and-multiply 14 -> 11 us, batch 32 RoPE 21 -> 15, RMSNorm 10 -> 8.
int64_t rows_per_task(int64_t row_elements) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.device().is_cpu(),
              op, ": a 2-d float32 or bfloat16 CPU tensor expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, op, ": rows must be contiguous");
}

void check_same_dtype(const at::Tensor& x, const at::Tensor& other, const char* op, const char* name) {
  TORCH_CHECK(other.scalar_type() == x.scalar_type(), op, ": ", name, " must be ", x.scalar_type(), " like x, got ",
              other.scalar_type());
}

// Applies fn(offset, count) to [0, n) in whole vectors of 16, then the tail (count < 16).
template <typename Fn>
void by_vectors(int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + kLanes16 <= n; i += kLanes16) fn(i, kLanes16);
  if (i < n) fn(i, n - i);
}

// count (<= 16) bfloat16s at p as floats (zeros past count), and back.
inline Vec16 load_bf16_part(const BFloat16* p, int64_t count) {
  if (count == kLanes16) return tandem_cpu::load_bf16(p);
  BFloat16 part[kLanes16] = {};
  std::copy(p, p + count, part);
  return tandem_cpu::load_bf16(part);
}

inline void store_bf16_part(BFloat16* p, Vec16 v, int64_t count) {
  if (count == kLanes16) return tandem_cpu::store_bf16(p, v);
  BFloat16 part[kLanes16];
  tandem_cpu::store_bf16(part, v);
  std::copy(part, part + count, p);
}

// The sum of squares of n floats, load(i, count) giving the `count` (<= 16) from i as a
// vector (zeros past count): in four partial sums, as one chain of multiply-adds waits
// for each (~4 cycles a vector). RMSNorm of 512 x 768 bfloat16 rows (AMX Xeon, 2
// threads, medians of 300, two rounds): 81 / 98 -> 68 / 73 us; 32 rows, one thread:
// 10.1 / 9.6 -> 8.1 / 8.7 us.
template <typename Load>
float sum_of_squares(int64_t n, const Load& load) {
  constexpr int64_t kChains = 4;
  Vec16 sums[kChains] = {};
  int64_t i = 0;
  for (; i + kChains * kLanes16 <= n; i += kChains * kLanes16) {
    for (int64_t c = 0; c < kChains; ++c) {
      const Vec16 v = load(i + c * kLanes16, kLanes16);
      sums[c] += v * v;
    }
  }
  for (; i < n; i += kLanes16) {
    const Vec16 v = load(i, std::min<int64_t>(kLanes16, n - i));
    sums[0] += v * v;
  }
  return tandem_cpu::horizontal_sum16((sums[0] + sums[1]) + (sums[2] + sums[3]));
}

// RMSNorm of one row: x / sqrt(mean(x^2) + eps) * weight.
void rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float sum = sum_of_squares(n, [&](int64_t i, int64_t count) {
    return count == kLanes16 ? tandem_cpu::load16(x + i) : tandem_cpu::load_partial16(x + i, count, 0.f);
  });
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv_rms) * w[i];
}

// In bfloat16: the normalized row rounded, then times the weight rounded.
void rms_norm_row(const BFloat16* x, const BFloat16* w, BFloat16* out, int64_t n, float eps) {
  const float sum = sum_of_squares(n, [&](int64_t i, int64_t count) { return load_bf16_part(x + i, count); });
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  by_vectors(n, [&](int64_t i, int64_t count) {
    const Vec16 normed = tandem_cpu::round_bf16_16(load_bf16_part(x + i, count) * inv_rms);
    store_bf16_part(out + i, normed * load_bf16_part(w + i, count), count);
  });
}

// out = SiLU(gate) * up = gate / (1 + e^-gate) * up over n floats, 16 at a time.
void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes16 <= n; i += kLanes16) {
    tandem_cpu::store16(out + i, silu16(tandem_cpu::load16(gate + i)) * tandem_cpu::load16(up + i));
  }
  if (i < n) {
    const Vec16 g = tandem_cpu::load_partial16(gate + i, n - i, 0.f);
    const Vec16 u = tandem_cpu::load_partial16(up + i, n - i, 0.f);
    tandem_cpu::store_partial16(out + i, silu16(g) * u, n - i);
  }
}

// In bfloat16: SiLU rounded, then times up rounded.
void silu_and_mul_row(const BFloat16* gate, const BFloat16* up, BFloat16* out, int64_t n) {
  by_vectors(n, [&](int64_t i, int64_t count) {
    const Vec16 product = tandem_cpu::silu_times_bf16(load_bf16_part(gate + i, count), load_bf16_part(up + i, count));
    store_bf16_part(out + i, product, count);
  });
}

// llama.py's RoPE for one token: x * cos + halves-swapped x * signed sin, each product
// rounded, then the sum (no fused multiply-add: the same bits as the torch ops).
__attribute__((optimize("fp-contract=off"))) void rotate_token(float* x, const float* cos, const float* sin,
                                                               int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* xh = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = xh[i], x2 = xh[i + half];
      const float a1 = x1 * cos[i], b1 = x2 * sin[i];
      const float a2 = x2 * cos[i + half], b2 = x1 * sin[i + half];
      xh[i] = a1 + b1;
      xh[i + half] = a2 + b2;
    }
  }
}

// In bfloat16: each product and the sum rounded, as the torch ops round them (each
// product is rounded before the add, so no multiply-add can fuse them).
void rotate_token(BFloat16* x, const BFloat16* cos, const BFloat16* sin, int64_t num_heads, int64_t head_dim) {
  using tandem_cpu::round_bf16_16;
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    BFloat16* xh = x + h * head_dim;
    by_vectors(half, [&](int64_t i, int64_t count) {
      const Vec16 x1 = load_bf16_part(xh + i, count), x2 = load_bf16_part(xh + half + i, count);
      const Vec16 a1 = round_bf16_16(x1 * load_bf16_part(cos + i, count));
      const Vec16 b1 = round_bf16_16(x2 * load_bf16_part(sin + i, count));
      const Vec16 a2 = round_bf16_16(x2 * load_bf16_part(cos + half + i, count));
      const Vec16 b2 = round_bf16_16(x1 * load_bf16_part(sin + half + i, count));
      store_bf16_part(xh + i, a1 + b1, count);
      store_bf16_part(xh + half + i, a2 + b2, count);
    });
  }
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t n = x.size(1), x_stride = x.stride(0);
  const T* xs = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* outs = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xs + r * x_stride, w, outs + r * n, n, eps);
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = out.size(1), stride = gate_up.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* outs = out.data_ptr<T>();
  at::parallel_for(0, gate_up.size(0), rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row(in + r * stride, in + r * stride + n, outs + r * n, n);
  });
}

template <typename T>
void rotate_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                 int64_t head_dim) {
  const int64_t row = qkv.stride(0);
  T* x = qkv.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* sn = sin.data_ptr<T>();
  at::parallel_for(0, qkv.size(0), rows_per_task(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_token(x + t * row, cs + t * head_dim, sn + t * head_dim, num_heads, head_dim);
    }
  });
}

}  // namespace

namespace tandem_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_same_dtype(x, weight, "rms_norm", "weight");
  const int64_t n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "rms_norm: a contiguous weight of ", n,
              " elements expected");
  at::Tensor out = x.new_empty({x.size(0), n});
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, weight, static_cast<float>(eps), out);
  } else {
    rms_norm_rows<BFloat16>(x, weight, static_cast<float>(eps), out);
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: an even number of columns expected");
  at::Tensor out = gate_up.new_empty({gate_up.size(0), gate_up.size(1) / 2});
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(gate_up, out);
  } else {
    silu_and_mul_rows<BFloat16>(gate_up, out);
  }
  return out;
}

void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "rotary_embedding_");
  check_same_dtype(qkv, cos, "rotary_embedding_", "cos");
  check_same_dtype(qkv, sin, "rotary_embedding_", "sin");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) >= num_heads * head_dim,
              "rotary_embedding_: ", num_heads, " heads of an even size ", head_dim,
              " expected in rows of ", qkv.size(1));
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim &&
                  sin.numel() == tokens * head_dim,
              "rotary_embedding_: contiguous cos and sin [T, 1, D] expected");
  if (qkv.scalar_type() == at::kFloat) {
    rotate_rows<float>(qkv, cos, sin, num_heads, head_dim);
  } else {
    rotate_rows<BFloat16>(qkv, cos, sin, num_heads, head_dim);
  }
}

}  // namespace tandem_cpu
