// Tandem's C++ CPU ops (one extension, built by loader.py): every op's entry point, which
// register_ops.cpp registers as torch.ops.tandem_cpu.<name> and the ops call in each
// other's files, and the 16-float vector helpers the kernels share. Only ATen's tensor
// type is included (the build defines TORCH_ASSERT_ONLY_METHOD_OPERATORS): ATen.h's
// every-op headers took ~9 s of each file's ~13 s compile.
#pragma once
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace tandem_cpu {

// out[i] = attention of query[i] over its first seq_lens[i] cached positions (paged_decode.cpp).
void paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, at::Tensor out);

// Causal attention of a prefill chunk's queries over the cached prefix and the chunk
// (paged_prefill.cpp).
void paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                   int64_t context_len, double scale, at::Tensor out);

// Whether torch's batch-reduce GEMM (at::native::cpublas::brgemm) has a bfloat16 kernel
// for this CPU (AMX): asked once per process (packed_linear.cpp).
bool amx_gemm();

// Whether pack_linear_weight and packed_linear take bfloat16 here: on CPUs with AMX (by
// torch's batch-reduce GEMM) or AVX512-BF16 (by the op's own kernel) (packed_linear.cpp).
bool packs_bfloat16();

// The AMX tile state that torch's batch-reduce GEMM (at::native::cpublas::brgemm) takes
// on the calling thread, released when a BrgemmScope ends: by return or by an exception
// (packed_linear.cpp). One per parallel task that calls brgemm.
void release_brgemm_tiles();
struct BrgemmScope {
  BrgemmScope() = default;
  BrgemmScope(const BrgemmScope&) = delete;
  BrgemmScope& operator=(const BrgemmScope&) = delete;
  ~BrgemmScope() { release_brgemm_tiles(); }
};

// A float32 or bfloat16 weight [n, k] in packed_linear's column panels (packed_linear.cpp).
at::Tensor pack_linear_weight(const at::Tensor& weight);

// x @ weight.T (+ bias) in x's dtype (float32 or bfloat16), the weight [n, k] given packed,
// plus residual [rows, n] where given (the product rounded first, as `.add_(residual)` after
// it would; a layer's residual add in the kernel's last step) (packed_linear.cpp).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual);

// RMSNorm of float32 or bfloat16 rows x [T, H] (contiguous rows) times weight [H] (elementwise.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// SiLU(gate) * up of float32 or bfloat16 rows gate_up [T, 2I] as a new [T, I] (elementwise.cpp).
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// Whether packed_silu_and_mul takes this packed gate_up weight [2I, k] (packed_linear.cpp).
bool fuses_silu_and_mul(const at::Tensor& packed_gate_up, int64_t intermediate);

// silu_and_mul(packed_linear(x, packed_gate_up, 2I)) bit for bit, without the [T, 2I]
// product in memory: where fuses_silu_and_mul says so (packed_linear.cpp).
at::Tensor packed_silu_and_mul(const at::Tensor& x, const at::Tensor& packed_gate_up, int64_t intermediate);

// RoPE in place on the first num_heads heads of each float32 or bfloat16 row of qkv by cos
// and signed sin [T, 1, D] (elementwise.cpp).
void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t num_heads, int64_t head_dim);

// Per row of float32 or bfloat16 logits [rows, vocab], the first index of its maximum
// (greedy_argmax.cpp).
at::Tensor greedy_argmax(const at::Tensor& logits);

// Each token's key and value [tokens, kv_heads, head_dim] (heads contiguous, token rows
// may be strided) into its slot of kv_cache [2, blocks, block_size, kv_heads, head_dim]:
// the torch backend's index_copy_, a row copy per token (decoder_stack.cpp).
void cache_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping);

// A step's decoder stack (its decodes, then its prefill chunks); returns the final
// normalized hidden states (decoder_stack.cpp).
at::Tensor decoder_stack(const at::Tensor& embedding_table, int64_t vocab_size, at::IntArrayRef token_ids,
                         const at::Tensor& rope_table, at::IntArrayRef positions, at::TensorList weights,
                         at::TensorList qkv_biases, const at::Tensor& final_norm, double norm_eps,
                         const at::Tensor& kv_caches, at::IntArrayRef slots, at::IntArrayRef decode_block_tables,
                         int64_t decode_table_width, at::IntArrayRef decode_seq_lens,
                         at::TensorList prefill_block_tables, at::IntArrayRef prefill_starts,
                         at::IntArrayRef prefill_lens, at::IntArrayRef prefill_context_lens, double scale,
                         int64_t num_heads, int64_t num_kv_heads);

