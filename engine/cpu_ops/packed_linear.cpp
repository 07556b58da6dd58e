// y = x @ w.T (+ bias) for CPU, with w packed once at load time into column panels.
//
// float32: packed[p, k, j] = w[p * kPanel + j, k] (zero past w's last row), so a panel is
// one contiguous stream of k rows of kPanel output columns. Why: torch's F.linear (MKL's
// sgemm) repacks w on every call. At the few rows of a decode batch that repacking costs
// as much as the multiply (engine/model/linear.py has the numbers). The kernel is an
// outer-product GEMM: a task takes two adjacent panels and, for kRows rows of x at a time,
// keeps kRows x kPanel sums in registers while it walks a panel's k rows (one panel row
// loaded, one x value broadcast per row, kRows x kVectors fused multiply-adds). The panel
// stays in L2 for the next kRows rows, so from memory w is read once per call whatever the
// row count. Every output is one dot product summed in k order, so a row's result does not
// depend on how many rows the call has (batch-invariant, unlike sgemm).
//
// bfloat16 (packs_bfloat16): panels of kPanelBf16 columns in the pair-interleaved (VNNI)
// layout. On CPUs with AMX they are multiplied by torch's batch-reduce GEMM
// (at::native::cpublas, oneDNN's AMX kernels), whose layout it is; on CPUs with
// AVX512-BF16 and no AMX (AMD Zen 4, Intel Cooper Lake) by the outer-product kernel above
// with VDPBF16PS (two bfloat16 products added into a float sum) in place of the fused
// multiply-add. Either way into float sums that are rounded to bfloat16. The same reason:
// F.linear (oneDNN) reorders w on every call.
// Registered as torch.ops.tandem_cpu.packed_linear, pack_linear_weight and packs_bfloat16;
// built by cpu_ops/loader.py; called by engine/model/linear.py and decoder_stack.cpp.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "cpu_ops.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kVectors = 3;  // vectors per panel row: 48 columns
constexpr int kRows = 8;     // 8 x 3 sums, 3 panel vectors and a broadcast: 28 of 32 registers
#else
constexpr int kLanes = 8;
constexpr int kVectors = 2;  // 16 columns
constexpr int kRows = 6;     // 6 x 2 sums, 2 panel vectors and a broadcast: 15 of 16 registers
#endif
constexpr int64_t kPanel = kLanes * kVectors;
// A task's panels. At one or two rows of x (memory-bound: a batch-1 or -2 decode) the kernel
// walks both side by side, two memory streams instead of one: the weight's pass took ~5%
// less time, level with F.linear's matrix-vector path; at more rows it takes them in turn.
constexpr int64_t kPanelsPerTask = 2;
constexpr int kSideBySideMaxRows = 2;
// How far ahead of the panel row in use the kernel asks for the panel's later rows, in
// floats (4 KiB): at 4-32 rows a pass over the small preset's layers took 9-17% less time
// (AMX Xeon). It asks for them into L2 (kPrefetchLocality, the T1 hint): on an AMD EPYC
// (Zen 4) the float32 pass at 8 rows took 10.2-10.9 ms so against 12.6-13.1 into L1, 26.0
// against 27.1 at 32 rows (interleaved, 4 rounds); bfloat16 and 1 row the same.
constexpr int64_t kPrefetchAhead = 1024;
constexpr int kPrefetchLocality = 2;
// Past the first pass of kRows rows over a panel the panel is in L2, and the memory would
// sit idle while the later passes multiply; they ask for the next panel instead (the same
// offset in it as the row in use, so one later pass asks for all of it). The next panel's
// first pass then runs from L2. A pass over the small preset's layers at 32 rows, bfloat16
// (AMD EPYC, 2 threads, interleaved): 12.7-13.3 ms against 13.5-13.8 (the weights in L2
// throughout: 11.4); float32 level (24.2-25.5 against 24.7-25.6); fewer rows are one pass.
inline int64_t prefetch_distance(int64_t row0, int64_t panel, int64_t panels, int64_t panel_elements,
                                 int64_t within_panel) {
  return row0 > 0 && panel + 1 < panels ? panel_elements : within_panel;
}
// Rows of x per parallel pass: one pass's rows stay in cache while every panel uses them.
constexpr int64_t kRowBlock = 256;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

