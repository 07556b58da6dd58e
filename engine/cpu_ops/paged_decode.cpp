// Paged decode attention for CPU: reads K/V in place from the paged cache through the
// block tables (no gather, no padding), GQA by handling a KV head's query heads together.
// Tasks spread over torch's own thread pool (at::parallel_for). float32 and bfloat16
// caches with head_dim 64 or 128 take a path with the head dim fixed at compile time that
// walks each sequence's blocks once for all its heads, the query heads' value sums in vector
// registers (16-float vectors) across a block; other dtypes and sizes take the generic
// loops, one task per (sequence, KV head).
// Registered as torch.ops.tandem_cpu.paged_decode; built by cpu_ops/loader.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

using tandem_cpu::horizontal_sum;
using tandem_cpu::Ints16;
using tandem_cpu::kLanes16;
using tandem_cpu::kLanesN;
using tandem_cpu::load16;
using tandem_cpu::load_row;
using tandem_cpu::load_rowN;
using tandem_cpu::loadN;
using tandem_cpu::storeN;
using tandem_cpu::VecN;
using tandem_cpu::store16;
using tandem_cpu::store_row;
using tandem_cpu::Vec16;

// The vector path: float32 and bfloat16 caches (computing in float32), head_dim D. One
// task per (sequence, range of KV heads): all of a sequence's heads when there are enough
// sequences to keep every thread busy, fewer (down to one) per task otherwise. Block by
// block, each head of the task scores its query heads against the block's keys (a vector
// of partial sums per key, QueryHead; 16 keys' vectors folded into 16 scores at once, 8
// on AVX2, fold), then, after one softmax per query head, sums the block's values into
// D / kLanesN register accumulators per query head, up to 4 query heads per read of a value
// row (add_weighted_values; in bfloat16 with AVX512-BF16 two keys per dot-product
// instruction, add_weighted_value_pairs). A 12-layer batch-32 pass of the small preset
// (context 131-150, from memory) took 5.6 ms in bfloat16 before these, 3.8 with the
// scores' changes, 2.95 with the value pairs (batch 8: 1.15, 0.70, 0.67 ms); float32
// stays at the memory's pace (~5.5 ms). Going block by block through all the task's
// heads reads each block's rows whole: one head at a time over the whole context read a
// quarter of every 1 KiB row (4 KV heads), too sparse for the hardware prefetchers, and
// long contexts ran at a third of the memory bandwidth. While a block's keys are scored,
// its values and the next block's keys are asked for ahead (SpreadPrefetch); while a task
// sums its values, the next task's first keys (BlocksPrefetch).

// One query head, ready to score keys: dot(k) is a vector whose lanes sum to the head's
// score for key k before post_scale. float32 (and bfloat16 without AVX512-BF16): the row
// times the scale as floats, D / kLanesN multiply-adds per key in one-register vectors
// (two-register Vec16s, on AVX2, went through the stack: float32 decode attention took
// 3.5x the memory's pace there).
template <int D, typename T>
struct QueryHead {
  static constexpr int kVectors = D / kLanesN;
  static constexpr float post_scale = 1.f;
  VecN row[kVectors];
  QueryHead(const T* q, float scale) {
    for (int c = 0; c < kVectors; ++c) row[c] = load_rowN(q + c * kLanesN) * scale;
  }
  VecN dot(const T* k) const {
    VecN sum = row[0] * load_rowN(k);
    for (int c = 1; c < kVectors; ++c) sum += row[c] * load_rowN(k + c * kLanesN);
    return sum;
  }
};

#ifdef __AVX512BF16__
// bfloat16 with AVX512-BF16: the row stays bfloat16 and each key takes D / 32 dot-product
// instructions on bfloat16 pairs (exact products summed in float32; converting the key to
// floats took more instructions than the multiplies); the scale comes after the sum.
template <int D>
struct QueryHead<D, c10::BFloat16> {
  static constexpr int kPairVectors = D / (2 * kLanes16);
  __m512bh row[kPairVectors];
  float post_scale;
  QueryHead(const c10::BFloat16* q, float scale) : post_scale(scale) {
    for (int c = 0; c < kPairVectors; ++c) row[c] = (__m512bh)_mm512_loadu_si512(q + c * 2 * kLanes16);
  }
  Vec16 dot(const c10::BFloat16* k) const {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < kPairVectors; ++c) {
      sum = _mm512_dpbf16_ps(sum, row[c], (__m512bh)_mm512_loadu_si512(k + c * 2 * kLanes16));
    }
    return __builtin_bit_cast(Vec16, sum);
  }
};
#endif

