// The schemas of torch.ops.tandem_cpu and their CPU kernels (cpu_ops.h declares them;
// each lives in the file its comment there names). The one file that includes
// torch/library.h: its headers cost ~7 s of compile, once.
#include <torch/library.h>

#include "cpu_ops.h"

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::paged_decode));
  m.def("paged_prefill(Tensor query, Tensor kv_cache, Tensor block_table, int context_len, float scale, "
        "Tensor(a!) out) -> ()");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::paged_prefill));
  m.def("packs_bfloat16() -> bool");
  m.impl("packs_bfloat16", c10::DispatchKey::CatchAll, TORCH_FN(tandem_cpu::packs_bfloat16));
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::pack_linear_weight));
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, Tensor? residual=None) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::packed_linear));
  m.def("fuses_silu_and_mul(Tensor packed_gate_up, int intermediate) -> bool");
  m.impl("fuses_silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::fuses_silu_and_mul));
  m.def("packed_silu_and_mul(Tensor x, Tensor packed_gate_up, int intermediate) -> Tensor");
  m.impl("packed_silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::packed_silu_and_mul));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::rms_norm));
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::silu_and_mul));
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.impl("rotary_embedding_", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::rotary_embedding_));
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.impl("greedy_argmax", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::greedy_argmax));
  m.def("cache_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("cache_kv", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::cache_kv));
  m.def("decoder_stack(Tensor embedding_table, int vocab_size, int[] token_ids, Tensor rope_table, int[] positions, "
        "Tensor[] weights, Tensor[] qkv_biases, Tensor final_norm, float norm_eps, Tensor(a!) kv_caches, "
        "int[] slots, int[] decode_block_tables, int decode_table_width, int[] decode_seq_lens, "
        "Tensor[] prefill_block_tables, int[] prefill_starts, int[] prefill_lens, int[] prefill_context_lens, "
        "float scale, int num_heads, int num_kv_heads) -> Tensor");
  m.impl("decoder_stack", c10::DispatchKey::CPU, TORCH_FN(tandem_cpu::decoder_stack));
}