// y[m, q * kPanel + j] = sum over k of x[m, k] * panels[q][k, j] (+ res[m, q * kPanel + j]
// where res is given) for m < R, q < P and j < kPanel (j < last_cols in the last panel): x
// rows ldx apart, y and res rows ldy apart, the P panels adjacent. Each sum is taken in k
// order, whatever R and P, and res added to it last. A single panel's walk asks for the
// floats prefetch_ahead past each row it reads.
template <int R, int P>
void rows_times_panels(const float* x, int64_t ldx, const float* panels, int64_t k_len, float* y,
                       int64_t ldy, int64_t last_cols, const float* res, int64_t prefetch_ahead) {
  Vec sums[R][P][kVectors] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    for (int q = 0; q < P; ++q) {
      const float* row = panels + q * k_len * kPanel + k * kPanel;
      if (P == 1) {
        for (int v = 0; v < kVectors; ++v) __builtin_prefetch(row + v * kLanes + prefetch_ahead, 0, kPrefetchLocality);
      }
      Vec w[kVectors];
      for (int v = 0; v < kVectors; ++v) w[v] = load(row + v * kLanes);
      for (int m = 0; m < R; ++m) {
        const float xs = x[m * ldx + k];
        for (int v = 0; v < kVectors; ++v) sums[m][q][v] += w[v] * xs;
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int q = 0; q < P; ++q) {
      float* out = y + m * ldy + q * kPanel;
      const float* add = res != nullptr ? res + m * ldy + q * kPanel : nullptr;
      if (q < P - 1 || last_cols == kPanel) {
        for (int v = 0; v < kVectors; ++v) {
          const Vec sum = add != nullptr ? sums[m][q][v] + load(add + v * kLanes) : sums[m][q][v];
          std::memcpy(out + v * kLanes, &sum, sizeof(Vec));
        }
      } else {  // the weight's last panel: its zero columns past w's last row are not written
        float panel_sums[kPanel];
        std::memcpy(panel_sums, sums[m][q], sizeof(panel_sums));
        for (int64_t j = 0; j < last_cols; ++j) out[j] = add != nullptr ? panel_sums[j] + add[j] : panel_sums[j];
      }
    }
  }
}

using PanelKernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                             int64_t);

template <int P, int... R>
constexpr std::array<PanelKernel, sizeof...(R) + 1> kernels_by_rows(std::integer_sequence<int, R...>) {
  return {nullptr, &rows_times_panels<R + 1, P>...};
}

// kOnePanel[r] / kPanelsSideBySide[r]: the kernel for r rows of x and one panel / a task's panels.
constexpr auto kOnePanel = kernels_by_rows<1>(std::make_integer_sequence<int, kRows>{});
constexpr auto kPanelsSideBySide =
    kernels_by_rows<kPanelsPerTask>(std::make_integer_sequence<int, kSideBySideMaxRows>{});

// y's columns of the task's panels (first .. first + count - 1 of the weight's
// panels_total) for rows of x (plus res's, where given).
void panels_task(const float* x, int64_t ldx, int64_t rows, const float* packed, int64_t k_len,
                 int64_t first, int64_t count, int64_t panels_total, int64_t n, float* y, const float* res) {
  const int64_t last_cols = std::min(kPanel, n - (first + count - 1) * kPanel);
  const float* panels = packed + first * k_len * kPanel;
  y += first * kPanel;
  if (res != nullptr) res += first * kPanel;
  if (rows <= kSideBySideMaxRows && count == kPanelsPerTask) {
    kPanelsSideBySide[rows](x, ldx, panels, k_len, y, n, last_cols, res, kPrefetchAhead);
    return;
  }
  for (int64_t q = 0; q < count; ++q) {
    const int64_t cols = q == count - 1 ? last_cols : kPanel;
    for (int64_t m = 0; m < rows; m += kRows) {
      const int64_t r = std::min<int64_t>(kRows, rows - m);
      kOnePanel[r](x + m * ldx, ldx, panels + q * k_len * kPanel, k_len, y + m * n + q * kPanel, n, cols,
                   res != nullptr ? res + m * n + q * kPanel : nullptr,
                   prefetch_distance(m, first + q, panels_total, k_len * kPanel, kPrefetchAhead));
    }
  }
}