// Keys scored together: their dot vectors folded into one vector of scores (fold).
constexpr int kFoldKeys = kLanesN;

#ifdef __AVX512F__
// Lane i of the result = the sum of v[i]'s lanes. Four rounds; each pairs up the vectors,
// two lane shuffles and an add per pair putting half of each one's partial sums side by
// side (16 -> 8 -> 4 -> 2 -> 1 vectors), then one shuffle undoes the rounds' bit-reversed
// lane order: 46 instructions where 16 horizontal sums take 128.
inline Vec16 fold(Vec16 (&v)[kLanes16]) {
  using tandem_cpu::kBlockPairs;
  for (int round = 0, count = kLanes16; round < 4; ++round, count /= 2) {
    const Ints16 hi = kBlockPairs[round] + (8 >> round);
    for (int i = 0; i < count / 2; ++i) {
      v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], kBlockPairs[round]) +
             __builtin_shuffle(v[2 * i], v[2 * i + 1], hi);
    }
  }
  return __builtin_shuffle(v[0], Ints16{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}
#else
// The same for eight 8-float registers (AVX2): two rounds of horizontal adds leave each
// vector's two 128-bit halves' sums side by side, and one cross-half add finishes them.
inline VecN fold(VecN (&v)[kLanesN]) {
  const auto hadd = [](VecN a, VecN b) {
    return __builtin_bit_cast(VecN, _mm256_hadd_ps(__builtin_bit_cast(__m256, a), __builtin_bit_cast(__m256, b)));
  };
  const VecN first = hadd(hadd(v[0], v[1]), hadd(v[2], v[3]));
  const VecN second = hadd(hadd(v[4], v[5]), hadd(v[6], v[7]));
  const __m256 a = __builtin_bit_cast(__m256, first), b = __builtin_bit_cast(__m256, second);
  return __builtin_bit_cast(VecN, _mm256_permute2f128_ps(a, b, 0x20)) +
         __builtin_bit_cast(VecN, _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// Query heads of one KV head whose value sums stay in registers together while each of
// the block's value rows is read (and, in bfloat16, converted) once for all of them: up to
// half the vector registers as accumulators (16 of AVX-512's 32, 8 of AVX2's 16).
#ifdef __AVX512F__
constexpr int kAccumulators = 16;
#else
constexpr int kAccumulators = 8;
#endif
template <int D>
constexpr int kHeadsPerValueRead = std::max(1, std::min(4, kAccumulators / (D / kLanesN)));

// acc[g, :] += sum over the block's n keys j of p[g * p_stride + j] * values[j * stride, :]
// for the G query heads g of one KV head (values: the block's first row for that head).
template <int D, typename T, int G>
void add_weighted_values(const T* values, int64_t stride, int64_t n, const float* p, int64_t p_stride,
                         float* acc) {
  constexpr int kVectors = D / kLanesN;
  VecN sums[G][kVectors];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < kVectors; ++c) sums[g][c] = loadN(acc + g * D + c * kLanesN);
  }
  for (int64_t j = 0; j < n; ++j) {
    VecN v[kVectors];
    for (int c = 0; c < kVectors; ++c) v[c] = load_rowN(values + j * stride + c * kLanesN);
    for (int g = 0; g < G; ++g) {
      const float weight = p[g * p_stride + j];
      for (int c = 0; c < kVectors; ++c) sums[g][c] += weight * v[c];
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < kVectors; ++c) storeN(acc + g * D + c * kLanesN, sums[g][c]);
  }
}

// Whether a value sum's lanes hold its dims in add_weighted_value_pairs's order.
template <typename T>
constexpr bool kValueLanesPaired = false;

#ifdef __AVX512BF16__
template <>
constexpr bool kValueLanesPaired<c10::BFloat16> = true;

// add_weighted_values for bfloat16 values with AVX512-BF16: two keys at a time, by
// dot-product instructions on (key j, key j + 1) pairs: the two value rows interleaved
// dim by dim (16-bit unpacks), the two weights rounded to bfloat16 side by side (as a
// bfloat16 GEMM takes them). Per key and query head about half the instructions of
// converting each value to floats. The unpacks leave a 32-dim half's dims 0-3, 8-11,
// 16-19, 24-27 in one sum vector and 4-7, 12-15, ... in the next: acc keeps that order
// (in_dim_order puts it back).
template <int D, int G>
void add_weighted_value_pairs(const c10::BFloat16* values, int64_t stride, int64_t n, const float* p,
                              int64_t p_stride, float* acc) {
  constexpr int kHalves = D / (2 * kLanes16);  // 32 dims: one 64-byte load per key
  __m512 sums[G][2 * kHalves];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < 2 * kHalves; ++c) sums[g][c] = _mm512_loadu_ps(acc + g * D + c * kLanes16);
  }
  for (int64_t j0 = 0; j0 < n; j0 += kLanes16) {
    const int64_t keys = std::min<int64_t>(kLanes16, n - j0);
    uint32_t weight_pairs[G][kLanes16 / 2];  // zero weights past the last key
    for (int g = 0; g < G; ++g) {
      const Vec16 w = tandem_cpu::load_partial16(p + g * p_stride + j0, keys, 0.f);
      const __m256bh pairs = _mm512_cvtneps_pbh(__builtin_bit_cast(__m512, w));
      std::memcpy(weight_pairs[g], &pairs, sizeof(pairs));
    }
    for (int64_t j = 0; j < keys; j += 2) {
      const c10::BFloat16* row = values + (j0 + j) * stride;
      __m512i lo[kHalves], hi[kHalves];
      for (int h = 0; h < kHalves; ++h) {
        const __m512i a = _mm512_loadu_si512(row + h * 2 * kLanes16);
        // An odd key count's last key pairs with zeros (never the memory past it).
        const __m512i b = j + 1 < keys ? _mm512_loadu_si512(row + stride + h * 2 * kLanes16) : _mm512_setzero_si512();
        lo[h] = _mm512_unpacklo_epi16(a, b);
        hi[h] = _mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[g][j / 2]));
        for (int h = 0; h < kHalves; ++h) {
          sums[g][2 * h] = _mm512_dpbf16_ps(sums[g][2 * h], (__m512bh)lo[h], w);
          sums[g][2 * h + 1] = _mm512_dpbf16_ps(sums[g][2 * h + 1], (__m512bh)hi[h], w);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < 2 * kHalves; ++c) _mm512_storeu_ps(acc + g * D + c * kLanes16, sums[g][c]);
  }
}
#endif

