// Prefill attention for CPU over the paged cache: one prefill chunk's queries against its
// cached prefix and its own tokens (causal), GQA, float32 and bfloat16 (on CPUs with AMX
// or AVX512-BF16 by bfloat16 GEMMs, prefill_bf16 below; elsewhere by the float32 walk over
// K/V and queries made floats as they are copied), head dims that are multiples of 16.
// The chunk's K/V are already in the cache. float32: each KV head's keys are first copied
// out of their blocks into panels of 16 keys stored dimension-major (a panel row is one
// vector: a key dimension of 16 keys), its values into contiguous rows. Then one task per
// (KV head, block of kQueryTokens query tokens) stacks the head's query heads token by
// token into rows and walks them in blocks of kRows rows, flash-attention style: per key
// tile of kKeyTile keys, the block's scores (register-blocked multiply-adds over the
// panels, only as far as the block's last row may see), an online softmax per row
// (causality applied there), and the values summed into the block's output rows by a
// second register-blocked kernel; a block's scores stay in L1. No GEMM library calls, no
// mask tensor, no gather. The copies hold the context's K/V once (every task of a head
// reads them); a task's own scratch is bounded by its rows and the key tile. The copy
// tasks alternate keys and values (copy_heads), and keys are transposed sixteen at a time
// in registers (store_transposed16), not stored one element at a time: over 12 layers of
// the small preset's heads (AMD EPYC, 2 threads, interleaved) bfloat16 16 tokens after
// 1,000 cached went 4.1-6.5 -> 3.6-4.2 ms, 64 after 2,000 27-30 -> 20-22, 16 after 200
// 1.2 -> 0.8-1.0, 512-token chunks level; with the transpose fully unrolled (its rows had
// spilled to the stack), 16 after 1,008 float32 7.7-8.1 -> 6.0-6.2 ms and bfloat16
// 4.2-5.2 -> 3.1-4.3 (medians of 100, 3 rounds).
// Registered as torch.ops.tandem_cpu.paged_prefill; built by cpu_ops/loader.py.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "cpu_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kQueryTokens = 64;
constexpr int64_t kKeyTile = 512;
using tandem_cpu::kLanes16;
using tandem_cpu::kLanesN;
using tandem_cpu::load16;
using tandem_cpu::loadN;
using tandem_cpu::splatN;
using tandem_cpu::storeN;
using tandem_cpu::VecN;
using tandem_cpu::splat16;
using tandem_cpu::store16;
using tandem_cpu::store_row;
using tandem_cpu::Ints16;
using tandem_cpu::Vec16;

// Rows per block, and the register tiles of one-register vectors (VecN): with AVX-512
// scores as kRows x 2 panels of 16 keys, value sums as kValueRows x up to 4 vectors (64
// dims), 24 accumulators of 32 registers; with AVX2 (8-float registers) scores as 6 rows
// x 1 panel (2 registers each) and value sums as 2 rows x 4 vectors (32 dims), 12 and 8
// of 16. With the AVX2 tiles float32 prefill attention of 512 tokens went from 43 to
// 11.7 ms a layer (SDPA: 18-20; AMD EPYC with AVX2, 2 threads).
#ifdef __AVX512F__
constexpr int kRows = 12;
constexpr int kScorePanels = 2;
constexpr int kValueRows = 6;
#else
constexpr int kRows = 6;
constexpr int kScorePanels = 1;
constexpr int kValueRows = 2;
#endif
constexpr int kValueVectors = 4;
// A panel row (16 keys' values of one dimension) in one-register vectors.
constexpr int kPanelVectors = kLanes16 / kLanesN;

// One KV head's rows (head_dim elements per token) in a paged cache's K or V half, and
// look-ahead requests for them into L2: a head's rows lie a whole token's heads apart in
// their blocks and the blocks are scattered over the pool, which the hardware prefetchers
// do not follow. The copies below ask for the rows kCopyAheadKeys tokens ahead of the ones
// they copy: engine steps of 16 tokens after 1,008 cached (AMD EPYC, 2 threads, 3
// interleaved rounds of 60) took bfloat16 16.6-17.3 ms (medians) against 17.7-18.7
// without, float32 26.6-28.2 against 27.8-29.6.
constexpr int64_t kCopyAheadKeys = 64;

template <typename T>
struct HeadRows {
  const T* cache;
  const int64_t* table;
  int64_t block_size, kv_heads, head, head_dim, num_keys;

  const T* row(int64_t t) const {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    return cache + (slot * kv_heads + head) * head_dim;
  }