// bfloat16: panels of kPanelBf16 columns (the most the GEMM packs) in its VNNI layout:
// packed[p, k / 2, j, k % 2] = w[p * kPanelBf16 + j, k]. One brgemm call multiplies up to
// kBrgemmRows rows of x by a panel into float sums, rounded to bfloat16 (after the bias)
// into y. Each output is one call's sum, whatever the row count (batch-invariant). Over the
// small preset's decoder layers (151 MB; F.linear and packed interleaved, best of 15; AMX
// Xeon, 2 cores) packed took 5.8 ms against F.linear's 10.4 at 1 and at 8 rows, 8.0 against
// 10.9 at 32, 14.7 against 20.9 at 128, 42.4 against 42.6 at 512 (the default step budget)
// and 184 against 122 at 2048: past 512 rows oneDNN's own blocking wins.
constexpr int64_t kPanelBf16 = 64;
constexpr int64_t kBrgemmRows = 256;

// out[j] = bfloat16(sums[j] (+ bias[j])) for j < count, rounded to nearest even; then, where
// res is given, that plus res[j], rounded again (as adding res to the output after would).
inline void round_into_bf16(const float* sums, const float* bias, int64_t count, const c10::BFloat16* res,
                            c10::BFloat16* out) {
  int64_t j = 0;
  for (; j + tandem_cpu::kLanes16 <= count; j += tandem_cpu::kLanes16) {
    tandem_cpu::Vec16 v = tandem_cpu::load16(sums + j);
    if (bias != nullptr) v += tandem_cpu::load16(bias + j);
    if (res != nullptr) v = tandem_cpu::round_bf16_16(v) + tandem_cpu::load_bf16(res + j);
    tandem_cpu::store_bf16(out + j, v);
  }
  for (; j < count; ++j) {
    const auto product = static_cast<c10::BFloat16>(bias != nullptr ? sums[j] + bias[j] : sums[j]);
    out[j] = res != nullptr ? static_cast<c10::BFloat16>(static_cast<float>(product) + static_cast<float>(res[j]))
                            : product;
  }
}

at::Tensor pack_bf16(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_len = w.size(1);
  TORCH_CHECK(k_len % 2 == 0, "pack_linear_weight: a bfloat16 weight needs an even k, got ", k_len);
  const int64_t panels = (n + kPanelBf16 - 1) / kPanelBf16, pairs = k_len / 2;
  at::Tensor packed = w.new_zeros({panels, pairs, kPanelBf16, 2});
  if (tandem_cpu::amx_gemm()) {  // by the GEMM's own packer
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      // The panel's rows as the [k, kPanelBf16] matrix brgemm multiplies by, zero past w's end.
      at::Tensor panel = w.new_empty({k_len, kPanelBf16});
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanelBf16, n - p * kPanelBf16);
        if (cols < kPanelBf16) panel.zero_();
        panel.slice(1, 0, cols).copy_(w.slice(0, p * kPanelBf16, p * kPanelBf16 + cols).t());
        at::native::cpublas::pack(k_len, kPanelBf16, kPanelBf16, kPanelBf16, at::kBFloat16, at::kBFloat16,
                                  panel.data_ptr(), packed[p].data_ptr());
      }
    });
    return packed;
  }
  using Pair = uint32_t;  // w[row, 2 k2], w[row, 2 k2 + 1] side by side
  const auto* src = reinterpret_cast<const Pair*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<Pair*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanelBf16, n - p * kPanelBf16);
      for (int64_t j = 0; j < cols; ++j) {
        const Pair* row = src + (p * kPanelBf16 + j) * pairs;
        Pair* column = dst + p * pairs * kPanelBf16 + j;
        for (int64_t k2 = 0; k2 < pairs; ++k2) column[k2 * kPanelBf16] = row[k2];
      }
    }
  });
  return packed;
}