// kAddWeightedValues<D, T>[g]: the value sums for g query heads (1 .. 4).
template <int D, typename T>
constexpr void (*kAddWeightedValues[5])(const T*, int64_t, int64_t, const float*, int64_t, float*) = {
    nullptr, &add_weighted_values<D, T, 1>, &add_weighted_values<D, T, 2>, &add_weighted_values<D, T, 3>,
    &add_weighted_values<D, T, 4>};

#ifdef __AVX512BF16__
template <int D>
constexpr void (*kAddWeightedValues<D, c10::BFloat16>[5])(const c10::BFloat16*, int64_t, int64_t, const float*,
                                                           int64_t, float*) = {
    nullptr, &add_weighted_value_pairs<D, 1>, &add_weighted_value_pairs<D, 2>, &add_weighted_value_pairs<D, 3>,
    &add_weighted_value_pairs<D, 4>};
#endif

// Vectors c and c + 1 (c even) of a value sum in dim order (they hold 32 dims; in
// add_weighted_value_pairs's lane order where kValueLanesPaired).
template <typename T>
inline void in_dim_order(Vec16& first, Vec16& second) {
  if (!kValueLanesPaired<T>) return;
  const Vec16 lo = first, hi = second;
  first = __builtin_shuffle(lo, hi, Ints16{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23});
  second = __builtin_shuffle(lo, hi, Ints16{8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31});
}