  // Rows [t0 + kCopyAheadKeys, + count) that exist.
  void prefetch_ahead(int64_t t0, int64_t count) const {
    const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t t = t0 + kCopyAheadKeys; t < std::min(t0 + kCopyAheadKeys + count, num_keys); ++t) {
      const char* p = reinterpret_cast<const char*>(row(t));
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
  }
};

// Sixteen keys' rows transposed: load(j) gives 16 32-bit lanes of key j (j < n; zeros for
// the keys past n), and lane l of the sixteen keys is written as one vector at
// dst + l * dst_stride. Both walks' key copies go through it (floats, or bfloat16 pairs).
template <typename Load>
void store_transposed16(int64_t n, const Load& load, float* dst, int64_t dst_stride) {
  Vec16 r[kLanes16];
  for (int64_t j = 0; j < kLanes16; ++j) r[j] = j < n ? load(j) : Vec16{};
  tandem_cpu::transpose16x16(r);
  for (int64_t l = 0; l < kLanes16; ++l) store16(dst + l * dst_stride, r[l]);
}

// The copy phase of both walks: each KV head's keys and values, as 2 * kv_heads tasks
// that alternate keys and values, so each thread gets both kinds (a thread given only
// keys, the slower copy, held the other at the join).
template <typename CopyKeys, typename CopyValues>
void copy_heads(int64_t kv_heads, const CopyKeys& copy_keys, const CopyValues& copy_values) {
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      if (task % 2 == 0) {
        copy_keys(task / 2);
      } else {
        copy_values(task / 2);
      }
    }
  });
}

// Keys [0, num_keys) of one KV head in panels of kLanes16 keys: panel p's row d holds
// dimension d of keys p * kLanes16 ... + kLanes16 - 1 (zeros past the last key). Sixteen
// keys at a time: 16 dims of each read as floats, transposed in registers, written as 16
// panel rows.
template <typename T>
void pack_keys(const HeadRows<T>& keys, float* panels) {
  const int64_t num_keys = keys.num_keys, head_dim = keys.head_dim;
  const T* key_rows[kLanes16];
  for (int64_t t0 = 0; t0 < num_keys; t0 += kLanes16) {
    keys.prefetch_ahead(t0, kLanes16);
    const int64_t n = std::min<int64_t>(kLanes16, num_keys - t0);
    for (int64_t j = 0; j < n; ++j) key_rows[j] = keys.row(t0 + j);
    float* panel = panels + (t0 / kLanes16) * head_dim * kLanes16;
    for (int64_t d0 = 0; d0 < head_dim; d0 += kLanes16) {
      const auto dims = [&](int64_t j) { return tandem_cpu::load_row(key_rows[j] + d0); };
      store_transposed16(n, dims, panel + d0 * kLanes16, kLanes16);
    }
  }
}

template <typename T>
void copy_values(const HeadRows<T>& values, float* rows) {
  const int64_t head_dim = values.head_dim;
  for (int64_t t = 0; t < values.num_keys; ++t) {
    if (t % kLanes16 == 0) values.prefetch_ahead(t, kLanes16);
    const T* src = values.row(t);
    for (int64_t d = 0; d < head_dim; d += kLanes16) store16(rows + t * head_dim + d, tandem_cpu::load_row(src + d));
  }
}

// s[r][p * kLanes16 + l] = q row r . key l of panel p, for R rows and P panels.
template <int R, int P>
void score_tile(const float* q, int64_t head_dim, const float* panels, float* s, int64_t s_stride) {
  constexpr int V = P * kPanelVectors;
  VecN acc[R][V] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    VecN k[V];
    for (int v = 0; v < V; ++v) {
      k[v] = loadN(panels + ((v / kPanelVectors) * head_dim + d) * kLanes16 + (v % kPanelVectors) * kLanesN);
    }
    for (int r = 0; r < R; ++r) {
      const VecN qb = splatN(q[r * head_dim + d]);
      for (int v = 0; v < V; ++v) acc[r][v] += qb * k[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) storeN(s + r * s_stride + v * kLanesN, acc[r][v]);
  }
}

template <int R>
void score_rows(const float* q, int64_t head_dim, const float* panels, int64_t num_panels, float* s,
                int64_t s_stride) {
  int64_t p = 0;
  for (; p + kScorePanels <= num_panels; p += kScorePanels) {
    score_tile<R, kScorePanels>(q, head_dim, panels + p * head_dim * kLanes16, s + p * kLanes16, s_stride);
  }
  if (p < num_panels) score_tile<R, 1>(q, head_dim, panels + p * head_dim * kLanes16, s + p * kLanes16, s_stride);
}

