// Fused float32 elementwise ops of the CPU model path: RMSNorm, SiLU-and-multiply and RoPE,
// each one pass over its rows where torch takes 2-7 ops and as many temporaries. llama.py's
// modules call them when the cpu kernels are on (engine/model/cpu_kernels.py), and
// decode_forward.cpp calls the same functions, so a step computes the same bits whichever
// path runs it. Registered as torch.ops.tandem_cpu.{rms_norm,silu_and_mul,rotary_embedding_};
// built by loader.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>

namespace {

// Rows per task: enough elements that a task outweighs its dispatch (a decode step's few
// rows run inline on the calling thread; a prefill's hundreds are split).
int64_t rows_per_task(int64_t row_elements) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": a 2-d float32 CPU tensor expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, op, ": rows must be contiguous");
}

// out = SiLU(gate) * up = gate / (1 + e^-gate) * up over n floats, 16 at a time.
void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  using tandem_cpu::Vec16;
  auto silu_mul = [](Vec16 g, Vec16 u) { return g / (1.f + tandem_cpu::exp16(-g)) * u; };
  int64_t i = 0;
  for (; i + tandem_cpu::kLanes16 <= n; i += tandem_cpu::kLanes16) {
    tandem_cpu::store16(out + i, silu_mul(tandem_cpu::load16(gate + i), tandem_cpu::load16(up + i)));
  }
  if (i < n) {
    const Vec16 g = tandem_cpu::load_partial16(gate + i, n - i, 0.f);
    const Vec16 u = tandem_cpu::load_partial16(up + i, n - i, 0.f);
    tandem_cpu::store_partial16(out + i, silu_mul(g, u), n - i);
  }
}

}  // namespace

namespace tandem_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == n,
              "rms_norm: a contiguous float32 weight of ", n, " elements expected");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps), size = static_cast<float>(n);
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * x_stride;
      float* o = outs + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
      const float inv_rms = 1.f / std::sqrt(sum / size + epsilon);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * inv_rms) * w[i];
    }
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: an even number of columns expected");
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * stride;
      const float* up = gate + n;
      float* o = outs + r * n;
      silu_and_mul_row(gate, up, o, n);
    }
  });
  return out;
}

}  // namespace tandem_cpu

namespace {

// llama.py's RoPE for one token: x * cos + halves-swapped x * signed sin, each product
// rounded, then the sum (no fused multiply-add: the same bits as the torch ops).
__attribute__((optimize("fp-contract=off"))) void rotate_token(float* x, const float* cos,
                                                               const float* sin, int64_t num_heads,
                                                               int64_t head_dim) {
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

}  // namespace

namespace tandem_cpu {

void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "rotary_embedding_");
  const int64_t tokens = qkv.size(0), row = qkv.stride(0);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) >= num_heads * head_dim,
              "rotary_embedding_: ", num_heads, " heads of an even size ", head_dim,
              " expected in rows of ", qkv.size(1));
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim &&
                  sin.numel() == tokens * head_dim && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary_embedding_: contiguous float32 cos and sin [T, 1, D] expected");
  float* x = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  at::parallel_for(0, tokens, rows_per_task(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_token(x + t * row, cs + t * head_dim, sn + t * head_dim, num_heads, head_dim);
    }
  });
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::rms_norm));
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::silu_and_mul));
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.impl("rotary_embedding_", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::rotary_embedding_));
}
