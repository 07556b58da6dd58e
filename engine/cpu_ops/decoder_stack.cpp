// The decoder stack of a CPU step in one call: its decodes and its prefill chunks. It
// computes what engine/model/llama.py's forward computes with the cpu attention backend
// and the cpu kernels on, with the same functions in the same order (so the same numbers,
// bit for bit), without the Python interpreter between the ops: a step issues hundreds of
// small ops, and at decode batch 1 their Python dispatch cost a third as much as the
// step's matmuls (a 16-token bfloat16 prefill: 5.4 ms beyond its 10.3 ms of matmuls).
// Registered as torch.ops.tandem_cpu.decoder_stack; built by loader.py; called by
// engine/model/cpu_stack.py. Here too: cache_kv, the K/V writes it and the cpu
// attention backend make: a row copy per token, over the threads for a prefill (512
// tokens into cold cache blocks, 12 layers: 0.56 ms bfloat16, 0.86 float32, against 1.39
// and 1.40 for index_copy_).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>

#include "cpu_ops.h"

#include <cstring>
#include <limits>

namespace {

// Per layer, in this order: input norm, qkv, o, post-attention norm, gate_up, down.
constexpr int64_t kWeightsPerLayer = 6;

// x @ weight.T (+ bias) (+ residual) as llama.py's `Linear` computes it: by packed_linear
// where the weight is packed (float32 [panels, k, panel width], bfloat16 [panels, k / 2,
// panel width, 2]), else by F.linear's op and an add. n: the output size, which a packed
// weight's shape does not carry.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  int64_t n, const c10::optional<at::Tensor>& residual = c10::nullopt) {
  if (weight.dim() >= 3) {
    // Called directly, not through the dispatcher: named for torch.profiler here.
    RECORD_FUNCTION("tandem_cpu::packed_linear", c10::ArrayRef<const c10::IValue>{});
    return tandem_cpu::packed_linear(x, weight, n, bias, residual);
  }
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == n, "decoder_stack: a weight of ", n, " rows expected");
  at::Tensor y = at::linear(x, weight, bias);
  return residual.has_value() ? y.add_(*residual) : y;
}

// k of a weight [n, k], packed or not (see linear).
int64_t in_features(const at::Tensor& weight) { return weight.dim() == 4 ? 2 * weight.size(1) : weight.size(1); }

// SiLU(x @ gate.T) * (x @ up.T) for the MLP's fused gate_up weight [2I, k]: in one pass
// where packed_silu_and_mul takes the weight, else its product and silu_and_mul.
at::Tensor gated_activation(const at::Tensor& x, const at::Tensor& gate_up, int64_t intermediate) {
  if (tandem_cpu::fuses_silu_and_mul(gate_up, intermediate)) {
    RECORD_FUNCTION("tandem_cpu::packed_silu_and_mul", c10::ArrayRef<const c10::IValue>{});
    return tandem_cpu::packed_silu_and_mul(x, gate_up, intermediate);
  }
  return tandem_cpu::silu_and_mul(linear(x, gate_up, c10::nullopt, 2 * intermediate));
}

// slots [tokens]: every slot in [0, num_slots); `op` names the caller in the error.
void check_slots(const char* op, const int64_t* slots, int64_t tokens, int64_t num_slots) {
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, op, ": slot ", slots[t], " outside the cache's ", num_slots);
  }
}