// Scores of `rows` (<= kRows) query rows against num_panels panels.
void score_block(int rows, const float* q, int64_t head_dim, const float* panels, int64_t num_panels, float* s,
                 int64_t s_stride) {
  switch (rows) {
#define TANDEM_SCORE_CASE(n) \
  case n:                    \
    return score_rows<n>(q, head_dim, panels, num_panels, s, s_stride);
    TANDEM_SCORE_CASE(1)
    TANDEM_SCORE_CASE(2)
    TANDEM_SCORE_CASE(3)
    TANDEM_SCORE_CASE(4)
    TANDEM_SCORE_CASE(5)
    TANDEM_SCORE_CASE(6)
#ifdef __AVX512F__
    TANDEM_SCORE_CASE(7)
    TANDEM_SCORE_CASE(8)
    TANDEM_SCORE_CASE(9)
    TANDEM_SCORE_CASE(10)
    TANDEM_SCORE_CASE(11)
    TANDEM_SCORE_CASE(12)
#endif
#undef TANDEM_SCORE_CASE
  }
}

// acc[r][0, C * kLanesN) = acc[r] * rescale[r] + sum over keys j of w[r][j] * v[j], for R rows.
template <int R, int C>
void value_tile(const float* w, int64_t w_stride, const float* v, int64_t v_stride, int64_t keys, float* acc,
                int64_t acc_stride, const float* rescale) {
  VecN o[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) o[r][c] = loadN(acc + r * acc_stride + c * kLanesN) * rescale[r];
  }
  for (int64_t j = 0; j < keys; ++j) {
    VecN vj[C];
    for (int c = 0; c < C; ++c) vj[c] = loadN(v + j * v_stride + c * kLanesN);
    for (int r = 0; r < R; ++r) {
      const VecN wb = splatN(w[r * w_stride + j]);
      for (int c = 0; c < C; ++c) o[r][c] += wb * vj[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) storeN(acc + r * acc_stride + c * kLanesN, o[r][c]);
  }
}

template <int R>
void value_rows(const float* w, int64_t w_stride, const float* v, int64_t head_dim, int64_t keys, float* acc,
                const float* rescale) {
  for (int64_t c0 = 0; c0 < head_dim; c0 += kValueVectors * kLanesN) {
    const float* vc = v + c0;
    float* ac = acc + c0;
    switch ((std::min<int64_t>(head_dim - c0, kValueVectors * kLanesN)) / kLanesN) {
      case 1: value_tile<R, 1>(w, w_stride, vc, head_dim, keys, ac, head_dim, rescale); break;
      case 2: value_tile<R, 2>(w, w_stride, vc, head_dim, keys, ac, head_dim, rescale); break;
      case 3: value_tile<R, 3>(w, w_stride, vc, head_dim, keys, ac, head_dim, rescale); break;
      default: value_tile<R, 4>(w, w_stride, vc, head_dim, keys, ac, head_dim, rescale); break;
    }
  }
}

// Value sums of `rows` (<= kRows) rows over `keys` keys, kValueRows rows at a time.
void value_block(int rows, const float* w, int64_t w_stride, const float* v, int64_t head_dim, int64_t keys,
                 float* acc, const float* rescale) {
  int r = 0;
  for (; r + kValueRows <= rows; r += kValueRows) {
    value_rows<kValueRows>(w + r * w_stride, w_stride, v, head_dim, keys, acc + r * head_dim, rescale + r);
  }
  for (; r < rows; ++r) value_rows<1>(w + r * w_stride, w_stride, v, head_dim, keys, acc + r * head_dim, rescale + r);
}

// One online-softmax step for one row over the first `width` scores of a tile, in place
// (the row's weights on return); the row sees the first `visible` of them (clamped to
// [0, width]). Keeps the row's running max and sum and returns the factor its earlier
// output must be scaled by. In the first tile every row sees key 0; later a row may see
// none of a tile.
float softmax_row(float* s, int64_t width, int64_t visible, bool first_tile, float& row_max, float& row_sum) {
  const int64_t n = std::min(std::max<int64_t>(visible, 0), width);
  std::fill(s + n, s + width, 0.f);
  if (n == 0) return 1.f;
  const float top = tandem_cpu::max_of(s, n, first_tile ? s[0] : row_max);
  const float sum = tandem_cpu::exp_shifted_sum(s, n, top);
  // No exp(-inf) for a first tile: -ffast-math assumes there are no infinities.
  const float rescale = first_tile ? 0.f : std::exp(row_max - top);
  row_sum = (first_tile ? 0.f : row_sum * rescale) + sum;
  row_max = top;
  return rescale;
}