// 16-float vectors (GCC vector extensions: one AVX-512 register, two AVX2 registers).
constexpr int kLanes16 = 16;
typedef float Vec16 __attribute__((vector_size(kLanes16 * sizeof(float))));
typedef int32_t Ints16 __attribute__((vector_size(kLanes16 * sizeof(int32_t))));

// A float vector type V's lanes from p, to p, and all set to x.
template <typename V>
inline V load_lanes(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void store_lanes(float* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

inline Vec16 load16(const float* p) { return load_lanes<Vec16>(p); }
inline void store16(float* p, Vec16 v) { store_lanes(p, v); }
inline Vec16 splat16(float x) { return Vec16{} + x; }

// The widest float vector one register holds (16 floats with AVX-512, else 8), for the
// register-blocked tile kernels: GCC keeps arrays of these in registers, where it spilled
// arrays of two-register Vec16s to the stack on AVX2 and moved them through general
// registers (float32 prefill attention, AMD EPYC with AVX2: 43 ms per layer at 512 tokens
// against SDPA's 18).
#ifdef __AVX512F__
constexpr int kLanesN = 16;
#else
constexpr int kLanesN = 8;
#endif
typedef float VecN __attribute__((vector_size(kLanesN * sizeof(float))));

inline VecN loadN(const float* p) { return load_lanes<VecN>(p); }
inline void storeN(float* p, VecN v) { store_lanes(p, v); }
inline VecN splatN(float x) { return VecN{} + x; }

// Two-source lane picks that pair up blocks of w = 8, 4, 2, 1 lanes (round 0-3): with a
// the first source and b the second, kBlockPairs[round] takes a's first w lanes of every
// 2w and b's first w, side by side; adding w to it takes the second halves instead.
constexpr Ints16 kBlockPairs[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                   {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                                   {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                   {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};

// A 16 x 16 matrix's rows r become its columns: four rounds (w = 8, 4, 2, 1), each
// swapping the off-diagonal w x w blocks of every 2w x 2w block on the diagonal, two rows
// at a time by one two-source permute per row. Fully unrolled, so the rows stay in
// registers. Bits are moved, not computed: a bfloat16 pair bit-cast to a float goes
// through unchanged.
inline void transpose16x16(Vec16 (&r)[kLanes16]) {
#pragma GCC unroll 4
  for (int round = 0; round < 4; ++round) {
    const int w = 8 >> round;
    const Ints16 first_halves = kBlockPairs[round], second_halves = kBlockPairs[round] + w;
#pragma GCC unroll 16
    for (int i = 0; i < kLanes16; ++i) {
      if (i & w) continue;  // row i + w is the lower of the pair
      const Vec16 upper = r[i], lower = r[i + w];
      r[i] = __builtin_shuffle(upper, lower, first_halves);
      r[i + w] = __builtin_shuffle(upper, lower, second_halves);
    }
  }
}

// 16 bfloat16s as floats (exact), and floats to bfloat16 rounded to nearest even as
// torch's casts round (a NaN becomes torch's 0x7fc0); `round_bf16_16` does both.
typedef uint16_t Bf16x16 __attribute__((vector_size(kLanes16 * sizeof(uint16_t))));
typedef uint32_t Bits16 __attribute__((vector_size(kLanes16 * sizeof(uint32_t))));

// With AVX-512 the widening and narrowing are one instruction each (vpmovzxwd, vpmovdw);
// GCC 12 compiled the generic vector conversions to two 256-bit halves and a merge
// (bfloat16 RoPE over 32 rows, one thread: 26.6 -> 21-22.7 us).
inline Vec16 load_bf16(const c10::BFloat16* p) {
#ifdef __AVX512F__
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return __builtin_bit_cast(Vec16, _mm512_slli_epi32(wide, 16));
#else
  Bf16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const Bits16 bits = __builtin_convertvector(h, Bits16) << 16;
  return __builtin_bit_cast(Vec16, bits);
#endif
}

inline Bits16 bf16_bits(Vec16 v) {
  const Bits16 u = __builtin_bit_cast(Bits16, v);
  const Bits16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? Bits16{} + 0x7fc0u : rounded;
}

inline void store_bf16(c10::BFloat16* p, Vec16 v) {
#ifdef __AVX512F__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(__builtin_bit_cast(__m512i, bf16_bits(v))));
#else
  const Bf16x16 h = __builtin_convertvector(bf16_bits(v), Bf16x16);
  std::memcpy(p, &h, sizeof(h));
#endif
}

inline Vec16 round_bf16_16(Vec16 v) {
  const Bits16 bits = bf16_bits(v) << 16;
  return __builtin_bit_cast(Vec16, bits);
}

// One register of bfloat16s as floats (exact).
#ifdef __AVX512F__
inline VecN load_bf16N(const c10::BFloat16* p) { return load_bf16(p); }
#else
inline VecN load_bf16N(const c10::BFloat16* p) {
  typedef uint16_t Bf16xN __attribute__((vector_size(kLanesN * sizeof(uint16_t))));
  typedef uint32_t BitsN __attribute__((vector_size(kLanesN * sizeof(uint32_t))));
  Bf16xN h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_bit_cast(VecN, __builtin_convertvector(h, BitsN) << 16);
}
#endif

// One register's worth of a float32 or bfloat16 row as floats.
inline VecN load_rowN(const float* p) { return loadN(p); }
inline VecN load_rowN(const c10::BFloat16* p) { return load_bf16N(p); }

// 16 elements of a float32 or bfloat16 row as floats, and back (bfloat16 rounded to
// nearest even): the kernels written once for both dtypes read and write through these.
inline Vec16 load_row(const float* p) { return load16(p); }
inline Vec16 load_row(const c10::BFloat16* p) { return load_bf16(p); }
inline void store_row(float* p, Vec16 v) { store16(p, v); }
inline void store_row(c10::BFloat16* p, Vec16 v) { store_bf16(p, v); }

// The first n (<= 16) floats at p, the other lanes `fill`; and the way back. With AVX-512
// one masked load or store (never touching memory past n). A memcpy of a runtime length
// compiled to `rep movs`, whose start-up cost was a third of decode attention's value sums
// (perf, AMD EPYC), which call these for every block's 16 weights.
#ifdef __AVX512F__
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline Vec16 load_partial16(const float* p, int64_t n, float fill) {
  return __builtin_bit_cast(Vec16, _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(n), p));
}

inline void store_partial16(float* p, Vec16 v, int64_t n) {
  _mm512_mask_storeu_ps(p, first_lanes(n), __builtin_bit_cast(__m512, v));
}

inline VecN load_partialN(const float* p, int64_t n, float fill) { return load_partial16(p, n, fill); }
inline void store_partialN(float* p, VecN v, int64_t n) { store_partial16(p, v, n); }
#else
// The first n (<= the vector's lanes) floats at p into a V of `fill`s, and back.
template <typename V>
inline V load_partial(const float* p, int64_t n, float fill) {
  V v = V{} + fill;
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

template <typename V>
inline void store_partial(float* p, V v, int64_t n) {
  std::memcpy(p, &v, n * sizeof(float));
}

inline Vec16 load_partial16(const float* p, int64_t n, float fill) {
  return n == kLanes16 ? load16(p) : load_partial<Vec16>(p, n, fill);
}

inline void store_partial16(float* p, Vec16 v, int64_t n) {
  if (n == kLanes16) return store16(p, v);
  store_partial(p, v, n);
}

inline VecN load_partialN(const float* p, int64_t n, float fill) {
  return n == kLanesN ? loadN(p) : load_partial<VecN>(p, n, fill);
}

inline void store_partialN(float* p, VecN v, int64_t n) {
  if (n == kLanesN) return storeN(p, v);
  store_partial(p, v, n);
}
#endif

// The integers nearest y (ties away from zero, or to even with AVX-512), as floats; and
// p * 2^k for integer-valued k in [-126, 127]. With AVX-512 one instruction each
// (vrndscaleps, vscalefps), otherwise an add, two conversions, and an exponent built in
// integer lanes, for a float vector V and the int32 vector I of its lanes.
template <typename V, typename I>
inline V nearest_integer_lanes(V y) {
  const I k = __builtin_convertvector(y + (y < V{} ? V{} - 0.5f : V{} + 0.5f), I);
  return __builtin_convertvector(k, V);
}

template <typename V, typename I>
inline V times_power_of_two_lanes(V p, V k) {
  const I two_to_k = (__builtin_convertvector(k, I) + 127) << 23;  // 2^k's float bits
  return p * __builtin_bit_cast(V, two_to_k);
}

#ifdef __AVX512F__
inline Vec16 nearest_integer(Vec16 y) {
  return __builtin_bit_cast(Vec16, _mm512_roundscale_ps(__builtin_bit_cast(__m512, y),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vec16 times_power_of_two(Vec16 p, Vec16 k) {
  return __builtin_bit_cast(Vec16, _mm512_scalef_ps(__builtin_bit_cast(__m512, p), __builtin_bit_cast(__m512, k)));
}
#else
typedef int32_t IntsN __attribute__((vector_size(kLanesN * sizeof(int32_t))));
inline Vec16 nearest_integer(Vec16 y) { return nearest_integer_lanes<Vec16, Ints16>(y); }
inline Vec16 times_power_of_two(Vec16 p, Vec16 k) { return times_power_of_two_lanes<Vec16, Ints16>(p, k); }
inline VecN nearest_integer(VecN y) { return nearest_integer_lanes<VecN, IntsN>(y); }
inline VecN times_power_of_two(VecN p, VecN k) { return times_power_of_two_lanes<VecN, IntsN>(p, k); }
#endif

// e^x of a float vector (Vec16 or VecN): 2^k * e^r with k the integer nearest x / ln 2 and
// |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 6 (relative error under 2e-7,
// about glibc's). x is clamped to [-87, 88] first, where the results are normal floats:
// below, e^x is under 1.7e-38 and becomes that; above, it would overflow. No table, no
// branch, no special case: about a third of the instructions of glibc's vector exp. (The
// AVX-512 rounding and scaling made bfloat16 prefill attention ~7% faster.)
template <typename V>
inline V exp_lanes(V x) {
  x = x < V{} - 87.f ? V{} - 87.f : x;
  x = x > V{} + 88.f ? V{} + 88.f : x;
  const V kf = nearest_integer(x * 1.44269504088896341f);
  // ln 2 in two parts (the first exact in 11 bits) so that k * ln 2 loses nothing.
  const V r = (x - kf * 0.693145751953125f) - kf * 1.42860682030941723e-6f;
  V p = V{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return times_power_of_two(p, kf);
}

inline Vec16 exp16(Vec16 x) { return exp_lanes(x); }

// SiLU(g) = g / (1 + e^-g). With AVX-512 the division is an approximate reciprocal
// (14 bits) refined by one Newton step (within about an ulp of the quotient): a division
// of 16 floats takes ~16 cycles of its own unit, and bfloat16 SiLU-and-multiply over a
// 512-token prefill's 512 x 2048 (AMX Xeon, 2 threads) took 0.52 ms with it, 0.35 with this.
inline Vec16 silu16(Vec16 g) {
  const Vec16 d = 1.f + exp16(-g);
#ifdef __AVX512F__
  const Vec16 r = __builtin_bit_cast(Vec16, _mm512_rcp14_ps(__builtin_bit_cast(__m512, d)));
  return g * (r * (2.f - d * r));
#else
  return g / d;
#endif
}

// SiLU(gate) * up for bfloat16 gate and up (as floats), rounded where the torch ops round:
// SiLU to bfloat16, then the product (the caller's store rounds it).
inline Vec16 silu_times_bf16(Vec16 gate, Vec16 up) { return round_bf16_16(silu16(gate)) * up; }

template <typename V>
inline float horizontal_sum(V v) {
  float sum = 0.f;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) sum += v[i];
  return sum;
}

inline float horizontal_sum16(Vec16 v) { return horizontal_sum(v); }

// The largest of init and s[0..n), one register of floats at a time.
inline float max_of(const float* s, int64_t n, float init) {
  VecN top = splatN(init);
  int64_t i = 0;
  for (; i + kLanesN <= n; i += kLanesN) {
    const VecN v = loadN(s + i);
    top = v > top ? v : top;
  }
  if (i < n) {
    const VecN v = load_partialN(s + i, n - i, init);
    top = v > top ? v : top;
  }
  float m = top[0];
  for (int j = 1; j < kLanesN; ++j) m = top[j] > m ? top[j] : m;
  return m;
}

// Softmax's middle step: s[i] = e^(s[i] - top) for i < n (top >= every s[i]); returns
// their sum. One register of floats at a time.
inline float exp_shifted_sum(float* s, int64_t n, float top) {
  VecN sum = VecN{};
  int64_t i = 0;
  for (; i + kLanesN <= n; i += kLanesN) {
    const VecN e = exp_lanes(loadN(s + i) - top);
    storeN(s + i, e);
    sum += e;
  }
  if (i < n) {
    // Lanes past n start at top - 100: their e^-100 clamps to 1.7e-38 each, nothing
    // beside a sum of terms that the caller will divide by.
    const VecN e = exp_lanes(load_partialN(s + i, n - i, top - 100.f) - top);
    store_partialN(s + i, e, n - i);
    sum += e;
  }
  return horizontal_sum(sum);
}

}  // namespace tandem_cpu