// A span of memory requested into cache ahead of its reads in equal shares of cache
// lines, one share per `next()`, so that the requests overlap the kernel's arithmetic: a
// core has few buffers for outstanding misses, and a burst of a whole 8 KiB block's
// prefetches stalled on them (half the kernel's time, by perf). Scoring a block asks for
// the block's values (summed after the softmax) and the next block's keys this way. The
// hardware prefetchers alone stop at each 4 KiB page (a block is 8-16 KiB, a used pool's
// blocks scattered): a batch-32 12-layer pass (context 131-150, from memory, two threads,
// side by side) over shuffled blocks took 4.6 ms in bfloat16 and 6.5 in float32 without
// these requests, 2.6 and 4.3 with them (float32 at ~25 GB/s, the machine's copy
// bandwidth); over blocks in order 4.4-4.9 and 6.5-6.7 ms without, 3.4-3.5 and 5.2-5.4 with.
// (Those on an AMX Xeon, requests into L1.) The requests go into L2 (T1 hint): on an AMD
// EPYC (Zen 4) requests into L1 stalled the kernel (perf: a quarter of its time on the
// prefetch instructions); the same pass there took 3.8-4.5 ms in
// bfloat16 and 7.2-7.4 in float32 with them, 2.6-3.1 and 4.9-5.2 with requests into L2
// (interleaved runs), 3.9-4.0 with L2 requests all at once.
class SpreadPrefetch {
 public:
  SpreadPrefetch(const void* begin, int64_t bytes, int64_t shares)
      : at_(static_cast<const char*>(begin)), end_(at_ + bytes),
        share_(std::max<int64_t>(1, (bytes / kLine + shares - 1) / shares) * kLine) {}
  void next() {
    for (const char* stop = std::min(at_ + share_, end_); at_ < stop; at_ += kLine) _mm_prefetch(at_, _MM_HINT_T1);
  }

 private:
  static constexpr int64_t kLine = 64;
  const char* at_;
  const char* end_;
  int64_t share_;
};

// Whole blocks of the cache (every KV head's rows), the first `blocks` of a block table,
// requested into L2 in equal shares of cache lines, one share per `next()`. While a task
// sums its values (from L2: asked for while it scored) the memory would sit idle, so it
// asks for the next task's first keys (up to kKeysAheadBytes; that task then asks only for
// the blocks past them while it scores). On the AMD EPYC a 12-layer batch-32 pass (as
// SpreadPrefetch's) took 1.85-1.96 against 2.1-2.7 ms in bfloat16 and 4.9-5.1 against
// 5.1-5.5 in float32; batch 8 over 48 layers (past L3) 2.2-2.5 against 2.7-2.8 and 4.9-5.0
// against 5.3-5.5 (interleaved runs).
class BlocksPrefetch {
 public:
  BlocksPrefetch() = default;
  BlocksPrefetch(const void* cache, const int32_t* table, int64_t blocks, int64_t block_bytes, int64_t shares)
      : cache_(static_cast<const char*>(cache)), table_(table), blocks_(blocks), block_bytes_(block_bytes),
        share_(std::max<int64_t>(1, (blocks * block_bytes / kLine + shares - 1) / std::max<int64_t>(1, shares))) {}
  void next() {
    for (int64_t i = 0; i < share_ && block_ < blocks_; ++i) {
      _mm_prefetch(cache_ + table_[block_] * block_bytes_ + offset_, _MM_HINT_T1);
      offset_ += kLine;
      if (offset_ >= block_bytes_) {
        ++block_;
        offset_ = 0;
      }
    }
  }

 private:
  static constexpr int64_t kLine = 64;
  const char* cache_ = nullptr;
  const int32_t* table_ = nullptr;
  int64_t blocks_ = 0, block_bytes_ = 0, share_ = 0, block_ = 0, offset_ = 0;
};

// How much of the next task's keys a task asks for while it sums its values.
constexpr int64_t kKeysAheadBytes = 128 * 1024;

// Keys per partition of a long context, about: a context longer than this is split into
// partitions of equal whole blocks, each a task over all KV heads whose results are merged
// (the flash-decoding split). Split by KV heads instead, a task read a quarter of each
// block row (4 KV heads), and a lone 8,000-token context ran at a third of the memory
// bandwidth. The split depends only on the context's length, so a sequence's attention
// comes out the same whatever batch and thread count it runs in.
constexpr int64_t kPartitionKeys = 512;