// A task's output: row r * group + g of acc ([rows, head_dim] float sums) divided by its
// softmax sum, into query head head * group + g of token r of o (the task's first token).
template <typename T>
void write_task_rows(const float* acc, const float* row_sum, int64_t tokens, int64_t group, int64_t head,
                     int64_t head_dim, T* o, int64_t o_row, int64_t o_head) {
  for (int64_t r = 0; r < tokens; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = r * group + g;
      const float inv = 1.f / row_sum[i];
      T* dst = o + r * o_row + (head * group + g) * o_head;
      for (int64_t d = 0; d < head_dim; d += kLanes16) store_row(dst + d, load16(acc + i * head_dim + d) * inv);
    }
  }
}

// bfloat16 on CPUs with AMX or AVX512-BF16: the same walk (a task per KV head and block of
// query tokens, its query heads stacked into rows, key tiles with an online softmax), with
// both products by a bfloat16 GEMM (torch's batch-reduce GEMM, at::native::cpublas::brgemm,
// oneDNN's AMX kernels; without AMX dot_gemm below): the scores of all the task's rows
// against a tile of kPairTileKeys keys, then the tile's values weighted by the rows'
// probabilities (rounded to bfloat16, as the GEMM takes them) added into float sums. Keys
// and values are first copied out of their blocks into the GEMM's pair-interleaved (VNNI)
// layout, a tile at a time: the keys as the [D, kPairTileKeys] matrix (key pairs of dims
// side by side), the values as the [kPairTileKeys, D] one (dims of key pairs side by
// side), zero past the last key. A tile of 256 keys: per layer of the small preset at 512
// tokens (AMX Xeon), 64-key tiles took 1.37 ms, 128 1.33 and 256 1.01 (fewer GEMM calls);
// with the softmax in two fused passes, 0.92 against SDPA's 1.07 (and, after a 1,536-token
// prefix, ~5.0 against 5.5 ms for SDPA over the gathered context and a mask). A task's last
// tile is multiplied only as far as the task's last row sees, in steps of kPairTileStep
// keys (at 512 tokens a third of the products were of keys no row sees; the op ~5% faster).
constexpr int64_t kPairTileKeys = 256;
constexpr int64_t kPairTileStep = 64;

using Pair = uint32_t;  // two bfloat16s side by side

// Keys [0, num_keys) of one KV head: tile t's pair row d2 holds dims 2 d2, 2 d2 + 1 of its
// kPairTileKeys keys. Sixteen keys and sixteen pairs at a time, transposed in registers
// (pairs as 32-bit lanes; a head dim's last pairs short of sixteen one by one).
void pack_keys_vnni(const HeadRows<c10::BFloat16>& keys, Pair* tiles) {
  const int64_t num_keys = keys.num_keys, pairs = keys.head_dim / 2, tile_size = pairs * kPairTileKeys;
  const int64_t num_tiles = (num_keys + kPairTileKeys - 1) / kPairTileKeys;
  std::memset(tiles + (num_tiles - 1) * tile_size, 0, tile_size * sizeof(Pair));
  const Pair* key_rows[kLanes16];
  for (int64_t t0 = 0; t0 < num_keys; t0 += kLanes16) {
    keys.prefetch_ahead(t0, kLanes16);
    const int64_t n = std::min<int64_t>(kLanes16, num_keys - t0);
    for (int64_t j = 0; j < n; ++j) key_rows[j] = reinterpret_cast<const Pair*>(keys.row(t0 + j));
    Pair* dst = tiles + (t0 / kPairTileKeys) * tile_size + t0 % kPairTileKeys;
    int64_t p0 = 0;
    for (; p0 + kLanes16 <= pairs; p0 += kLanes16) {
      const auto dim_pairs = [&](int64_t j) { return load16(reinterpret_cast<const float*>(key_rows[j] + p0)); };
      store_transposed16(n, dim_pairs, reinterpret_cast<float*>(dst + p0 * kPairTileKeys), kPairTileKeys);
    }
    for (; p0 < pairs; ++p0) {
      for (int64_t j = 0; j < n; ++j) dst[p0 * kPairTileKeys + j] = key_rows[j][p0];
    }
  }
}

