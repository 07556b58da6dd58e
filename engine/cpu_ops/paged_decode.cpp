// Paged decode attention for CPU: reads K/V in place from the paged cache through the
// block tables (no gather, no padding), GQA by handling a KV head's query heads together.
// One task per (sequence, KV head), spread over torch's own thread pool (at::parallel_for).
// Registered as torch.ops.tandem_cpu.paged_decode; built by cpu_ops/loader.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

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
        float top = sg[0];
        for (int64_t t = 1; t < len; ++t) top = std::max(top, sg[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          const float e = std::exp(sg[t] - top);
          sg[t] = e;
          sum += e;
        }
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(query, kv_cache, block_tables, seq_lens, scale, out);
  });
}

}  // namespace tandem_cpu

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::paged_decode));
}