// The rows `ids` of an embedding table as a new [ids, hidden] tensor: the table [vocab,
// hidden], or a tied LM head's packed panels (float32 [panels, hidden, width], bfloat16
// [panels, hidden / 2, width, 2]), which hold the table once the model packed its tied head
// (llama.py's pack_tied_head; its last panel's columns past the vocabulary are padding).
at::Tensor embedding_rows(const at::Tensor& table, int64_t vocab_size, at::IntArrayRef ids) {
  const bool packed = (table.dim() == 3 && table.scalar_type() == at::kFloat) ||
                      (table.dim() == 4 && table.size(3) == 2 && table.scalar_type() == at::kBFloat16);
  TORCH_CHECK(table.is_contiguous() && (table.dim() == 2 || packed),
              "decoder_stack: a contiguous embedding table [vocab, hidden] or packed head expected");
  // A row is `pieces` pieces of `piece` elements: the whole row, or a packed row's columns
  // (float32) or column pairs (bfloat16), each in the next panel row.
  const int64_t element = table.element_size(), width = packed ? table.size(2) : 1;
  const int64_t piece = packed ? (table.dim() == 4 ? 2 : 1) : table.size(1);
  const int64_t pieces = packed ? table.size(1) : 1;
  TORCH_CHECK(vocab_size > 0 && vocab_size <= table.size(0) * width, "decoder_stack: a table of ", vocab_size,
              " rows expected");
  const int64_t piece_bytes = piece * element, stride = width * piece_bytes;
  const int64_t tokens = ids.size();
  at::Tensor out = at::empty({tokens, pieces * piece}, table.options());
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = ids[t];
    TORCH_CHECK(id >= 0 && id < vocab_size, "decoder_stack: token id ", id, " outside the vocabulary [0, ", vocab_size,
                ")");
    // Row id: panel id / width (pieces * stride bytes each), column id % width in it.
    const char* row = src + (id / width) * pieces * stride + (id % width) * piece_bytes;
    for (int64_t k = 0; k < pieces; ++k, dst += piece_bytes) std::memcpy(dst, row + k * stride, piece_bytes);
  }
  return out;
}

// [2, tokens, 1, head_dim]: (cos, signed sin) of each position, the rows of the model's table
// [2, max_len, 1, head_dim] (rotary.py's cos_sin).
at::Tensor rope_rows(const at::Tensor& table, at::IntArrayRef positions) {
  TORCH_CHECK(table.dim() == 4 && table.size(0) == 2 && table.size(2) == 1 && table.is_contiguous(),
              "decoder_stack: a contiguous RoPE table [2, max_len, 1, head_dim] expected");
  const int64_t max_len = table.size(1), tokens = positions.size();
  const int64_t row = table.size(3) * table.element_size();
  at::Tensor out = at::empty({2, tokens, 1, table.size(3)}, table.options());
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = positions[t];
    TORCH_CHECK(p >= 0 && p < max_len, "decoder_stack: position ", p, " outside the RoPE table's ", max_len);
    std::memcpy(dst + t * row, src + p * row, row);
    std::memcpy(dst + (tokens + t) * row, src + (max_len + p) * row, row);
  }
  return out;
}

// `values` as an int32 tensor of `shape` (paged_decode's block tables and lengths).
at::Tensor int32_tensor(at::IntArrayRef values, at::IntArrayRef shape, const char* name) {
  at::Tensor out = at::empty(shape, at::kInt);
  TORCH_CHECK(out.numel() == static_cast<int64_t>(values.size()), "decoder_stack: ", name, " of ", out.numel(),
              " values expected, got ", values.size());
  int32_t* dst = out.data_ptr<int32_t>();
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_CHECK(values[i] >= 0 && values[i] <= std::numeric_limits<int32_t>::max(), "decoder_stack: ", name,
                " value ", values[i], " outside int32's range");
    dst[i] = static_cast<int32_t>(values[i]);
  }
  return out;
}

constexpr int64_t kCacheKvTokensPerTask = 64;

// Token t's key row (slot_size bytes at k + t * k_row) and value row into slot
// slots[t] (t < tokens) of one layer's kv_cache [2, blocks, block_size, kv_heads, head_dim]
// (checked slots). Over the threads for a prefill's hundreds of tokens: the writes miss
// the cache, and one core alone keeps too few misses in flight.
void copy_into_slots(const char* k, int64_t k_row, const char* v, int64_t v_row, const int64_t* slots,
                     int64_t tokens, int64_t slot_size, const at::Tensor& kv_cache) {
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + kv_cache.size(1) * kv_cache.size(2) * slot_size;
  at::parallel_for(0, tokens, kCacheKvTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_cache + slots[t] * slot_size, k + t * k_row, slot_size);
      std::memcpy(v_cache + slots[t] * slot_size, v + t * v_row, slot_size);
    }
  });
}

}  // namespace