#ifdef __AVX512BF16__
// Without AMX: the float32 kernel's outer product (kDotRows rows of x at a time, their
// sums in registers while a panel's pair rows stream by) with one VDPBF16PS per 16 columns
// adding both products of a pair of k into each float sum: a panel pair row is
// kDotVectors vectors, x's pair one broadcast 32-bit value. Each sum is taken in k order,
// whatever the row count (batch-invariant). Over the small preset's decoder layers (151
// MB; AMD EPYC, 2 cores; against F.linear, oneDNN's AVX512-BF16 kernels): 4.96 against
// 10.0 ms at 1 row, 5.82 against 12.2 at 8, 13.5 against 19.8 at 32, 47.0 against 52.2 at
// 128, level at 512 and 2048 (~410 GFLOP/s, oneDNN's peak here).
constexpr int kDotVectors = kPanelBf16 / 16;  // 4
constexpr int kDotRows = 6;  // 6 x 4 sums, 4 panel vectors and a broadcast: 29 of 32 registers
// bfloat16 elements ahead of the pair row in use that the kernel asks for (4 KiB, as float32's).
constexpr int64_t kDotPrefetchAhead = 2048;

// sums[m * P * kPanelBf16 + q * kPanelBf16 + j] = sum over k of x[m, k] * panels[q][k, j],
// for m < R, q < P and j < kPanelBf16: x rows ldx apart, the P panels adjacent. A single
// panel's walk asks for the elements prefetch_ahead past each pair row it reads.
template <int R, int P>
void rows_times_panels_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panels, int64_t k_len,
                            float* sums, int64_t prefetch_ahead) {
  __m512 acc[R][P][kDotVectors];
  for (int m = 0; m < R; ++m) {
    for (int q = 0; q < P; ++q) {
      for (int v = 0; v < kDotVectors; ++v) acc[m][q][v] = _mm512_setzero_ps();
    }
  }
  const int64_t pairs = k_len / 2, pair_row = 2 * kPanelBf16;
  for (int64_t k2 = 0; k2 < pairs; ++k2) {
    for (int q = 0; q < P; ++q) {
      const c10::BFloat16* row = panels + (q * pairs + k2) * pair_row;
      if (P == 1) {
        for (int v = 0; v < kDotVectors; ++v) {
          __builtin_prefetch(row + v * 32 + prefetch_ahead, 0, kPrefetchLocality);
        }
      }
      __m512bh w[kDotVectors];
      for (int v = 0; v < kDotVectors; ++v) w[v] = (__m512bh)_mm512_loadu_si512(row + v * 32);
      for (int m = 0; m < R; ++m) {
        int32_t x_pair;
        std::memcpy(&x_pair, x + m * ldx + 2 * k2, sizeof(x_pair));
        const __m512bh xs = (__m512bh)_mm512_set1_epi32(x_pair);
        for (int v = 0; v < kDotVectors; ++v) acc[m][q][v] = _mm512_dpbf16_ps(acc[m][q][v], w[v], xs);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int q = 0; q < P; ++q) {
      for (int v = 0; v < kDotVectors; ++v) _mm512_storeu_ps(sums + (m * P + q) * kPanelBf16 + v * 16, acc[m][q][v]);
    }
  }
}

using DotKernel = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, float*, int64_t);

template <int P, int... R>
constexpr std::array<DotKernel, sizeof...(R) + 1> dot_kernels_by_rows(std::integer_sequence<int, R...>) {
  return {nullptr, &rows_times_panels_bf16<R + 1, P>...};
}

constexpr auto kDotOnePanel = dot_kernels_by_rows<1>(std::make_integer_sequence<int, kDotRows>{});
constexpr auto kDotPanelsSideBySide =
    dot_kernels_by_rows<kPanelsPerTask>(std::make_integer_sequence<int, kSideBySideMaxRows>{});