// Values [0, num_keys) of one KV head: tile t's row j2 holds, per dim, keys 2 j2 and 2 j2 + 1
// (the even key's bfloat16 in a pair's low half), sixteen dims at a time.
void pack_values_vnni(const HeadRows<c10::BFloat16>& values, c10::BFloat16* tiles) {
  using tandem_cpu::Bf16x16;
  using tandem_cpu::Bits16;
  const int64_t num_keys = values.num_keys, head_dim = values.head_dim, tile_size = kPairTileKeys * head_dim;
  const int64_t num_tiles = (num_keys + kPairTileKeys - 1) / kPairTileKeys;
  std::memset(static_cast<void*>(tiles + (num_tiles - 1) * tile_size), 0, tile_size * sizeof(c10::BFloat16));
  for (int64_t t = 0; t < num_keys; t += 2) {
    if (t % kLanes16 == 0) values.prefetch_ahead(t, kLanes16);
    const c10::BFloat16* even = values.row(t);
    const c10::BFloat16* odd = t + 1 < num_keys ? values.row(t + 1) : nullptr;
    c10::BFloat16* dst = tiles + (t / kPairTileKeys) * tile_size + (t % kPairTileKeys / 2) * 2 * head_dim;
    for (int64_t d = 0; d < head_dim; d += kLanes16) {
      Bf16x16 low, high = {};
      std::memcpy(&low, even + d, sizeof(low));
      if (odd != nullptr) std::memcpy(&high, odd + d, sizeof(high));
      const Bits16 pairs = __builtin_convertvector(low, Bits16) | (__builtin_convertvector(high, Bits16) << 16);
      std::memcpy(static_cast<void*>(dst + 2 * d), &pairs, sizeof(pairs));
    }
  }
}

// 16 softmax weights in [0, 1] as bfloat16 (rounded to nearest even), by AVX512-BF16's
// conversion where there is one (all AMX CPUs have it; it flushes subnormals to zero, which
// weights under 1.2e-38 beside a row's largest weight of 1 are, to the sum, anyway).
inline void store_weights(c10::BFloat16* w, Vec16 e) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), (__m256i)_mm512_cvtneps_pbh(__builtin_bit_cast(__m512, e)));
#else
  tandem_cpu::store_bf16(w, e);
#endif
}

// softmax_row for one row of a key tile's raw scores s (before the scale), in two passes:
// the visible scores' max, then their weights e^(scale (s - max)) summed in float and
// written as bfloat16 into w, zeros for the rest of the tile.
float softmax_row_bf16(const float* s, int64_t visible, bool first_tile, float scale, float& row_max,
                       float& row_sum, c10::BFloat16* w) {
  const int64_t n = std::min(std::max<int64_t>(visible, 0), kPairTileKeys);
  int64_t j = 0;
  if (n == 0) {
    for (; j < kPairTileKeys; j += kLanes16) store_weights(w + j, Vec16{});
    return 1.f;
  }
  const float top = scale * tandem_cpu::max_of(s, n, s[0]);
  const float new_max = first_tile ? top : std::max(top, row_max);
  const Ints16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Vec16 sums = Vec16{};
  for (; j < n; j += kLanes16) {
    Vec16 e = tandem_cpu::exp16(load16(s + j) * scale - new_max);
    e = lanes < static_cast<int32_t>(n - j) ? e : Vec16{};
    sums += e;
    store_weights(w + j, e);
  }
  for (; j < kPairTileKeys; j += kLanes16) store_weights(w + j, Vec16{});
  // No exp(-inf) for a first tile: -ffast-math assumes there are no infinities.
  const float rescale = first_tile ? 0.f : std::exp(row_max - new_max);
  row_sum = (first_tile ? 0.f : row_sum * rescale) + tandem_cpu::horizontal_sum16(sums);
  row_max = new_max;
  return rescale;
}

#ifdef __AVX512BF16__
// Without AMX, with AVX512-BF16: c[m, n] (+ c[m, n] where add_c) = sum over k of a[m, k] *
// b[k, n] for m < rows, n < cols (a multiple of 16), k < depth (even): a bfloat16 rows lda
// apart, b in pairs of k ([depth / 2, ldb, 2], the GEMM's VNNI layout), c float rows ldc
// apart; what cpublas::brgemm computes for prefill_bf16 with AMX. Register tiles of up to
// kDotRows rows by 4 vectors (64 columns): per pair of k one broadcast of a's pair and a
// VDPBF16PS per row and vector.
constexpr int kDotRows = 6;  // 6 x 4 sums, 4 vectors of b and a broadcast: 29 of 32 registers
// Chunks that see at most this many keys take the float32 walk instead: over 12 layers of
// the small preset's heads (AMD EPYC, 2 threads, interleaved) 16 tokens took 0.26-0.29 ms
// by the float32 walk and 0.39-0.69 by this one, 64 and 128 about level; 512 tokens 22-35
// against 21, 512 after 1,536 cached 210 against 124, 64 after 512 11.3 against 8.2.
constexpr int64_t kDotWalkMinKeys = 128;

