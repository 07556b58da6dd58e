// The decoder stack of a decode-only CPU step in one call. It runs the same torch ops, in
// the same order, as engine/model/llama.py's forward with the cpu attention backend (so
// the same numbers, bit for bit), without the Python interpreter between them: a decode
// step issues ~1,300 small ops, and at batch 1 their Python dispatch cost a third as much
// as the step's matmuls. Registered as torch.ops.tandem_cpu.decode_forward; built by
// loader.py; called by engine/model/cpu_decode.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace {

// Per layer, in this order: input norm, qkv, o, post-attention norm, gate_up, down.
constexpr int64_t kWeightsPerLayer = 6;

// RMSNorm in float32 as llama.py's RMSNorm computes it on CPU.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& size,
                    const at::Tensor& eps) {
  at::Tensor variance = x.pow(2).sum(-1, /*keepdim=*/true).div_(size).add_(eps);
  return (x * variance.rsqrt_()).mul_(weight);
}

// llama.py's `Linear`: the small-batch kernel for 2..max_small_rows rows, else F.linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  int64_t max_small_rows) {
  const int64_t rows = x.size(0);
  if (rows >= 2 && rows <= max_small_rows) return tandem_cpu::small_batch_linear(x, weight, bias);
  return at::linear(x, weight, bias);
}

// hidden [T, H] (the step's embeddings, T decodes), weights (kWeightsPerLayer per layer),
// qkv_biases (none, or one per layer), final_norm [H], norm_size and norm_eps (float32
// 0-dim), cos and signed sin [T, 1, D], kv_caches [layers, 2, blocks, block_size, Hkv, D],
// slot_mapping [T] int64, block_tables [T, width] and seq_lens [T] int32. Writes each
// layer's K/V into its cache; returns the final normalized hidden states [T, H].
at::Tensor decode_forward(const at::Tensor& embeddings, at::TensorList weights, at::TensorList qkv_biases,
                          const at::Tensor& final_norm, const at::Tensor& norm_size,
                          const at::Tensor& norm_eps, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& kv_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                          int64_t num_heads, int64_t num_kv_heads, int64_t max_small_rows) {
  const int64_t num_layers = kv_caches.size(0);
  TORCH_CHECK(embeddings.dim() == 2 && kv_caches.dim() == 6, "decode_forward: bad ranks");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer,
              "decode_forward: ", kWeightsPerLayer, " weights per layer expected");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decode_forward: no qkv bias or one per layer");
  const int64_t tokens = embeddings.size(0), head_dim = kv_caches.size(5);
  const int64_t heads = num_heads + num_kv_heads;
  const int64_t q_size = num_heads * head_dim, qk_size = heads * head_dim;
  TORCH_CHECK(kv_caches.size(4) == num_kv_heads && head_dim % 2 == 0, "decode_forward: bad kv cache shape");
  at::Tensor hidden = embeddings;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const c10::optional<at::Tensor> qkv_bias =
        qkv_biases.empty() ? c10::nullopt : c10::optional<at::Tensor>(qkv_biases[layer]);
    // Attention: fused QKV, RoPE on queries and keys in place, K/V into the cache, paged attention.
    at::Tensor qkv = linear(rms_norm(hidden, w[0], norm_size, norm_eps), w[1], qkv_bias, max_small_rows);
    at::Tensor qk = qkv.slice(1, 0, qk_size).view({tokens, heads, head_dim});
    at::Tensor swapped =
        qk.view({tokens, heads, 2, head_dim / 2}).flip({2}).view({tokens, heads, head_dim}).mul_(sin);
    qk.mul_(cos).add_(swapped);
    at::Tensor query = qk.slice(1, 0, num_heads);
    at::Tensor key = qk.slice(1, num_heads);
    at::Tensor value = qkv.slice(1, qk_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor kv_cache = kv_caches[layer];
    kv_cache[0].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, key);
    kv_cache[1].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, value);
    at::Tensor attention = at::empty({tokens, num_heads, head_dim}, hidden.options());
    tandem_cpu::paged_decode(query, kv_cache, block_tables, seq_lens, scale, attention);
    hidden = linear(attention.view({tokens, q_size}), w[2], c10::nullopt, max_small_rows).add_(hidden);
    // MLP: fused gate/up, SiLU(gate) * up, down; the residual added into the output.
    at::Tensor gate_up =
        linear(rms_norm(hidden, w[3], norm_size, norm_eps), w[4], c10::nullopt, max_small_rows);
    const int64_t intermediate = gate_up.size(1) / 2;
    at::Tensor act = at::silu(gate_up.slice(1, 0, intermediate)).mul_(gate_up.slice(1, intermediate));
    hidden = linear(act, w[5], c10::nullopt, max_small_rows).add_(hidden);
  }
  return rms_norm(hidden, final_norm, norm_size, norm_eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "decode_forward(Tensor embeddings, Tensor[] weights, Tensor[] qkv_biases, Tensor final_norm, "
      "Tensor norm_size, Tensor norm_eps, Tensor cos, Tensor sin, Tensor(a!) kv_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, int num_heads, "
      "int num_kv_heads, int max_small_rows) -> Tensor");
  m.impl("decode_forward", c10::DispatchKey::CPU, TORCH_FN(decode_forward));
}