// One task: query row `row`'s KV heads [first_head, end_head) over context positions
// [first_key, end_key); partial: its slot among a split context's partitions, or -1 (it
// writes the row's output itself).
struct DecodeTask {
  int64_t row, first_head, end_head, first_key, end_key, partial;
  bool whole_blocks(int64_t kv_heads) const { return first_head == 0 && end_head == kv_heads; }
};

// A split context: its partitions' slots [first_partial, end_partial).
struct SplitRow {
  int64_t row, first_partial, end_partial;
};

struct DecodePlan {
  std::vector<DecodeTask> tasks;  // in the rows' order
  std::vector<SplitRow> split_rows;
  int64_t num_partials = 0;
};

// The vector path's tasks. A context over kPartitionKeys: partitions of equal whole blocks.
// Any other: one task over all its KV heads, or, where the batch has too few rows to give
// each thread two tasks, ranges of KV heads (down to one).
DecodePlan plan_decode(const int32_t* lens, int64_t rows, int64_t kv_heads, int64_t block_size, int64_t threads) {
  DecodePlan plan;
  const int64_t head_splits = std::min<int64_t>(kv_heads, std::max<int64_t>(1, (2 * threads + rows - 1) / rows));
  const int64_t heads_per_task = (kv_heads + head_splits - 1) / head_splits;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens[r];
    if (len <= kPartitionKeys) {
      for (int64_t h = 0; h < kv_heads; h += heads_per_task) {
        plan.tasks.push_back({r, h, std::min(kv_heads, h + heads_per_task), 0, len, -1});
      }
      continue;
    }
    const int64_t blocks = (len + block_size - 1) / block_size;
    const int64_t parts = (len + kPartitionKeys - 1) / kPartitionKeys;
    const int64_t part_keys = (blocks + parts - 1) / parts * block_size;
    const int64_t first_partial = plan.num_partials;
    for (int64_t k = 0; k < len; k += part_keys) {
      plan.tasks.push_back({r, 0, kv_heads, k, std::min(len, k + part_keys), plan.num_partials++});
    }
    plan.split_rows.push_back({r, first_partial, plan.num_partials});
  }
  return plan;
}

// One query head's output: its value sum acc (D floats, in the value sums' lane order)
// times scale, into out (D elements of T).
template <int D, typename T>
void store_head(const float* acc, float scale, T* out) {
  for (int c = 0; c < D / kLanes16; c += 2) {
    Vec16 first = load16(acc + c * kLanes16);
    Vec16 second = load16(acc + (c + 1) * kLanes16);
    in_dim_order<T>(first, second);
    store_row(out + c * kLanes16, first * scale);
    store_row(out + (c + 1) * kLanes16, second * scale);
  }
}