namespace tandem_cpu {

void cache_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(),
              "cache_kv: CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "cache_kv: a contiguous kv_cache [2, blocks, block_size, kv_heads, head_dim] expected");
  const int64_t kv_heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_heads && key.size(2) == head_dim,
              "cache_kv: key and value [tokens, ", kv_heads, ", ", head_dim, "] expected, got ", key.sizes(), " and ",
              value.sizes());
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "cache_kv: key, value and kv_cache must share a dtype");
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_dim, "cache_kv: each token's heads must be contiguous");
  }
  const int64_t tokens = key.size(0);
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong,
              "cache_kv: a contiguous int64 slot_mapping [", tokens, "] expected");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  check_slots("cache_kv", slots, tokens, kv_cache.size(1) * kv_cache.size(2));
  const int64_t element = kv_cache.element_size();
  copy_into_slots(static_cast<const char*>(key.data_ptr()), key.stride(0) * element,
                  static_cast<const char*>(value.data_ptr()), value.stride(0) * element, slots, tokens,
                  kv_heads * head_dim * element, kv_cache);
}

// A step of T tokens: token_ids and positions [T], the rows of embedding_table (vocab_size
// rows, see embedding_rows) and rope_table (rope_rows); slots [T], each token's cache slot. Its
// decodes come first (rows [0, D), D = decode_seq_lens' size; decode_block_tables: their
// tables, D rows of decode_table_width blocks, padded), then its prefill chunks (chunk i:
// rows prefill_starts[i] .. + prefill_lens[i], contiguous, in order, to T;
// prefill_context_lens[i] cached tokens before it, prefill_block_tables[i] int64).
// weights: kWeightsPerLayer per layer; qkv_biases: none, or one per layer; final_norm [H],
// norm_eps; kv_caches [layers, 2, blocks, block_size, Hkv, head_dim]. The step's lists come
// as int[] (no tensors for the caller to build). Writes each layer's K/V into its cache;
// returns the final normalized hidden states [T, H].
at::Tensor decoder_stack(const at::Tensor& embedding_table, int64_t vocab_size, at::IntArrayRef token_ids,
                         const at::Tensor& rope_table, at::IntArrayRef positions, at::TensorList weights,
                         at::TensorList qkv_biases, const at::Tensor& final_norm, double norm_eps,
                         const at::Tensor& kv_caches, at::IntArrayRef slots, at::IntArrayRef decode_block_tables,
                         int64_t decode_table_width, at::IntArrayRef decode_seq_lens,
                         at::TensorList prefill_block_tables, at::IntArrayRef prefill_starts,
                         at::IntArrayRef prefill_lens, at::IntArrayRef prefill_context_lens, double scale,
                         int64_t num_heads, int64_t num_kv_heads) {
  const int64_t num_layers = kv_caches.size(0);
  TORCH_CHECK(kv_caches.dim() == 6, "decoder_stack: bad kv cache rank");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer,
              "decoder_stack: ", kWeightsPerLayer, " weights per layer expected");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decoder_stack: no qkv bias or one per layer");
  const int64_t tokens = token_ids.size(), head_dim = kv_caches.size(5);
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == tokens && static_cast<int64_t>(slots.size()) == tokens,
              "decoder_stack: one position and one slot per token (", tokens, "), got ", positions.size(), " and ",
              slots.size());
  const int64_t heads = num_heads + num_kv_heads;
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(kv_caches.size(4) == num_kv_heads && head_dim % 2 == 0 && kv_caches.is_contiguous(),
              "decoder_stack: bad kv cache shape");
  TORCH_CHECK((embedding_table.scalar_type() == at::kFloat || embedding_table.scalar_type() == at::kBFloat16) &&
                  kv_caches.scalar_type() == embedding_table.scalar_type() &&
                  rope_table.scalar_type() == embedding_table.scalar_type() && rope_table.size(-1) == head_dim,
              "decoder_stack: float32 or bfloat16 embeddings, RoPE table and kv caches of one dtype and head dim "
              "expected");
  const int64_t num_decodes = decode_seq_lens.size();
  const at::Tensor decode_tables =
      int32_tensor(decode_block_tables, {num_decodes, decode_table_width}, "decode_block_tables");
  const at::Tensor decode_lens = int32_tensor(decode_seq_lens, {num_decodes}, "decode_seq_lens");
  // Every row's attention is written: the decodes, then the chunks back to back.
  const int64_t num_prefills = prefill_starts.size();
  TORCH_CHECK(static_cast<int64_t>(prefill_block_tables.size()) == num_prefills &&
                  static_cast<int64_t>(prefill_lens.size()) == num_prefills &&
                  static_cast<int64_t>(prefill_context_lens.size()) == num_prefills,
              "decoder_stack: one block table, length and context length per prefill chunk");
  int64_t next_row = num_decodes;
  for (int64_t i = 0; i < num_prefills; ++i) {
    TORCH_CHECK(prefill_starts[i] == next_row && prefill_lens[i] > 0 && prefill_context_lens[i] >= 0,
                "decoder_stack: prefill chunk ", i, " must start at row ", next_row, " with tokens");
    next_row += prefill_lens[i];
  }
  TORCH_CHECK(next_row == tokens, "decoder_stack: ", num_decodes, " decodes and the prefill chunks cover ",
              next_row, " of ", tokens, " rows");
  // The projections' output sizes; the down projection's input is the MLP's width.
  check_slots("decoder_stack", slots.data(), tokens, kv_caches.size(2) * kv_caches.size(3));
  at::Tensor hidden = embedding_rows(embedding_table, vocab_size, token_ids);
  const at::Tensor rope = rope_rows(rope_table, positions);
  const at::Tensor cos = rope[0], sin = rope[1];
  const int64_t hidden_size = hidden.size(1), qkv_size = (heads + num_kv_heads) * head_dim;
  // In bytes, for the K/V rows' copies (qkv's rows are contiguous).
  const int64_t element = hidden.element_size(), qkv_row = qkv_size * element;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const c10::optional<at::Tensor> qkv_bias =
        qkv_biases.empty() ? c10::nullopt : c10::optional<at::Tensor>(qkv_biases[layer]);
    // Attention: fused QKV, RoPE on queries and keys in place, K/V into the cache, paged attention.
    at::Tensor qkv = linear(tandem_cpu::rms_norm(hidden, w[0], norm_eps), w[1], qkv_bias, qkv_size);
    at::Tensor kv_cache = kv_caches[layer];
    {
      RECORD_FUNCTION("tandem_cpu::rotate_and_write_kv", c10::ArrayRef<const c10::IValue>{});
      tandem_cpu::rotary_embedding_(qkv, cos, sin, heads, head_dim);
      TORCH_CHECK(qkv.is_contiguous(), "decoder_stack: contiguous qkv rows expected");
      const char* keys = static_cast<const char*>(qkv.data_ptr()) + q_size * element;
      copy_into_slots(keys, qkv_row, keys + kv_size * element, qkv_row, slots.data(), tokens, kv_size * element,
                      kv_cache);
    }
    at::Tensor query = qkv.slice(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor attention = hidden.new_empty({tokens, num_heads, head_dim});
    for (int64_t i = 0; i < num_prefills; ++i) {
      RECORD_FUNCTION("tandem_cpu::paged_prefill", c10::ArrayRef<const c10::IValue>{});
      const int64_t end = prefill_starts[i] + prefill_lens[i];
      tandem_cpu::paged_prefill(query.slice(0, prefill_starts[i], end), kv_cache, prefill_block_tables[i],
                                prefill_context_lens[i], scale, attention.slice(0, prefill_starts[i], end));
    }
    if (num_decodes > 0) {
      RECORD_FUNCTION("tandem_cpu::paged_decode", c10::ArrayRef<const c10::IValue>{});
      tandem_cpu::paged_decode(query.slice(0, 0, num_decodes), kv_cache, decode_tables, decode_lens,
                               scale, attention.slice(0, 0, num_decodes));
    }
    hidden = linear(attention.view({tokens, q_size}), w[2], c10::nullopt, hidden_size, hidden);
    // MLP: fused gate/up, SiLU(gate) * up, down with the residual added.
    hidden = linear(gated_activation(tandem_cpu::rms_norm(hidden, w[3], norm_eps), w[4], in_features(w[5])), w[5],
                    c10::nullopt, hidden_size, hidden);
  }
  return tandem_cpu::rms_norm(hidden, final_norm, norm_eps);
}

}  // namespace tandem_cpu