// y's columns of panels first .. first + count - 1 (of the weight's panels_total) for rows
// of x by the VDPBF16PS kernel, rounded to bfloat16 after the bias (where given), then plus
// res's (where given).
void dot_panels_task(const c10::BFloat16* x, int64_t ldx, int64_t rows, const c10::BFloat16* packed, int64_t k_len,
                     int64_t first, int64_t count, int64_t panels_total, int64_t n, const float* bias,
                     const c10::BFloat16* res, c10::BFloat16* y) {
  float sums[kDotRows * kPanelBf16];
  // sums' rows [0, r) of panels p0 .. p0 + panels - 1 into y's rows m0 .. m0 + r - 1.
  auto round_rows = [&](int64_t m0, int64_t r, int64_t p0, int64_t panels) {
    for (int64_t m = 0; m < r; ++m) {
      for (int64_t q = 0; q < panels; ++q) {
        const int64_t p = p0 + q, at = (m0 + m) * n + p * kPanelBf16;
        round_into_bf16(sums + (m * panels + q) * kPanelBf16, bias != nullptr ? bias + p * kPanelBf16 : nullptr,
                        std::min(kPanelBf16, n - p * kPanelBf16), res != nullptr ? res + at : nullptr, y + at);
      }
    }
  };
  const int64_t panel_size = k_len * kPanelBf16;
  if (rows <= kSideBySideMaxRows && count == kPanelsPerTask) {
    kDotPanelsSideBySide[rows](x, ldx, packed + first * panel_size, k_len, sums, kDotPrefetchAhead);
    round_rows(0, rows, first, kPanelsPerTask);
    return;
  }
  for (int64_t p = first; p < first + count; ++p) {
    for (int64_t m = 0; m < rows; m += kDotRows) {
      const int64_t r = std::min<int64_t>(kDotRows, rows - m);
      kDotOnePanel[r](x + m * ldx, ldx, packed + p * panel_size, k_len, sums,
                      prefetch_distance(m, p, panels_total, panel_size, kDotPrefetchAhead));
      round_rows(m, r, p, 1);
    }
  }
}
#endif

// sums [m_len, kPanelBf16] = rows m0 .. m0 + m_len - 1 of x times panel p of a bfloat16
// weight packed for AMX (k_len rows of the panel), by torch's batch-reduce GEMM.
inline void panel_sums_amx(const c10::BFloat16* x, int64_t ldx, int64_t m0, int64_t m_len, const c10::BFloat16* packed,
                           int64_t k_len, int64_t p, float* sums) {
  at::native::cpublas::brgemm(m_len, kPanelBf16, k_len, ldx, kPanelBf16, kPanelBf16, false, x + m0 * ldx,
                              packed + p * k_len * kPanelBf16, sums);
}

at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor* bias,
                              const at::Tensor* residual) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanelBf16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.size(0) == (n + kPanelBf16 - 1) / kPanelBf16,
              "packed_linear: a bfloat16 weight from pack_linear_weight with n rows expected");
  const int64_t k_len = packed.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_len && x.stride(1) == 1,
              "packed_linear: x [rows, k] with k contiguous expected");
  const int64_t rows = x.size(0), ldx = x.stride(0), panels = packed.size(0);
  at::Tensor y = x.new_empty({rows, n});
  if (rows == 0) return y;
  using c10::BFloat16;
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const BFloat16* wp = packed.data_ptr<BFloat16>();
  const float* bp = bias != nullptr ? bias->data_ptr<float>() : nullptr;
  const BFloat16* rp = residual != nullptr ? residual->data_ptr<BFloat16>() : nullptr;
  BFloat16* yp = y.data_ptr<BFloat16>();
#ifdef __AVX512BF16__
  if (!tandem_cpu::amx_gemm()) {
    const int64_t tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
    for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
      const int64_t block_rows = std::min(kRowBlock, rows - row0);
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t first = t * kPanelsPerTask;
          dot_panels_task(xp + row0 * ldx, ldx, block_rows, wp, k_len, first,
                          std::min(kPanelsPerTask, panels - first), panels, n, bp,
                          rp != nullptr ? rp + row0 * n : nullptr, yp + row0 * n);
        }
      });
    }
    return y;
  }