template <int D, typename T>
void decode_vectors(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t rows = query.size(0), num_heads = query.size(1);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3), group = num_heads / kv_heads;
  const int64_t width = block_tables.size(1);
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const T* q = query.data_ptr<T>();
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + num_blocks * block_size * kv_heads * D;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t token_stride = kv_heads * D;
  const float sc = static_cast<float>(scale);
  const int64_t threads = at::get_num_threads();
  const DecodePlan plan = plan_decode(lens, rows, kv_heads, block_size, threads);
  const int64_t num_tasks = static_cast<int64_t>(plan.tasks.size());
  // Per partition of a split context: each query head's score maximum, its sum of
  // e^(score - maximum), and its value sum weighted so (in the value sums' lane order).
  std::vector<float> partial_top(plan.num_partials * num_heads), partial_total(plan.num_partials * num_heads);
  std::vector<float> partial_accs(plan.num_partials * num_heads * D);
  // Threads claim tasks one at a time from a shared counter, so a thread that drew short
  // sequences takes more of them. The model runner lays decodes out longest first, and a
  // fixed split gave the first thread all the long ones: 32 contexts of 50-1000, 12 layers
  // (AMD EPYC, 2 threads, interleaved) took 12.0-12.2 ms in bfloat16 and 24.7-25.0 in
  // float32 split so, 8.6-9.4 and 16.7-18.8 claimed; contexts of 131-150 level.
  std::atomic<int64_t> next_unclaimed{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, accs, top, total;
    int64_t keys_requested = 0;  // this task's first blocks whose keys the task before asked for
    for (int64_t index = next_unclaimed.fetch_add(1), following; index < num_tasks; index = following) {
      const DecodeTask& task = plan.tasks[index];
      const int64_t row = task.row, h0 = task.first_head, h1 = task.end_head;
      const int64_t k0 = task.first_key, k1 = task.end_key, len = k1 - k0;
      const int64_t q0 = h0 * group, nq = (h1 - h0) * group;
      const int32_t* table = tables + row * width;
      scores.resize(nq * len);
      accs.assign(nq * D, 0.f);
      top.resize(nq);
      total.resize(nq);
      float* s = scores.data();
      for (int64_t t0 = k0; t0 < k1; t0 += block_size) {
        const T* block = k_cache + table[t0 / block_size] * block_size * token_stride;
        const int64_t n = std::min(block_size, k1 - t0), next_n = std::min(block_size, k1 - t0 - n);
        const int64_t shares = (h1 - h0) * group;
        SpreadPrefetch values(v_cache + table[t0 / block_size] * block_size * token_stride,
                              n * token_stride * sizeof(T), shares);
        const bool next_requested = (t0 - k0) / block_size + 1 < keys_requested;
        SpreadPrefetch next_keys(k_cache + (next_n > 0 ? table[t0 / block_size + 1] : 0) * block_size * token_stride,
                                 next_requested ? 0 : std::max<int64_t>(0, next_n) * token_stride * sizeof(T), shares);
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t g = 0; g < group; ++g) {
            values.next();
            next_keys.next();
            const int64_t hq = h * group + g;
            const QueryHead<D, T> query_head(q + row * q_row + hq * q_head, sc);
            const T* keys = block + h * D;
            float* sg = s + (hq - q0) * len + (t0 - k0);
            int64_t j = 0;
            for (; j + kFoldKeys <= n; j += kFoldKeys) {
              VecN dots[kFoldKeys];
              for (int i = 0; i < kFoldKeys; ++i) dots[i] = query_head.dot(keys + (j + i) * token_stride);
              storeN(sg + j, fold(dots) * query_head.post_scale);
            }
            for (; j < n; ++j) sg[j] = horizontal_sum(query_head.dot(keys + j * token_stride)) * query_head.post_scale;
          }
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* si = s + i * len;
        top[i] = tandem_cpu::max_of(si, len, si[0]);
        total[i] = tandem_cpu::exp_shifted_sum(si, len, top[i]);
      }
      // The thread's next task, claimed now so that its first blocks of keys can be asked for
      // while this one sums its values (when it takes whole blocks: all KV heads).
      following = next_unclaimed.fetch_add(1);
      BlocksPrefetch next_task_keys;
      keys_requested = 0;
      if (following < num_tasks && plan.tasks[following].whole_blocks(kv_heads)) {
        const DecodeTask& next = plan.tasks[following];
        const int64_t block_bytes = block_size * token_stride * sizeof(T);
        const int64_t blocks = std::min((next.end_key - next.first_key + block_size - 1) / block_size,
                                        std::max<int64_t>(1, kKeysAheadBytes / block_bytes));
        const int64_t value_steps = (len + block_size - 1) / block_size * (h1 - h0) *
                                    ((group + kHeadsPerValueRead<D> - 1) / kHeadsPerValueRead<D>);
        next_task_keys = BlocksPrefetch(k_cache, tables + next.row * width + next.first_key / block_size, blocks,
                                        block_bytes, value_steps);
        keys_requested = blocks;
      }
      for (int64_t t0 = k0; t0 < k1; t0 += block_size) {
        const T* block = v_cache + table[t0 / block_size] * block_size * token_stride;
        const int64_t n = std::min(block_size, k1 - t0);
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t g = 0; g < group; g += kHeadsPerValueRead<D>) {
            next_task_keys.next();
            const int64_t i = h * group + g - q0;
            const int heads = static_cast<int>(std::min<int64_t>(kHeadsPerValueRead<D>, group - g));
            kAddWeightedValues<D, T>[heads](block + h * D, token_stride, n, s + i * len + (t0 - k0), len,
                                            accs.data() + i * D);
          }
        }
      }
      if (task.partial >= 0) {  // every query head (whole blocks); merged after the tasks
        std::copy(top.begin(), top.end(), partial_top.begin() + task.partial * num_heads);
        std::copy(total.begin(), total.end(), partial_total.begin() + task.partial * num_heads);
        std::copy(accs.begin(), accs.end(), partial_accs.begin() + task.partial * num_heads * D);
        continue;
      }
      for (int64_t i = 0; i < nq; ++i) {
        store_head<D, T>(accs.data() + i * D, 1.f / total[i], o + row * o_row + (q0 + i) * o_head);
      }
    }
  });
  // A split context's partitions merged: each rescaled to the greatest of their maxima.
  float acc[D];
  for (const SplitRow& split : plan.split_rows) {
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      float top = partial_top[split.first_partial * num_heads + hq];
      for (int64_t p = split.first_partial + 1; p < split.end_partial; ++p) {
        top = std::max(top, partial_top[p * num_heads + hq]);
      }
      float total = 0.f;
      std::fill(acc, acc + D, 0.f);
      for (int64_t p = split.first_partial; p < split.end_partial; ++p) {
        const float weight = std::exp(partial_top[p * num_heads + hq] - top);
        total += weight * partial_total[p * num_heads + hq];
        const float* part = partial_accs.data() + (p * num_heads + hq) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += weight * part[d];
      }
      store_head<D, T>(acc, 1.f / total, o + split.row * o_row + hq * o_head);
    }
  }
}