template <int R, int V>
void dot_tile(int64_t depth, int64_t lda, int64_t ldb, int64_t ldc, bool add_c, const c10::BFloat16* a,
              const c10::BFloat16* b, float* c) {
  __m512 sums[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) sums[r][v] = add_c ? _mm512_loadu_ps(c + r * ldc + v * kLanes16) : _mm512_setzero_ps();
  }
  for (int64_t k2 = 0; k2 < depth / 2; ++k2) {
    __m512bh cols[V];
    for (int v = 0; v < V; ++v) cols[v] = (__m512bh)_mm512_loadu_si512(b + (k2 * ldb + v * kLanes16) * 2);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * k2, sizeof(pair));
      const __m512bh as = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], cols[v], as);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(c + r * ldc + v * kLanes16, sums[r][v]);
  }
}

using DotTile = void (*)(int64_t, int64_t, int64_t, int64_t, bool, const c10::BFloat16*, const c10::BFloat16*,
                         float*);

template <int V, int... R>
constexpr std::array<DotTile, sizeof...(R) + 1> dot_tiles_by_rows(std::integer_sequence<int, R...>) {
  return {nullptr, &dot_tile<R + 1, V>...};
}

// kDotTiles[v][r]: the tile of r rows and v vectors.
constexpr std::array<DotTile, kDotRows + 1> kDotTiles[5] = {
    {}, dot_tiles_by_rows<1>(std::make_integer_sequence<int, kDotRows>{}),
    dot_tiles_by_rows<2>(std::make_integer_sequence<int, kDotRows>{}),
    dot_tiles_by_rows<3>(std::make_integer_sequence<int, kDotRows>{}),
    dot_tiles_by_rows<4>(std::make_integer_sequence<int, kDotRows>{})};

void dot_gemm(int64_t rows, int64_t cols, int64_t depth, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
              const c10::BFloat16* a, const c10::BFloat16* b, float* c) {
  for (int64_t n0 = 0; n0 < cols; n0 += 4 * kLanes16) {
    const int64_t v = std::min<int64_t>(4, (cols - n0) / kLanes16);
    for (int64_t m0 = 0; m0 < rows; m0 += kDotRows) {
      const int64_t r = std::min<int64_t>(kDotRows, rows - m0);
      kDotTiles[v][r](depth, lda, ldb, ldc, add_c, a + m0 * lda, b + n0 * 2, c + m0 * ldc + n0);
    }
  }
}
#endif

// The GEMM prefill_bf16 multiplies by (cpublas::brgemm's arguments).
using PairGemm = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const c10::BFloat16*,
                          const c10::BFloat16*, float*);

void amx_brgemm(int64_t rows, int64_t cols, int64_t depth, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                const c10::BFloat16* a, const c10::BFloat16* b, float* c) {
  at::native::cpublas::brgemm(rows, cols, depth, lda, ldb, ldc, add_c, a, b, c);
}