#endif
  const int64_t row_blocks = (rows + kBrgemmRows - 1) / kBrgemmRows;
  // Tasks panel-major: a thread's consecutive tasks reuse a panel while it is in cache.
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    const tandem_cpu::BrgemmScope brgemm_scope;
    std::vector<float> sums(std::min(rows, kBrgemmRows) * kPanelBf16);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / row_blocks, m0 = (t % row_blocks) * kBrgemmRows;
      const int64_t m_len = std::min(kBrgemmRows, rows - m0), cols = std::min(kPanelBf16, n - p * kPanelBf16);
      panel_sums_amx(xp, ldx, m0, m_len, wp, k_len, p, sums.data());
      const float* panel_bias = bp != nullptr ? bp + p * kPanelBf16 : nullptr;
      for (int64_t m = 0; m < m_len; ++m) {
        const int64_t at = (m0 + m) * n + p * kPanelBf16;
        round_into_bf16(sums.data() + m * kPanelBf16, panel_bias, cols, rp != nullptr ? rp + at : nullptr, yp + at);
      }
    }
  });
  return y;
}

// SiLU(gate) * up for rows of x, by the AMX path of packed_linear_bf16 over the gate_up
// weight's panels in pairs (gate panel q and up panel q + I / kPanelBf16): each task's two
// sums are rounded to bfloat16 as packed_linear rounds them, then go through
// silu_and_mul's arithmetic into y [rows, I] while they are in L1. What it saves is the
// [rows, 2I] product's trip through memory and a pass over it: the small preset's gate/up
// product and SiLU-and-multiply (AMX Xeon, 2 threads, medians of 30 calls) took 2.15 ->
// 1.94 ms at 512 rows, 0.26 -> 0.21 at 32 rows.
at::Tensor packed_silu_and_mul_amx(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  using c10::BFloat16;
  const int64_t k_len = packed.size(1) * 2, rows = x.size(0), ldx = x.stride(0);
  const int64_t pairs = intermediate / kPanelBf16, row_blocks = (rows + kBrgemmRows - 1) / kBrgemmRows;
  at::Tensor y = x.new_empty({rows, intermediate});
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const BFloat16* wp = packed.data_ptr<BFloat16>();
  BFloat16* yp = y.data_ptr<BFloat16>();
  at::parallel_for(0, pairs * row_blocks, 1, [&](int64_t begin, int64_t end) {
    const tandem_cpu::BrgemmScope brgemm_scope;
    const int64_t block = std::min(rows, kBrgemmRows) * kPanelBf16;
    std::vector<float> gate(block), up(block);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t q = t / row_blocks, m0 = (t % row_blocks) * kBrgemmRows;
      const int64_t m_len = std::min(kBrgemmRows, rows - m0);
      panel_sums_amx(xp, ldx, m0, m_len, wp, k_len, q, gate.data());
      panel_sums_amx(xp, ldx, m0, m_len, wp, k_len, q + pairs, up.data());
      for (int64_t m = 0; m < m_len; ++m) {
        BFloat16* out = yp + (m0 + m) * intermediate + q * kPanelBf16;
        for (int64_t j = 0; j < kPanelBf16; j += tandem_cpu::kLanes16) {
          const tandem_cpu::Vec16 g = tandem_cpu::round_bf16_16(tandem_cpu::load16(gate.data() + m * kPanelBf16 + j));
          const tandem_cpu::Vec16 u = tandem_cpu::round_bf16_16(tandem_cpu::load16(up.data() + m * kPanelBf16 + j));
          tandem_cpu::store_bf16(out + j, tandem_cpu::silu_times_bf16(g, u));
        }
      }
    }
  });
  return y;
}

}  // namespace