template <typename T>
void decode_kernel(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3), group = num_heads / kv_heads;
  const int64_t width = block_tables.size(1);
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const T* q = query.data_ptr<T>();
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + num_blocks * block_size * kv_heads * head_dim;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t token_stride = kv_heads * head_dim;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(group * head_dim), acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      const int64_t len = lens[row];
      const int32_t* table = tables + row * width;
      scores.resize(group * len);
      float* s = scores.data();
      for (int64_t g = 0; g < group; ++g) {
        const T* qg = q + row * q_row + (head * group + g) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qs[g * head_dim + d] = static_cast<float>(qg[d]) * sc;
      }
      // Scores of the group's query heads against every key, block by block.
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* block = k_cache + table[t0 / block_size] * block_size * token_stride + head * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* k = block + j * token_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qs.data() + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
            s[g * len + t0 + j] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = s + g * len;
        const float top = tandem_cpu::max_of(sg, len, sg[0]);
        const float sum = tandem_cpu::exp_shifted_sum(sg, len, top);
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* block = v_cache + table[t0 / block_size] * block_size * token_stride + head * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* v = block + j * token_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float p = s[g * len + t0 + j];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(v[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* og = o + row * o_row + (head * group + g) * o_head;
        for (int64_t d = 0; d < head_dim; ++d) og[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

namespace tandem_cpu {

// query [rows, Hq, D] (rows may be strided, D contiguous), kv_cache [2, blocks, block_size,
// Hkv, D] contiguous, block_tables [rows, width] int32, seq_lens [rows] int32 (each >= 1);
// writes the attention output into out [rows, Hq, D] (D contiguous).
void paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv_cache.dim() == 5, "paged_decode: bad ranks");
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_decode: kv_cache must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "paged_decode: head_dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_decode: query, kv_cache and out must share a dtype");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "paged_decode: q heads not a multiple of kv heads");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && out.sizes() == query.sizes(), "paged_decode: bad shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "paged_decode: block_tables and seq_lens must be contiguous int32");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "paged_decode: one block table and length per query row");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_len = block_tables.size(1) * kv_cache.size(2);
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_len, "paged_decode: seq_lens[", i, "] = ", lens[i],
                " is outside 1..", max_len, " (the block table's positions)");
  }
  const at::ScalarType dtype = query.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && (query.size(2) == 64 || query.size(2) == 128)) {
    const bool wide = query.size(2) == 128;
    if (dtype == at::kFloat) {
      wide ? decode_vectors<128, float>(query, kv_cache, block_tables, seq_lens, scale, out)
           : decode_vectors<64, float>(query, kv_cache, block_tables, seq_lens, scale, out);
    } else {
      wide ? decode_vectors<128, c10::BFloat16>(query, kv_cache, block_tables, seq_lens, scale, out)
           : decode_vectors<64, c10::BFloat16>(query, kv_cache, block_tables, seq_lens, scale, out);
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(query, kv_cache, block_tables, seq_lens, scale, out);
  });
}

}  // namespace tandem_cpu