void prefill_bf16(const at::Tensor& query, const at::Tensor& kv_cache, const int64_t* table, int64_t context_len,
                  float scale, PairGemm gemm, at::Tensor& out) {
  using c10::BFloat16;
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / kv_heads, num_keys = context_len + tokens;
  const BFloat16* k_cache = kv_cache.data_ptr<BFloat16>();
  const BFloat16* v_cache = k_cache + num_blocks * block_size * kv_heads * head_dim;
  const int64_t num_tiles = (num_keys + kPairTileKeys - 1) / kPairTileKeys, tile_size = kPairTileKeys * head_dim;
  // Scratch left uninitialized: every element read is written first.
  std::unique_ptr<Pair[]> keys(new Pair[kv_heads * num_tiles * tile_size / 2]);
  std::unique_ptr<BFloat16[]> values(new BFloat16[kv_heads * num_tiles * tile_size]);
  copy_heads(
      kv_heads,
      [&](int64_t head) {
        pack_keys_vnni({k_cache, table, block_size, kv_heads, head, head_dim, num_keys},
                       keys.get() + head * num_tiles * tile_size / 2);
      },
      [&](int64_t head) {
        pack_values_vnni({v_cache, table, block_size, kv_heads, head, head_dim, num_keys},
                         values.get() + head * num_tiles * tile_size);
      });
  const int64_t query_blocks = (tokens + kQueryTokens - 1) / kQueryTokens;
  const int64_t max_rows = group * std::min(kQueryTokens, tokens);
  const BFloat16* q = query.data_ptr<BFloat16>();
  BFloat16* o = out.data_ptr<BFloat16>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  at::parallel_for(0, kv_heads * query_blocks, 1, [&](int64_t begin, int64_t end) {
    std::optional<tandem_cpu::BrgemmScope> brgemm_scope;  // AMX's tile state, released at the end
    if (gemm == &amx_brgemm) brgemm_scope.emplace();
    std::unique_ptr<BFloat16[]> q_rows(new BFloat16[max_rows * head_dim]);
    std::unique_ptr<BFloat16[]> weights(new BFloat16[max_rows * kPairTileKeys]);
    std::unique_ptr<float[]> acc(new float[max_rows * head_dim]), scores(new float[max_rows * kPairTileKeys]);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / query_blocks, t0 = (task % query_blocks) * kQueryTokens;
      const int64_t n = std::min(kQueryTokens, tokens - t0), rows = group * n;
      const BFloat16* key_tiles = reinterpret_cast<const BFloat16*>(keys.get() + head * num_tiles * tile_size / 2);
      const BFloat16* value_tiles = values.get() + head * num_tiles * tile_size;
      // Row r * group + g: query head head * group + g of token t0 + r.
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          std::memcpy(static_cast<void*>(q_rows.get() + (r * group + g) * head_dim),
                      q + (t0 + r) * q_row + (head * group + g) * q_head, head_dim * sizeof(BFloat16));
        }
      }
      std::fill(acc.get(), acc.get() + rows * head_dim, 0.f);
      const int64_t keys_seen = context_len + t0 + n;  // the last key any row may see, plus one
      for (int64_t k0 = 0; k0 < keys_seen; k0 += kPairTileKeys) {
        // The last tile only as far as the task's last row sees (in steps of kPairTileStep).
        const int64_t keys =
            std::min(kPairTileKeys, (keys_seen - k0 + kPairTileStep - 1) / kPairTileStep * kPairTileStep);
        gemm(rows, keys, head_dim, head_dim, kPairTileKeys, kPairTileKeys, false, q_rows.get(),
             key_tiles + (k0 / kPairTileKeys) * tile_size, scores.get());
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t visible = context_len + t0 + i / group + 1 - k0;
          const float rescale = softmax_row_bf16(scores.get() + i * kPairTileKeys, visible, k0 == 0, scale, row_max[i],
                                                 row_sum[i], weights.get() + i * kPairTileKeys);
          float* a = acc.get() + i * head_dim;
          if (rescale != 1.f) {
            for (int64_t d = 0; d < head_dim; d += kLanes16) store16(a + d, load16(a + d) * rescale);
          }
        }
        gemm(rows, head_dim, keys, kPairTileKeys, head_dim, head_dim, true, weights.get(),
             value_tiles + (k0 / kPairTileKeys) * tile_size, acc.get());
      }
      write_task_rows(acc.get(), row_sum.data(), n, group, head, head_dim, o + t0 * o_row, o_row, o_head);
    }
  });
}