namespace tandem_cpu {

void release_brgemm_tiles() { at::native::cpublas::brgemm_release(); }

bool amx_gemm() {
  static const bool available = at::native::cpublas::could_pack(at::kBFloat16);
  return available;
}

bool packs_bfloat16() {
#ifdef __AVX512BF16__
  return true;
#else
  return amx_gemm();
#endif
}

bool fuses_silu_and_mul(const at::Tensor& packed_gate_up, int64_t intermediate) {
  return amx_gemm() && packed_gate_up.dim() == 4 && packed_gate_up.scalar_type() == at::kBFloat16 &&
         packed_gate_up.size(2) == kPanelBf16 && packed_gate_up.size(3) == 2 && packed_gate_up.is_contiguous() &&
         intermediate > 0 && intermediate % kPanelBf16 == 0 && packed_gate_up.size(0) == 2 * intermediate / kPanelBf16;
}

at::Tensor packed_silu_and_mul(const at::Tensor& x, const at::Tensor& packed_gate_up, int64_t intermediate) {
  TORCH_CHECK(fuses_silu_and_mul(packed_gate_up, intermediate),
              "packed_silu_and_mul: a bfloat16 gate_up weight packed for AMX, I a multiple of ", kPanelBf16,
              ", expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == packed_gate_up.size(1) * 2 &&
                  x.stride(1) == 1,
              "packed_silu_and_mul: bfloat16 x [rows, k] with k contiguous expected");
  return packed_silu_and_mul_amx(x, packed_gate_up, intermediate);
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_linear_weight: a float32 or bfloat16 CPU weight [n, k] expected");
  if (weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(packs_bfloat16(), "pack_linear_weight: this CPU has no bfloat16 GEMM kernel to pack for");
    return pack_bf16(weight);
  }
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_len = w.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = w.new_zeros({panels, k_len, kPanel});
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = src + (p * kPanel + j) * k_len;
        float* column = dst + p * k_len * kPanel + j;
        for (int64_t k = 0; k < k_len; ++k) column[k * kPanel] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && x.scalar_type() == packed.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "packed_linear: float32 or bfloat16 CPU tensors of one dtype expected");
  const bool with_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(!with_residual || (residual->dim() == 2 && residual->size(0) == x.size(0) && residual->size(1) == n &&
                                 residual->is_contiguous() && residual->scalar_type() == x.scalar_type()),
              "packed_linear: a contiguous residual [rows, n] of x's dtype expected");
  const at::Tensor* residual_rows = with_residual ? &*residual : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    const bool with_bias = bias.has_value() && bias->defined();
    TORCH_CHECK(!with_bias || (bias->dim() == 1 && bias->size(0) == n), "packed_linear: bias [n] expected");
    const at::Tensor bias_sums = with_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    return packed_linear_bf16(x, packed, n, with_bias ? &bias_sums : nullptr, residual_rows);
  }
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.size(0) == (n + kPanel - 1) / kPanel,
              "packed_linear: a weight from pack_linear_weight with n rows expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) && x.stride(1) == 1,
              "packed_linear: x [rows, k] with k contiguous expected");
  const bool with_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!with_bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat),
              "packed_linear: bias [n] float32 expected");
  const int64_t rows = x.size(0), k_len = x.size(1), ldx = x.stride(0);
  const int64_t panels = packed.size(0);
  at::Tensor y = x.new_empty({rows, n});
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // With a bias the residual comes after it, as two adds after the product would.
  const float* rp = with_residual && !with_bias ? residual->data_ptr<float>() : nullptr;
  const int64_t tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
    const int64_t block_rows = std::min(kRowBlock, rows - row0);
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first = t * kPanelsPerTask;
        panels_task(xp + row0 * ldx, ldx, block_rows, wp, k_len, first,
                    std::min(kPanelsPerTask, panels - first), panels, n, yp + row0 * n,
                    rp != nullptr ? rp + row0 * n : nullptr);
      }
    });
  }
  if (with_bias) {
    y.add_(*bias);
    if (with_residual) y.add_(*residual);
  }
  return y;
}

}  // namespace tandem_cpu
