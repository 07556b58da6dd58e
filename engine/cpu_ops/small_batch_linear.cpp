// y = x @ w.T (+ bias) for a few rows of x (a decode batch), float32, for CPU.
// With few rows a matmul is bound by reading w once; MKL's sgemm at 4-16 rows reads it
// at half the speed of its one-row path (packing w per call). This kernel streams w once:
// each task takes NT rows of w and dots them with MT rows of x at a time, with 16-float
// (AVX-512) or 8-float vectors as the target has, and one horizontal sum per output.
// Registered as torch.ops.tandem_cpu.small_batch_linear; built by cpu_ops/loader.py.
#include <ATen/Parallel.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cstring>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kRowTile = 4;     // MT: rows of x per pass over a w tile
constexpr int kOutputTile = 4;  // NT: rows of w per task (outputs per x row)
#else
constexpr int kLanes = 8;
constexpr int kRowTile = 4;
constexpr int kOutputTile = 2;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline float horizontal_sum(Vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// y[m, n] for m < MT, n < NT: x rows ldx apart, w rows k apart, y rows ldy apart.
template <int MT, int NT>
void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy) {
  Vec acc[MT][NT] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    Vec wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = load(w + n * k + i);
    for (int m = 0; m < MT; ++m) {
      const Vec xv = load(x + m * ldx + i);
      for (int n = 0; n < NT; ++n) acc[m][n] += xv * wv[n];
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int n = 0; n < NT; ++n) {
      float s = horizontal_sum(acc[m][n]);
      for (int64_t j = i; j < k; ++j) s += x[m * ldx + j] * w[n * k + j];
      y[m * ldy + n] = s;
    }
  }
}

template <int NT>
void row_tiles(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t k, float* y,
               int64_t ldy) {
  int64_t m = 0;
  for (; m + kRowTile <= rows; m += kRowTile) tile<kRowTile, NT>(x + m * ldx, ldx, w, k, y + m * ldy, ldy);
  switch (rows - m) {
    case 3: tile<3, NT>(x + m * ldx, ldx, w, k, y + m * ldy, ldy); break;
    case 2: tile<2, NT>(x + m * ldx, ldx, w, k, y + m * ldy, ldy); break;
    case 1: tile<1, NT>(x + m * ldx, ldx, w, k, y + m * ldy, ldy); break;
    default: break;
  }
}

}  // namespace

namespace tandem_cpu {

// x [rows, k] (k contiguous, rows may be strided), weight [n, k] contiguous, bias [n] or
// undefined; returns a new contiguous [rows, n].
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_batch_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_batch_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_batch_linear: x [rows, k] and weight [n, k] expected");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "small_batch_linear: k must be contiguous");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const bool with_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!with_bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat),
              "small_batch_linear: bias [n] float32 expected");
  at::Tensor y = x.new_empty({rows, n});
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t full_tiles = n / kOutputTile;
  // A task is one w tile; 16 of them (64 outputs) amortize the scheduling.
  at::parallel_for(0, full_tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kOutputTile;
      row_tiles<kOutputTile>(rows, xp, ldx, wp + n0 * k, k, yp + n0, n);
    }
  });
  for (int64_t n0 = full_tiles * kOutputTile; n0 < n; ++n0) {  // the last n % NT outputs
    row_tiles<1>(rows, xp, ldx, wp + n0 * k, k, yp + n0, n);
  }
  if (with_bias) y.add_(*bias);
  return y;
}

}  // namespace tandem_cpu