// The float32 walk (the file's head comment) over float32 or bfloat16 K/V: bfloat16 keys,
// values and queries become floats as they are copied into the task's panels and rows, and
// the output is rounded to bfloat16 as it is written. With AMX or AVX512-BF16 bfloat16
// goes through prefill_bf16 instead.
template <typename T>
void prefill_tiles(const at::Tensor& query, const at::Tensor& kv_cache, const int64_t* table, int64_t context_len,
                   float scale, at::Tensor& out) {
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t num_keys = context_len + tokens;
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + num_blocks * block_size * kv_heads * head_dim;
  const int64_t num_panels = (num_keys + kLanes16 - 1) / kLanes16;
  const int64_t panels_size = num_panels * kLanes16 * head_dim, values_size = num_keys * head_dim;
  // Scratch left uninitialized: every element read is written first.
  std::unique_ptr<float[]> keys_packed(new float[kv_heads * panels_size]), values(new float[kv_heads * values_size]);
  copy_heads(
      kv_heads,
      [&](int64_t head) {
        pack_keys(HeadRows<T>{k_cache, table, block_size, kv_heads, head, head_dim, num_keys},
                  keys_packed.get() + head * panels_size);
      },
      [&](int64_t head) {
        copy_values(HeadRows<T>{v_cache, table, block_size, kv_heads, head, head_dim, num_keys},
                    values.get() + head * values_size);
      });

  const int64_t group = num_heads / kv_heads;
  const int64_t query_blocks = (tokens + kQueryTokens - 1) / kQueryTokens;
  const int64_t max_rows = group * std::min(kQueryTokens, tokens);
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  at::parallel_for(0, kv_heads * query_blocks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> q_rows(new float[max_rows * head_dim]), acc(new float[max_rows * head_dim]);
    std::unique_ptr<float[]> scores(new float[kRows * kKeyTile]);
    std::vector<float> row_max(max_rows), row_sum(max_rows), rescale(kRows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / query_blocks, t0 = (task % query_blocks) * kQueryTokens;
      const int64_t n = std::min(kQueryTokens, tokens - t0), rows = group * n;
      const float* panels = keys_packed.get() + head * panels_size;
      const float* v = values.get() + head * values_size;
      // Row r * group + g: query head head * group + g of token t0 + r, scaled.
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const T* src = q + (t0 + r) * q_row + (head * group + g) * q_head;
          float* dst = q_rows.get() + (r * group + g) * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
        }
      }
      std::fill(acc.get(), acc.get() + rows * head_dim, 0.f);
      // The last key any row of this task may see.
      const int64_t keys_seen = context_len + t0 + n;
      for (int64_t k0 = 0; k0 < keys_seen; k0 += kKeyTile) {
        const int64_t keys = std::min(kKeyTile, keys_seen - k0);
        for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
          const int block_rows = static_cast<int>(std::min<int64_t>(kRows, rows - i0));
          // Keys of this tile that row i sees: its token's position + 1, minus k0.
          auto visible = [&](int64_t i) { return context_len + t0 + i / group + 1 - k0; };
          const int64_t width = std::min(std::max<int64_t>(visible(i0 + block_rows - 1), 0), keys);
          if (width == 0) continue;  // no row of the block sees this tile: nothing changes
          const int64_t panels_seen = (width + kLanes16 - 1) / kLanes16;
          score_block(block_rows, q_rows.get() + i0 * head_dim, head_dim,
                      panels + (k0 / kLanes16) * head_dim * kLanes16, panels_seen, scores.get(), kKeyTile);
          for (int r = 0; r < block_rows; ++r) {
            rescale[r] = softmax_row(scores.get() + r * kKeyTile, width, visible(i0 + r), k0 == 0, row_max[i0 + r],
                                     row_sum[i0 + r]);
          }
          value_block(block_rows, scores.get(), kKeyTile, v + k0 * head_dim, head_dim, width,
                      acc.get() + i0 * head_dim, rescale.data());
        }
      }
      write_task_rows(acc.get(), row_sum.data(), n, group, head, head_dim, o + t0 * o_row, o_row, o_head);
    }
  });
}

}  // namespace

namespace tandem_cpu {

// query [T, Hq, D] (token rows may be strided, D contiguous, D a multiple of 16),
// kv_cache [2, blocks, block_size, Hkv, D] contiguous with the chunk's K/V written,
// block_table [>= blocks for context_len + T positions] int64; query token i sits at
// position context_len + i. Writes the attention output into out [T, Hq, D] (D contiguous).
void paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                   int64_t context_len, double scale, at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && block_table.device().is_cpu(),
              "paged_prefill: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv_cache.dim() == 5, "paged_prefill: bad ranks");
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && kv_cache.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "paged_prefill: float32 or bfloat16 query, kv_cache and out of one dtype expected");
  TORCH_CHECK(kv_cache.is_contiguous() && query.stride(2) == 1 && out.stride(2) == 1,
              "paged_prefill: a contiguous kv_cache and contiguous head dims expected");
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % kv_heads == 0 && kv_cache.size(4) == head_dim && out.sizes() == query.sizes(),
              "paged_prefill: bad shapes");
  TORCH_CHECK(head_dim % kLanes16 == 0, "paged_prefill: head dims that are multiples of ", kLanes16,
              " only, got ", head_dim);
  const int64_t num_keys = context_len + tokens;
  TORCH_CHECK(context_len >= 0 && block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.numel() * block_size >= num_keys,
              "paged_prefill: a contiguous int64 block table covering ", num_keys, " positions expected");
  if (tokens == 0) return;
  const int64_t* table = block_table.data_ptr<int64_t>();
  if (dtype == at::kBFloat16 && amx_gemm()) {
    prefill_bf16(query, kv_cache, table, context_len, static_cast<float>(scale), &amx_brgemm, out);
#ifdef __AVX512BF16__
  } else if (dtype == at::kBFloat16 && num_keys > kDotWalkMinKeys) {
    prefill_bf16(query, kv_cache, table, context_len, static_cast<float>(scale), &dot_gemm, out);
#endif
  } else if (dtype == at::kBFloat16) {
    prefill_tiles<c10::BFloat16>(query, kv_cache, table, context_len, static_cast<float>(scale), out);
  } else {
    prefill_tiles<float>(query, kv_cache, table, context_len, static_cast<float>(scale), out);
  }
}

}  // namespace tandem_cpu
