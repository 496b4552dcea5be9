// llama::update_cache.out, llama::update_cache_with_indices.out and llama::custom_sdpa.out
// for llmcore_runner (see llm_ops.h), llama::custom_quantized_sdpa.out, and llmcore's own
// llmcore::softcap_sdpa.out (custom_sdpa with soft-capped scores: Gemma 2) and
// llmcore::quantize_rows.out (an int8 cache's rows, and its queries, rounded per row).
//
// Caches of four element types (--kv-cache-dtype): float32, float16, bfloat16 and int8
// with a float scale and an int8 zero point per (position, kv head). The attention reads
// keys and values through a row reader per type (F32Rows, F16Rows, Bf16Rows, Int8Rows)
// that widens eight elements at a time to float32 in registers: the cache stays narrow in
// memory, which is what a decode step at a long context waits on, and the arithmetic is
// the float32 kernel's. Queries (and a 16-bit call's output) go through float32 buffers.
//
// Attention: each work item is one (batch, kv head, block of up to kRowBlock query rows,
// slice of the keys). It holds every query head that reads that kv head (grouped-query
// attention), so each key and value row is read from memory once per item, not once per
// query head. Keys and values go in blocks of 8 KiB that stay in L1 while each of the
// item's query rows uses them. A prompt's item (8 or more query vectors) puts its query
// vectors side by side in a register's lanes (attend_block_lanes): scores, softmax and
// weighted sums are register tiles of several queries by several keys or channels. A decode
// step's few vectors go one at a time through the scaled scores (four keys at a time) and
// a numerically stable softmax (max subtracted, a vectorised exp); the weighted sums of
// value rows take the vectors of a query row and kv head together, up to four outputs
// held in registers over a whole block (the prompt's lane_weights). Items run on
// kernel_parallel_for (kernel_threads.h: the kernels' own threads or ExecuTorch's pool). A
// decode step over fewer than 512 keys has one item per kv head; when that does not
// divide among the threads (SmolLM2's 3 kv heads on 2 threads), the keys are cut into
// slices whose softmax parts are merged after (choose_key_chunks). Over more, each item
// takes every kv head and one slice of the keys per thread, so that it reads whole
// positions of the cache, not one head's row of each (attend). The hot loops are compiled
// twice, for x86-64-v3 (AVX2 + FMA) and the baseline, and one is picked once per process by
// cpu_isa.h's kernels_isa() (LLMCORE_KERNELS_MAX_ISA=portable forces the baseline code on
// any CPU, so both are tested wherever the tests run).
#include "llm_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>

#include "cpu_isa.h"
#include "kernel_threads.h"

#if defined(__GNUC__) && defined(__x86_64__)
#define LLMCORE_X86_64_V3 1
#else
#define LLMCORE_X86_64_V3 0
#endif
// The helpers are inlined into each compilation of attend_block, so they are compiled for
// its target too.
#define LLMCORE_INLINE inline __attribute__((always_inline))
// The same for a lambda in those bodies: one GCC does not inline is compiled for the
// baseline, where the helpers' AVX asm cannot be.
#define LLMCORE_LAMBDA_INLINE __attribute__((always_inline))

namespace llmcore_kernels {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

namespace {

constexpr int64_t kRowBlock = 8;  // query rows per work item (prefill)

// A prompt's write into a cache is the first touch of those pages of the program's
// planned memory, a page fault each 4 KiB: the copy of one this large is shared among
// the threads, whose faults the kernel serves side by side (docs/performance.md, "What
// was tried": the prompt's cache writes shared among threads).
constexpr int64_t kSharedCopyBytes = 16 * 1024;

bool dense(const Tensor& t) {
  return executorch::runtime::tensor_is_default_dim_order(t) && executorch::runtime::tensor_is_contiguous(t);
}

// Eight floats as one value (GCC/Clang vector extensions): one AVX register in the
// x86-64-v3 build, two SSE registers in the baseline one. Loads and stores go through
// memcpy, so no alignment is assumed.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kVec = 8;

LLMCORE_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
LLMCORE_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
// A scalar in every lane. Written as a vector-scalar sum, which GCC compiles to one
// broadcast; the lane-by-lane initialiser became eight inserts, rebuilt inside loops.
// (x + 0 is x for every x but -0, and a -0 here only ever multiplies.)
LLMCORE_INLINE v8f splat(float x) { return v8f{} + x; }
// A float from memory in every lane. In the AVX2 compilation one vbroadcastss from memory,
// which only a load port runs; splat() of a loaded float is a load, an add of zero
// (on an FMA port) and a register broadcast (on the one shuffle port): in the lanes'
// inner loops, where each broadcast feeds one or two FMAs, those ports are the limit.
// kV3: inlined into the x86-64-v3 compilation (attend_block_v3), where AVX is there.
template <bool kV3>
LLMCORE_INLINE v8f splat_load(const float* p) {
#if LLMCORE_X86_64_V3
  if constexpr (kV3) {  // asm: an intrinsic would not inline into this untargeted helper
    v8f v;
    asm("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
    return v;
  }
#endif
  return splat(*p);
}
LLMCORE_INLINE float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// [hsum(a), hsum(b), hsum(c), hsum(d)] (each in another order of its adds), by shuffles
// of whole registers: written lane by lane, as hsum, GCC made each a chain of scalar adds
// (docs/performance.md, "What was tried": hsum4).
typedef float v4f __attribute__((vector_size(16)));
LLMCORE_INLINE v4f hsum4(v8f a, v8f b, v8f c, v8f d) {
  // [a0 + a4, .., a3 + a7, b0 + b4, .., b3 + b7], the same for c and d
  const v8f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  // pairs of those: [a, a, c, c, b, b, d, d] partial sums
  const v8f x = __builtin_shufflevector(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14) +
                __builtin_shufflevector(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(x, x, 0, 4, 2, 6) + __builtin_shufflevector(x, x, 1, 5, 3, 7);
}

// exp(x) for x <= 0 (softmax arguments after the row's max is subtracted): x = n ln2 + r
// with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (truncation error below 1e-8
// relative), 2^n built in the exponent bits. Below -87 the result is clamped at
// exp(-87) ~ 1.6e-38, negligible next to the row's largest term (1).
LLMCORE_INLINE v8f exp_nonpositive(v8f x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v8f a = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i n = __builtin_convertvector(a, v8i);  // truncates toward zero
  v8f fn = __builtin_convertvector(n, v8f);
  const v8i above = fn > a;                 // -1 where truncation rounded up: floor
  n += above;
  fn = __builtin_convertvector(n, v8f);     // n = round(x / ln2)
  v8f r = x - fn * splat(0.693145751953125f);  // ln2, high bits (exact product)
  r = r - fn * splat(1.4286068203094172e-06f); // ln2, low bits
  v8f p = splat(1.0f / 5040.0f);
  p = p * r + splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const v8i bits = (n + 127) << 23;  // n >= -126: a normal power of two
  v8f two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Row readers: row j of one kv head's keys or values, eight elements from column c
// widened to float32 (load), or one (at). Built for (batch b, kv head g) of a cache laid
// out [B, S, H_kv, D] (an int8 cache's scales and zero points [B, S, H_kv, 1]).
struct F32Rows {
  const float* p;
  int64_t stride;
  LLMCORE_INLINE v8f load(int64_t j, int64_t c) const { return load8(p + j * stride + c); }
  LLMCORE_INLINE float at(int64_t j, int64_t c) const { return p[j * stride + c]; }
};

typedef uint16_t v8u16 __attribute__((vector_size(16)));
struct Bf16Rows {  // bfloat16: the high half of a float32's bits
  const uint16_t* p;
  int64_t stride;
  LLMCORE_INLINE v8f load(int64_t j, int64_t c) const {
    v8u16 h;
    std::memcpy(&h, p + j * stride + c, sizeof(h));
    const v8i bits = __builtin_convertvector(h, v8i) << 16;
    v8f x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
  LLMCORE_INLINE float at(int64_t j, int64_t c) const {
    const uint32_t bits = static_cast<uint32_t>(p[j * stride + c]) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
};

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
// Eight IEEE halves widened with integer and float vector ops, equal bit for bit to F16C's
// vcvtph2ps (checked over all 65,536 patterns, NaNs quieted as it does): the magnitude's
// bits moved to a float's places and scaled by 2^112 (exact, subnormals included), then
// the sign, and the exponent of infinities and NaNs. Not __builtin_convertvector from a
// _Float16 vector: GCC 12 converts those one element at a time through general
// registers, which made an fp16 cache's attention 4x slower than an fp32 one's.
LLMCORE_INLINE v8f widen_halves(const void* src) {
  v8u16 bits;
  std::memcpy(&bits, src, sizeof(bits));
  const v8u32 w = __builtin_convertvector(bits, v8u32);
  const v8u32 magnitude = w & 0x7fffu, placed = magnitude << 13;
  v8f f;
  std::memcpy(&f, &placed, sizeof(f));
  f *= 0x1p112f;
  v8u32 r;
  std::memcpy(&r, &f, sizeof(r));
  r |= (w & 0x8000u) << 16;
  r |= (magnitude >= 0x7c00u) & 0x7f800000u;  // infinity or NaN: the top exponent
  r |= (magnitude > 0x7c00u) & 0x00400000u;   // NaN: quiet
  std::memcpy(&f, &r, sizeof(f));
  return f;
}

struct F16Rows {  // IEEE half
  const _Float16* p;
  int64_t stride;
  LLMCORE_INLINE v8f load(int64_t j, int64_t c) const { return widen_halves(p + j * stride + c); }
  LLMCORE_INLINE float at(int64_t j, int64_t c) const { return static_cast<float>(p[j * stride + c]); }
};

#if LLMCORE_X86_64_V3
// The same halves in the x86-64-v3 compilation: F16C's vcvtph2ps widens eight in one
// instruction, where widen_halves takes about ten (asm, as in splat_load: an intrinsic would
// not compile in this untargeted helper). Every x86-64-v3 CPU has F16C.
struct F16RowsF16c : F16Rows {
  using Base = F16Rows;
  LLMCORE_INLINE v8f load(int64_t j, int64_t c) const {
    v8f v;
    asm("vcvtph2ps %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const v8u16*>(p + j * stride + c)));
    return v;
  }
};
#endif

typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef int16_t v8i16 __attribute__((vector_size(16)));
// Eight int8 widened to float32 through int16 and int32: GCC 12 converts an int8 vector to
// floats (or to int32) in one step one element at a time through general registers, some
// forty instructions; in two steps it is two sign extensions and one conversion (a SmolLM2
// int8-cache program decoded at 72-75 tok/s before, 162-167 after; fp32's 182-184).
LLMCORE_INLINE v8f widen_int8(const void* src) {
  v8i8 q;
  std::memcpy(&q, src, sizeof(q));
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(q, v8i16), v8i), v8f);
}

struct Int8Rows {  // (q - zero_point) * scale, one scale and zero point per row
  const int8_t* p;
  int64_t stride;
  const float* scales;
  const int8_t* zero_points;
  int64_t meta_stride;  // kv heads: the scales' and zero points' stride between rows
  LLMCORE_INLINE v8f load(int64_t j, int64_t c) const {
    const v8f x = widen_int8(p + j * stride + c);
    return (x - splat(static_cast<float>(zero_points[j * meta_stride]))) * splat(scales[j * meta_stride]);
  }
  LLMCORE_INLINE float at(int64_t j, int64_t c) const {
    return (static_cast<float>(p[j * stride + c]) - static_cast<float>(zero_points[j * meta_stride])) *
           scales[j * meta_stride];
  }
};

#if LLMCORE_X86_64_V3
// The same rows in the x86-64-v3 compilation: AVX2's vpmovsxbd sign-extends eight int8 to
// int32 in one instruction from memory (asm, as in splat_load), and the zero point is
// subtracted among the integers: the same floats as Int8Rows::load ((q - zero point) is
// exact either way), in four instructions where GCC made about ten of 128-bit halves.
struct Int8RowsAvx2 : Int8Rows {
  using Base = Int8Rows;
  LLMCORE_INLINE v8f load(int64_t j, int64_t c) const {
    v8i x;
    asm("vpmovsxbd %1, %0" : "=x"(x) : "m"(*reinterpret_cast<const v8i8*>(p + j * stride + c)));
    const v8i shifted = x - static_cast<int32_t>(zero_points[j * meta_stride]);
    return __builtin_convertvector(shifted, v8f) * splat(scales[j * meta_stride]);
  }
};
#endif

// Four dot products q . k_j (j = j0..j0+3) of length d, in independent accumulators.
template <class Rows>
LLMCORE_INLINE void dot4(const float* q, const Rows& k, int64_t j0, int64_t d, float out[4]) {
  v8f a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
  int64_t c = 0;
  for (; c + kVec <= d; c += kVec) {
    const v8f x = load8(q + c);
    a0 += x * k.load(j0, c);
    a1 += x * k.load(j0 + 1, c);
    a2 += x * k.load(j0 + 2, c);
    a3 += x * k.load(j0 + 3, c);
  }
  const v4f sums = hsum4(a0, a1, a2, a3);
  float s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3];
  for (; c < d; ++c) {
    s0 += q[c] * k.at(j0, c);
    s1 += q[c] * k.at(j0 + 1, c);
    s2 += q[c] * k.at(j0 + 2, c);
    s3 += q[c] * k.at(j0 + 3, c);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <class Rows>
LLMCORE_INLINE float dot1(const float* q, const Rows& k, int64_t j, int64_t d) {
  v8f a = splat(0.0f);
  int64_t c = 0;
  for (; c + kVec <= d; c += kVec) a += load8(q + c) * k.load(j, c);
  float s = hsum(a);
  for (; c < d; ++c) s += q[c] * k.at(j, c);
  return s;
}

// Softmax numerator of one row in place: s[j] <- exp(s[j] - max); returns the sum and
// stores the max. A row whose scores are all -inf (every key masked) becomes zeros and
// sums to 0: that happens to a slice of the keys (below), never to a whole row the
// model asks for.
LLMCORE_INLINE float softmax_row(float* s, int64_t n, float* max_out) {
  float mx = s[0];
  int64_t j = 0;
  if (n >= kVec) {
    v8f m = load8(s);
    for (j = kVec; j + kVec <= n; j += kVec) {
      const v8f x = load8(s + j);
      m = x > m ? x : m;
    }
    for (int l = 0; l < kVec; ++l) mx = m[l] > mx ? m[l] : mx;
  }
  for (; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  *max_out = mx;
  if (!(mx > -INFINITY)) {
    for (j = 0; j < n; ++j) s[j] = 0.0f;
    return 0.0f;
  }
  const v8f vmx = splat(mx);
  v8f part = splat(0.0f);
  for (j = 0; j + kVec <= n; j += kVec) {
    const v8f e = exp_nonpositive(load8(s + j) - vmx);
    store8(s + j, e);
    part += e;
  }
  float sum = hsum(part);
  if (j < n) {  // the tail, padded with the max (exp 1, not stored or summed)
    float tail[kVec];
    for (int l = 0; l < kVec; ++l) tail[l] = j + l < n ? s[j + l] : mx;
    const v8f e = exp_nonpositive(load8(tail) - vmx);
    for (int l = 0; j + l < n; ++l) {
      s[j + l] = e[l];
      sum += e[l];
    }
  }
  return sum;
}

// s[j] <- cap * tanh(s[j] / cap) over n scores. tanh(|x|) = (1 - e) / (1 + e) with
// e = exp(-2|x|) <= 1 (exp_nonpositive's range), the sign put back: an absolute error of a
// few float ulps of cap, which is what the softmax that follows sees (a relative one near
// 0 would not matter there).
LLMCORE_INLINE void soft_cap_row(float* s, int64_t n, float cap) {
  const v8f inv = splat(1.0f / cap), c = splat(cap), one = splat(1.0f);
  auto capped = [&](v8f x) {
    const v8f t = x * inv;
    const v8f mag = t < splat(0.0f) ? -t : t;
    const v8f e = exp_nonpositive(splat(-2.0f) * mag);
    const v8f th = (one - e) / (one + e);
    return c * (t < splat(0.0f) ? -th : th);
  };
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) store8(s + j, capped(load8(s + j)));
  if (j < n) {
    float tail[kVec] = {};
    for (int64_t l = 0; j + l < n; ++l) tail[l] = s[j + l];
    const v8f y = capped(load8(tail));
    for (int64_t l = 0; j + l < n; ++l) s[j + l] = y[l];
  }
}

// The element type of a call's keys and values.
enum class KvType { f32, f16, bf16, i8 };

struct Attention {
  const float* q;
  const void* k;
  const void* v;
  KvType kv_type;
  const float* k_scales;  // i8 only: [batch, kv_len, n_kv_heads] each
  const int8_t* k_zero_points;
  const float* v_scales;
  const int8_t* v_zero_points;
  float* out;
  int64_t batch, q_len, n_heads, head_dim;  // q and out: [batch, q_len, n_heads, head_dim]
  int64_t kv_len, n_kv_heads;               // k and v: [batch, kv_len, n_kv_heads, head_dim]
  int64_t start_pos;
  bool causal;
  const float* mask;  // [q_len, kv_len] added to the scores; then every key is seen (nullptr: none)
  // The keys any query row may see: [0, start_pos + q_len) without a mask; with one, the
  // rows between its first and last entry above -inf in any query row (row_key_ranges). A ring
  // buffer that has not wrapped yet holds its positions in rows [0, pos]: a decode step
  // then reads those, not the whole buffer (Gemma 3's sliding layers: 1023 rows).
  int64_t key_begin, key_end;
  // With a mask, query row i's own range [row_begin[i], row_end[i]) (row_key_ranges): a
  // sliding layer's prompt row sees its window, not the keys of every row of the call.
  const int64_t* row_begin;
  const int64_t* row_end;
  float scale;
  // Scores become softcap * tanh(score / softcap) before the mask is added (Gemma 2's
  // soft-capped attention, llmcore::softcap_sdpa); 0: not capped.
  float softcap;
  int64_t group;       // query heads per kv head (n_heads / n_kv_heads)
  int64_t row_blocks;  // ceil(q_len / kRowBlock)
  int64_t key_chunks;  // slices of the keys per (batch, kv head, row block); 1 but in short calls
  int64_t chunk_keys;  // keys per slice
  // With key_chunks > 1, each work item's rows go here instead of to out, to be merged:
  // [key_chunks][batch * q_len * n_heads][head_dim + 2] = (unnormalised output, max, sum).
  float* partial;
};

// Keys (or values) per block of the inner loops: 8 KiB of rows, which stay in L1 while
// each of the item's query rows reads them.
LLMCORE_INLINE int64_t key_block(int64_t d) { return std::max<int64_t>(4, (2048 / std::max<int64_t>(d, 1)) & ~int64_t{3}); }

// rows_of<Rows>: kv head g of batch b of a cache as a Rows reader. The base readers' are
// specialised below; one derived from a base (the x86-64-v3 compilation's, another load
// over the same rows) is built as its Base is.
template <class Rows>
LLMCORE_INLINE Rows rows_of(const Attention& a, const void* base, const float* scales, const int8_t* zero_points,
                            int64_t b, int64_t g) {
  return {rows_of<typename Rows::Base>(a, base, scales, zero_points, b, g)};
}
template <>
LLMCORE_INLINE F32Rows rows_of(const Attention& a, const void* base, const float*, const int8_t*, int64_t b, int64_t g) {
  return {static_cast<const float*>(base) + (b * a.kv_len * a.n_kv_heads + g) * a.head_dim, a.n_kv_heads * a.head_dim};
}
template <>
LLMCORE_INLINE Bf16Rows rows_of(const Attention& a, const void* base, const float*, const int8_t*, int64_t b,
                                int64_t g) {
  return {static_cast<const uint16_t*>(base) + (b * a.kv_len * a.n_kv_heads + g) * a.head_dim,
          a.n_kv_heads * a.head_dim};
}
template <>
LLMCORE_INLINE F16Rows rows_of(const Attention& a, const void* base, const float*, const int8_t*, int64_t b, int64_t g) {
  return {static_cast<const _Float16*>(base) + (b * a.kv_len * a.n_kv_heads + g) * a.head_dim,
          a.n_kv_heads * a.head_dim};
}
template <>
LLMCORE_INLINE Int8Rows rows_of(const Attention& a, const void* base, const float* scales, const int8_t* zero_points,
                                int64_t b, int64_t g) {
  const int64_t row0 = b * a.kv_len * a.n_kv_heads + g;
  return {static_cast<const int8_t*>(base) + row0 * a.head_dim, a.n_kv_heads * a.head_dim, scales + row0,
          zero_points + row0, a.n_kv_heads};
}

// Rows [jb, je) of a narrow cache widened to float32 into `buffer` ([je - jb, d]), the row
// reader's own values: the same arithmetic as reading them one query vector at a time.
template <class Rows>
LLMCORE_INLINE F32Rows widened_rows(const Rows& rows, int64_t jb, int64_t je, int64_t d, float* buffer) {
  for (int64_t j = jb; j < je; ++j) {
    float* dst = buffer + (j - jb) * d;
    int64_t c = 0;
    for (; c + kVec <= d; c += kVec) store8(dst + c, rows.load(j, c));
    for (; c < d; ++c) dst[c] = rows.at(j, c);
  }
  return F32Rows{buffer, d};
}

// A narrow cache's block of keys or values read by at least this many query vectors (a
// prefill's rows; grouped-query heads) is widened once, then read as float32: each vector
// widened every row of it again (a SmolLM2 int8-cache program's 952-token prefill: 525 tok/s
// before, 890-907 after; fp32's 1097-1135).
constexpr int64_t kWidenedFor = 2;

// ---- A prompt's rows: the item's query vectors side by side in a register's lanes ----
//
// A prefill item holds rows x group query vectors (24 for SmolLM2's 8 rows of 3 heads) that
// all read the same keys and values. Computing them one vector at a time (the code below
// this path) reads a key once per query vector and ends each dot product in a horizontal
// sum; here the queries are transposed once per item into lanes, `qt` [d][lanes], and a
// score tile is an outer product: each key element broadcast once, multiplied into 8 or 16
// query lanes at a time, the sums staying in lanes (no horizontal adds). The scores are
// kept transposed, `st` [keys][lanes], so the softmax runs down the keys for 8 queries at
// once, and the weighted sum takes each probability as a broadcast from it.
//
// A lane group's keys are the union of its query rows' ranges (rows next to each other:
// at most a few keys past a row's own); a score outside a row's own range is replaced by
// -inf and its probability by exactly 0 (by selects: whatever such a key's score, it
// cannot reach the row), which leaves each row the softmax over its own keys. A weighted
// sum's tile reads the value rows of its members' union, each times 0 for a member that
// does not see it: rows another query of the call sees (a causal prompt's next rows, the
// next window), so values the model wrote, which the 0 cancels (an infinity or NaN would
// not be, but one there reaches that other query's output anyway).

// st[t][l * 8 ..] = sum over c of k_{row + t}[c] * qt[c][l * 8 ..], for T keys and L
// groups of 8 query lanes: T * L accumulators, each key element loaded as a broadcast.
template <bool kV3, int T, int L>
LLMCORE_INLINE void lane_scores(const float* qt, int64_t lanes, const F32Rows& k, int64_t row, int64_t d, float* st) {
  v8f acc[T][L];
  for (int t = 0; t < T; ++t)
    for (int l = 0; l < L; ++l) acc[t][l] = splat(0.0f);
  for (int64_t c = 0; c < d; ++c) {
    v8f qv[L];
    for (int l = 0; l < L; ++l) qv[l] = load8(qt + c * lanes + l * kVec);
    for (int t = 0; t < T; ++t) {
      const v8f kb = splat_load<kV3>(k.p + (row + t) * k.stride + c);
      for (int l = 0; l < L; ++l) acc[t][l] += kb * qv[l];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int l = 0; l < L; ++l) store8(st + t * lanes + l * kVec, acc[t][l]);
}

// Keys [lo, hi) of the L lane groups from lane `group_lane` on: tiles of T keys, then the
// rest one key at a time. st_j0 holds key j0's scores.
template <bool kV3, int T, int L>
LLMCORE_INLINE void lane_scores_range(const float* qt, int64_t lanes, const F32Rows& k, int64_t k_first, int64_t lo,
                                      int64_t hi, int64_t d, float* st_j0, int64_t j0, int64_t group_lane) {
  const float* q = qt + group_lane;
  float* st = st_j0 + group_lane;
  int64_t j = lo;
  for (; j + T <= hi; j += T) lane_scores<kV3, T, L>(q, lanes, k, j - k_first, d, st + (j - j0) * lanes);
  for (; j < hi; ++j) lane_scores<kV3, 1, L>(q, lanes, k, j - k_first, d, st + (j - j0) * lanes);
}

// Where a weighted sum's probabilities lie: a prompt's transposed scores, [key][lanes]
// (LaneProbs), or a decode step's rows of scores, one per query vector (RowProbs).
struct LaneProbs {
  const float* p;
  int64_t lanes;
  LLMCORE_INLINE const float* at(int64_t j, int t) const { return p + j * lanes + t; }
};
template <int T>
struct RowProbs {
  const float* rows[T];
  LLMCORE_INLINE const float* at(int64_t j, int t) const { return rows[t] + j; }
};

// out[t][c .. c + C*8) += sum over j < n of p(j, t) * v_{row + j}[c ..], T query vectors
// and C*8 channels held in registers over the n keys: each value row loaded once for the
// T vectors, each probability as a broadcast.
template <bool kV3, int T, int C, class Probs, class Rows>
LLMCORE_INLINE void lane_weights(float* const* out, const Probs& p, const Rows& v, int64_t row, int64_t c,
                                 int64_t n) {
  v8f acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int x = 0; x < C; ++x) acc[t][x] = load8(out[t] + c + x * kVec);
  for (int64_t j = 0; j < n; ++j) {
    v8f vv[C];
    for (int x = 0; x < C; ++x) vv[x] = v.load(row + j, c + x * kVec);
    for (int t = 0; t < T; ++t) {
      const v8f w = splat_load<kV3>(p.at(j, t));
      for (int x = 0; x < C; ++x) acc[t][x] += w * vv[x];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int x = 0; x < C; ++x) store8(out[t] + c + x * kVec, acc[t][x]);
}

// All of a tile's channels: kWide x 8 at a time, then kMid x 8, 8, and one by one (24, 16,
// 8 for the lanes' tiles of 12 registers).
template <bool kV3, int T, int kWide, int kMid, class Probs, class Rows>
LLMCORE_INLINE void lane_weights_all(float* const* out, const Probs& p, const Rows& v, int64_t row, int64_t d,
                                     int64_t n) {
  int64_t c = 0;
  for (; c + kWide * kVec <= d; c += kWide * kVec) lane_weights<kV3, T, kWide>(out, p, v, row, c, n);
  for (; c + kMid * kVec <= d; c += kMid * kVec) lane_weights<kV3, T, kMid>(out, p, v, row, c, n);
  for (; c + kVec <= d; c += kVec) lane_weights<kV3, T, 1>(out, p, v, row, c, n);
  for (; c < d; ++c) {
    for (int t = 0; t < T; ++t) {
      float acc = out[t][c];
      for (int64_t j = 0; j < n; ++j) acc += *p.at(j, t) * v.at(row + j, c);
      out[t][c] = acc;
    }
  }
}

// Lanes [first, first + 8) of a lane group: each one's key range [begin, end) as int32
// vectors (lanes past the item's query vectors: empty), and the group's union [lo, hi).
struct LaneRanges {
  v8i begin, end;
  int64_t lo, hi;
};
LLMCORE_INLINE LaneRanges lane_ranges(const int64_t* begin, const int64_t* end, int64_t G, int64_t nq, int64_t first) {
  LaneRanges r{v8i{}, v8i{}, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  for (int l = 0; l < kVec; ++l) {
    const int64_t qv = first + l;
    const bool live = qv < nq && begin[qv / G] < end[qv / G];
    r.begin[l] = live ? static_cast<int32_t>(begin[qv / G]) : 0;
    r.end[l] = live ? static_cast<int32_t>(end[qv / G]) : 0;
    if (live) {
      r.lo = std::min(r.lo, begin[qv / G]);
      r.hi = std::max(r.hi, end[qv / G]);
    }
  }
  if (r.lo >= r.hi) r.lo = r.hi = 0;
  return r;
}

// Query vector qv of an item (batch b, kv head g, rows from i0): row i0 + qv / group of
// query head g * group + qv % group, as a row of q and out.
LLMCORE_INLINE int64_t query_row(const Attention& a, int64_t b, int64_t g, int64_t i0, int64_t qv) {
  return (b * a.q_len + i0 + qv / a.group) * a.n_heads + g * a.group + qv % a.group;
}
// Where that row's output goes: out itself, or its key slice's partial row.
LLMCORE_INLINE float* output_row(const Attention& a, int64_t row, int64_t chunk) {
  return a.key_chunks == 1 ? a.out + row * a.head_dim
                           : a.partial + (chunk * a.batch * a.q_len * a.n_heads + row) * (a.head_dim + 2);
}
// An output row's last step: divided by its softmax sum, or, in a key slice, followed by
// the slice's max and sum for merge_key_chunks.
LLMCORE_INLINE void finish_row(const Attention& a, float* o, float max, float sum) {
  const int64_t d = a.head_dim;
  if (a.key_chunks == 1) {
    const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t c = 0; c < d; ++c) o[c] *= inv_sum;
  } else {
    o[d] = max;
    o[d + 1] = sum;
  }
}

// One item on the lanes (above): rows [i0, i0 + rows), keys [j0, j1), row r's own keys
// [begin[r], end[r]).
template <class Rows, bool kV3>
LLMCORE_INLINE void attend_block_lanes(const Attention& a, int64_t b, int64_t g, int64_t i0, int64_t rows,
                                       int64_t chunk, int64_t j0, int64_t j1, const int64_t* begin,
                                       const int64_t* end, std::vector<float>& scratch) {
  constexpr bool narrow = !std::is_same<Rows, F32Rows>::value;
  const int64_t d = a.head_dim, G = a.group, nq = rows * G;
  const int64_t groups = (nq + kVec - 1) / kVec, lanes = groups * kVec;
  const int64_t span = std::max<int64_t>(j1 - j0, 1);
  const int64_t blk = key_block(d);
  const int64_t needed = lanes * (d + span + 2) + (narrow ? blk * d : 0);
  if (static_cast<int64_t>(scratch.size()) < needed) scratch.resize(needed);
  float* qt = scratch.data();            // [d][lanes]: the queries, scaled
  float* st = qt + d * lanes;            // [span][lanes]: scores, then probabilities; key j at j - j0
  float* maxes = st + span * lanes;      // [lanes]
  float* sums = maxes + lanes;           // [lanes]
  float* block_rows = sums + lanes;      // [blk][d]: a narrow cache's block widened

  for (int64_t qv = 0; qv < lanes; ++qv) {
    const float* q = qv < nq ? a.q + query_row(a, b, g, i0, qv) * d : nullptr;
    for (int64_t c = 0; c < d; ++c) qt[c * lanes + qv] = q != nullptr ? q[c] * a.scale : 0.0f;
  }
  const Rows keys = rows_of<Rows>(a, a.k, a.k_scales, a.k_zero_points, b, g);
  const Rows values = rows_of<Rows>(a, a.v, a.v_scales, a.v_zero_points, b, g);
  // A block of keys or values as float32 rows, and the row in it that holds key jb.
  auto block = [&](const Rows& rows_in, int64_t jb, int64_t je, int64_t* first_row) LLMCORE_LAMBDA_INLINE {
    if constexpr (narrow) {
      *first_row = 0;
      return widened_rows(rows_in, jb, je, d, block_rows);
    } else {
      *first_row = jb;
      return rows_in;
    }
  };

  // Scores: lane groups two at a time (6 keys x 16 lanes in registers), three where three
  // are left (4 x 24), one alone only where one is (8 x 8: a broadcast for each FMA).
  for (int64_t jb = j0; jb < j1; jb += blk) {
    const int64_t je = std::min(j1, jb + blk);
    int64_t first_row;
    const F32Rows k = block(keys, jb, je, &first_row);
    const int64_t k_first = jb - first_row;  // key j is row j - k_first of k
    for (int64_t gi = 0; gi < groups;) {
      const int64_t left = groups - gi, take = left == 1 ? 1 : left == 3 ? 3 : 2;
      int64_t lo = je, hi = jb;  // the union of the groups' ranges in this block
      for (int64_t t = 0; t < take; ++t) {
        const LaneRanges r = lane_ranges(begin, end, G, nq, (gi + t) * kVec);
        if (r.lo < r.hi) {
          lo = std::min(lo, std::max(jb, r.lo));
          hi = std::max(hi, std::min(je, r.hi));
        }
      }
      if (take == 3) {
        lane_scores_range<kV3, 4, 3>(qt, lanes, k, k_first, lo, hi, d, st, j0, gi * kVec);
      } else if (take == 2) {
        lane_scores_range<kV3, 6, 2>(qt, lanes, k, k_first, lo, hi, d, st, j0, gi * kVec);
      } else {
        lane_scores_range<kV3, 8, 1>(qt, lanes, k, k_first, lo, hi, d, st, j0, gi * kVec);
      }
      gi += take;
    }
  }
  if (a.softcap > 0.0f) {  // before the mask, as in the code below
    for (int64_t gi = 0; gi < groups; ++gi) {
      const LaneRanges r = lane_ranges(begin, end, G, nq, gi * kVec);
      for (int64_t j = r.lo; j < r.hi; ++j) soft_cap_row(st + (j - j0) * lanes + gi * kVec, kVec, a.softcap);
    }
  }
  if (a.mask != nullptr) {
    for (int64_t qv = 0; qv < nq; ++qv) {
      const int64_t r = qv / G, n = end[r] - begin[r];
      float* s = st + (begin[r] - j0) * lanes + qv;
      const float* m = a.mask + (i0 + r) * a.kv_len + begin[r];
      for (int64_t j = 0; j < n; ++j) s[j * lanes] += m[j];
    }
  }

  // Softmax down the keys, 8 query lanes at a time; a key outside a lane's range plays no
  // part in its max and gets exactly 0 as its probability.
  for (int64_t gi = 0; gi < groups; ++gi) {
    const LaneRanges r = lane_ranges(begin, end, G, nq, gi * kVec);
    v8f mx = splat(-INFINITY);
    for (int64_t j = r.lo; j < r.hi; ++j) {
      const v8i jj = v8i{} + static_cast<int32_t>(j);
      const v8f x = (jj >= r.begin) & (jj < r.end) ? load8(st + (j - j0) * lanes + gi * kVec) : splat(-INFINITY);
      mx = x > mx ? x : mx;
    }
    const v8i live = mx > splat(-INFINITY);  // lanes with a key: a row with none sums to 0
    const v8f base = live ? mx : splat(0.0f);
    v8f sum = splat(0.0f);
    for (int64_t j = r.lo; j < r.hi; ++j) {
      float* s = st + (j - j0) * lanes + gi * kVec;
      const v8i jj = v8i{} + static_cast<int32_t>(j);
      const v8f e = live & (jj >= r.begin) & (jj < r.end) ? exp_nonpositive(load8(s) - base) : splat(0.0f);
      store8(s, e);
      sum += e;
    }
    store8(maxes + gi * kVec, mx);
    store8(sums + gi * kVec, sum);
  }

  // Weighted sums: tiles of 4 query vectors by 24 channels (12 registers), in key blocks
  // as the scores were.
  for (int64_t qv = 0; qv < nq; ++qv) {
    float* o = output_row(a, query_row(a, b, g, i0, qv), chunk);
    for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
  }
  constexpr int64_t kTile = 4;
  for (int64_t jb = j0; jb < j1; jb += blk) {
    const int64_t je = std::min(j1, jb + blk);
    int64_t first_row;
    const F32Rows v = block(values, jb, je, &first_row);
    for (int64_t t0 = 0; t0 < nq;) {
      const int64_t count = std::min({kTile, nq - t0, kVec - t0 % kVec});  // within t0's lane group
      int64_t lo = je, hi = jb;
      float* out[kTile];
      for (int64_t t = 0; t < count; ++t) {  // the union of the members' keys in this block
        const int64_t r = (t0 + t) / G, first = std::max(jb, begin[r]), last = std::min(je, end[r]);
        if (first < last) {
          lo = std::min(lo, first);
          hi = std::max(hi, last);
        }
        out[t] = output_row(a, query_row(a, b, g, i0, t0 + t), chunk);
      }
      if (lo < hi) {
        const LaneProbs p{st + (lo - j0) * lanes + t0, lanes};
        const int64_t row = lo - jb + first_row;
        if (count == 4) {
          lane_weights_all<kV3, 4, 3, 2>(out, p, v, row, d, hi - lo);
        } else if (count == 3) {
          lane_weights_all<kV3, 3, 3, 2>(out, p, v, row, d, hi - lo);
        } else if (count == 2) {
          lane_weights_all<kV3, 2, 3, 2>(out, p, v, row, d, hi - lo);
        } else {
          lane_weights_all<kV3, 1, 3, 2>(out, p, v, row, d, hi - lo);
        }
      }
      t0 += count;
    }
  }
  for (int64_t qv = 0; qv < nq; ++qv)
    finish_row(a, output_row(a, query_row(a, b, g, i0, qv), chunk), maxes[qv], sums[qv]);
}

// Query vectors per item from which the lanes are used: fewer (a decode step's heads)
// would leave most of each register empty.
constexpr int64_t kLanesFrom = kVec;

// A decode item's keys, then its values, requested a window ahead of the loops that read
// them. The hardware's prefetchers follow each stream only after a few of its lines have
// missed, and a decode item's streams are short (SmolLM2's kv head at 360 positions: 92 KB
// of keys read 256 bytes in every 768), so a step's attention read its cache at about
// 18 GB/s where the weights stream at 30 (docs/performance.md, "Measurements behind the
// code": a decode item's cache requested ahead). The window goes to L2 (the second-level
// hint) and is small enough to stay there on every x86 core the project runs on.
class CacheRowsAhead {
 public:
  static constexpr int64_t kWindowBytes = 64 * 1024;

  CacheRowsAhead(const Attention& a, int64_t b, int64_t g0, int64_t g1, int64_t j0, int64_t j1)
      : a_(a), b_(b), g0_(g0), g1_(g1), j0_(j0), keys_(j1 - j0) {
    const int64_t element = a.kv_type == KvType::f32 ? 4 : a.kv_type == KvType::i8 ? 1 : 2;
    row_bytes_ = a.head_dim * element;
    window_ = std::max<int64_t>(1, kWindowBytes / std::max<int64_t>(1, (g1 - g0) * row_bytes_));
    request_until(window_);
  }
  // The loops have read the keys before key j (values: false) or all keys and the values
  // before j (values: true); request what lies a window past that.
  void read_up_to(int64_t j, bool values) { request_until((values ? keys_ : 0) + (j - j0_) + window_); }

 private:
  // Positions [next_, until) of the sequence keys j0.., then values j0..: at each, the
  // item's heads' rows lie side by side (k and v are [batch, kv_len, kv heads, head_dim]).
  void request_until(int64_t until) {
    until = std::min(until, 2 * keys_);
    const int64_t span = (g1_ - g0_) * row_bytes_, position_bytes = a_.n_kv_heads * row_bytes_;
    for (; next_ < until; ++next_) {
      const bool values = next_ >= keys_;
      const int64_t j = j0_ + (values ? next_ - keys_ : next_);
      const char* rows = static_cast<const char*>(values ? a_.v : a_.k) + (b_ * a_.kv_len + j) * position_bytes +
                         g0_ * row_bytes_;
      // every line the rows touch: the Python bindings put planned memory 16 bytes past a
      // line's start, where a 256-byte row spans five lines
      const char* line = rows - reinterpret_cast<uintptr_t>(rows) % 64;
      for (; line < rows + span; line += 64) __builtin_prefetch(line, 0, 2);
    }
  }
  const Attention& a_;
  int64_t b_, g0_, g1_, j0_, keys_, row_bytes_ = 0, window_ = 1, next_ = 0;
};

// One work item: batch b, kv heads [g0, g1), each with the `group` query heads that read it,
// query rows [i0, i1), keys [chunk * chunk_keys, +chunk_keys). A kv head's query vectors
// are numbered as query_row numbers them, the heads' one after another.
template <class Rows, bool kV3>
LLMCORE_INLINE void attend_block_body(const Attention& a, int64_t b, int64_t g0, int64_t g1, int64_t i0, int64_t i1,
                                      int64_t chunk, std::vector<float>& scratch) {
  const int64_t d = a.head_dim, G = a.group;
  const int64_t rows = i1 - i0, per_head = rows * G, nq = (g1 - g0) * per_head;
  const int64_t j0 = a.key_begin + chunk * a.chunk_keys, j1 = std::min(a.key_end, j0 + a.chunk_keys);
  // Row r sees keys [begin[r], end[r]) in this item.
  int64_t begin[kRowBlock], end[kRowBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t limit = a.mask == nullptr ? (a.causal ? a.start_pos + i0 + r + 1 : a.key_end) : a.row_end[i0 + r];
    end[r] = std::max(j0, std::min(j1, limit));
    begin[r] = a.mask == nullptr ? j0 : std::min(end[r], std::max(j0, a.row_begin[i0 + r]));
  }
  if (per_head >= kLanesFrom) {
    for (int64_t g = g0; g < g1; ++g)
      attend_block_lanes<Rows, kV3>(a, b, g, i0, rows, chunk, j0, j1, begin, end, scratch);
    return;
  }
  CacheRowsAhead ahead(a, b, g0, g1, j0, j1);
  const int64_t span = std::max<int64_t>(j1 - j0, 1);
  const int64_t blk = key_block(d);
  const bool widen = !std::is_same<Rows, F32Rows>::value && per_head >= kWidenedFor;
  const int64_t needed = nq * (span + 2) + (widen ? blk * d : 0);
  if (static_cast<int64_t>(scratch.size()) < needed) scratch.resize(needed);
  float* scores = scratch.data();  // [nq][span], key j at column j - j0
  float* maxes = scores + nq * span;
  float* sums = maxes + nq;
  float* block_rows = sums + nq;  // [blk][d]: a block of keys or values widened (widen)

  // Query vector qv is vector qv % per_head of kv head g0 + qv / per_head (query_row's
  // numbering within a head). Its row in the block, its query and its output, worked out
  // once for the item: not divided out again in each block's loops.
  struct QueryVector {
    int64_t row;
    const float* q;
    float* out;
  };
  thread_local std::vector<QueryVector> vectors;
  vectors.resize(nq);
  for (int64_t qv = 0; qv < nq; ++qv) {
    const int64_t at = query_row(a, b, g0 + qv / per_head, i0, qv % per_head);
    vectors[qv] = {(qv % per_head) / G, a.q + at * d, output_row(a, at, chunk)};
  }
  auto query = [&](int64_t qv) { return vectors[qv].q; };
  auto output = [&](int64_t qv) { return vectors[qv].out; };
  auto row_of = [&](int64_t qv) { return vectors[qv].row; };

  // Scores, scaled. Keys in blocks, each block read by its head's query vectors while in
  // L1 (grouped-query heads share their keys); within a block four keys at a time. `k`
  // holds key j as row j - first (a widened block's rows start at its first key). The
  // heads of an item go block by block together: a block's positions are then read whole,
  // every head's row of each, one stream for the hardware's prefetcher. Head by head, a
  // pass read one row in eight (a bf16 cache of 8 kv heads of 64: 128 bytes of each 1 KiB),
  // and a long context's decode step waited on it (docs/performance.md, "The KV cache's
  // element type").
  auto score_block = [&](const auto& k, int64_t first, int64_t jb, int64_t je, int64_t g) LLMCORE_LAMBDA_INLINE {
    for (int64_t qv = (g - g0) * per_head; qv < (g - g0 + 1) * per_head; ++qv) {
      const int64_t hi = std::min(je, end[row_of(qv)]);
      const float* qr = query(qv);
      float* sr = scores + qv * span;
      int64_t j = std::max(jb, begin[row_of(qv)]);
      for (; j + 4 <= hi; j += 4) {
        float dots[4];
        dot4(qr, k, j - first, d, dots);
        for (int t = 0; t < 4; ++t) sr[j - j0 + t] = dots[t] * a.scale;
      }
      for (; j < hi; ++j) sr[j - j0] = dot1(qr, k, j - first, d) * a.scale;
    }
  };
  for (int64_t jb = j0; jb < j1; jb += blk) {
    const int64_t je = std::min(j1, jb + blk);
    ahead.read_up_to(je, false);
    for (int64_t g = g0; g < g1; ++g) {
      const Rows keys = rows_of<Rows>(a, a.k, a.k_scales, a.k_zero_points, b, g);
      if (widen) {
        score_block(widened_rows(keys, jb, je, d, block_rows), jb, jb, je, g);
      } else {
        score_block(keys, 0, jb, je, g);
      }
    }
  }
  for (int64_t qv = 0; qv < nq; ++qv) {
    const int64_t first = begin[row_of(qv)], n = end[row_of(qv)] - first;
    float* sr = scores + qv * span + (first - j0);  // the row's scores from its first key
    if (a.softcap > 0.0f) soft_cap_row(sr, n, a.softcap);
    if (a.mask != nullptr) {  // additive: -inf keys get exp(-87 - max) ~ 0 in softmax_row
      const float* mr = a.mask + (i0 + row_of(qv)) * a.kv_len + first;
      for (int64_t j = 0; j < n; ++j) sr[j] += mr[j];
    }
    if (n > 0) {
      sums[qv] = softmax_row(sr, n, &maxes[qv]);
    } else {
      sums[qv] = 0.0f;
      maxes[qv] = -INFINITY;
    }
    float* o = output(qv);
    for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
  }

  // Weighted sum of values, blocked over keys as the scores were. The query vectors of one
  // row of a kv head see the same keys and read the same value rows: up to four of them go
  // together through lane_weights (a tile of 4 vectors x 24 channels in registers over a
  // block of keys, each value row loaded once for the four); `v` holds the block's rows from
  // row `first` on. The baseline compilation keeps one vector by 64 channels a tile: on
  // SSE's 16 registers (a v8f in two) the 4 x 24 tiles made it 1.4-1.6x slower.
  constexpr int64_t kDecodeTile = kV3 ? 4 : 1;
  auto weigh_block = [&](const auto& v, int64_t first, int64_t jb, int64_t je, int64_t g) LLMCORE_LAMBDA_INLINE {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(jb, begin[r]);  // the row's first key in this block
      const int64_t n = std::min(je, end[r]) - lo;
      if (n <= 0) continue;
      const int64_t row = first + (lo - jb);  // lo's row in v
      const int64_t qv0 = (g - g0) * per_head + r * G;
      for (int64_t t0 = 0; t0 < G; t0 += kDecodeTile) {
        float* out[4];
        const float* probs[4];
        const int64_t count = std::min<int64_t>(kDecodeTile, G - t0);
        for (int64_t t = 0; t < count; ++t) {
          out[t] = output(qv0 + t0 + t);
          probs[t] = scores + (qv0 + t0 + t) * span + (lo - j0);
        }
        if constexpr (!kV3) {
          lane_weights_all<kV3, 1, 8, 4>(out, RowProbs<1>{probs[0]}, v, row, d, n);
        } else if (count == 4) {
          lane_weights_all<kV3, 4, 3, 2>(out, RowProbs<4>{probs[0], probs[1], probs[2], probs[3]}, v, row, d, n);
        } else if (count == 3) {
          lane_weights_all<kV3, 3, 3, 2>(out, RowProbs<3>{probs[0], probs[1], probs[2]}, v, row, d, n);
        } else if (count == 2) {
          lane_weights_all<kV3, 2, 3, 2>(out, RowProbs<2>{probs[0], probs[1]}, v, row, d, n);
        } else {
          lane_weights_all<kV3, 1, 3, 2>(out, RowProbs<1>{probs[0]}, v, row, d, n);
        }
      }
    }
  };
  for (int64_t jb = j0; jb < j1; jb += blk) {
    const int64_t je = std::min(j1, jb + blk);
    ahead.read_up_to(je, true);
    for (int64_t g = g0; g < g1; ++g) {
      const Rows values = rows_of<Rows>(a, a.v, a.v_scales, a.v_zero_points, b, g);
      if (widen) {
        weigh_block(widened_rows(values, jb, je, d, block_rows), 0, jb, je, g);
      } else {
        weigh_block(values, jb, jb, je, g);
      }
    }
  }

  for (int64_t qv = 0; qv < nq; ++qv) finish_row(a, output(qv), maxes[qv], sums[qv]);
}

// attend_block's two compilations per element type, and the ones this process runs (cpu_isa.h).
using AttendBlock = void (*)(const Attention&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             std::vector<float>&);

template <class Rows>
void attend_block_baseline(const Attention& a, int64_t b, int64_t g0, int64_t g1, int64_t i0, int64_t i1,
                           int64_t chunk, std::vector<float>& scratch) {
  attend_block_body<Rows, false>(a, b, g0, g1, i0, i1, chunk, scratch);
}

#if LLMCORE_X86_64_V3
// The row readers of the x86-64-v3 compilation: a half cache's widens with F16C, an int8
// one's with vpmovsxbd.
template <class Rows>
struct V3Rows {
  using type = Rows;
};
template <>
struct V3Rows<F16Rows> {
  using type = F16RowsF16c;
};
template <>
struct V3Rows<Int8Rows> {
  using type = Int8RowsAvx2;
};

template <class Rows>
__attribute__((target("arch=x86-64-v3"))) void attend_block_v3(const Attention& a, int64_t b, int64_t g0, int64_t g1,
                                                               int64_t i0, int64_t i1, int64_t chunk,
                                                               std::vector<float>& scratch) {
  attend_block_body<typename V3Rows<Rows>::type, true>(a, b, g0, g1, i0, i1, chunk, scratch);
}
#endif

template <class Rows>
AttendBlock attend_block_for_this_cpu() {
#if LLMCORE_X86_64_V3
  if (kernels_isa() >= Isa::avx2) return attend_block_v3<Rows>;
#endif
  return attend_block_baseline<Rows>;
}

AttendBlock attend_block_for(KvType type) {
  static const AttendBlock f32 = attend_block_for_this_cpu<F32Rows>(), f16 = attend_block_for_this_cpu<F16Rows>(),
                           bf16 = attend_block_for_this_cpu<Bf16Rows>(), i8 = attend_block_for_this_cpu<Int8Rows>();
  switch (type) {
    case KvType::f16: return f16;
    case KvType::bf16: return bf16;
    case KvType::i8: return i8;
    default: return f32;
  }
}

// How many slices to cut the keys into. A prompt's items (one per batch, kv head and row
// block) keep them whole where the items already divide among the threads (or are many);
// SmolLM2's 3 kv heads on 2 threads would leave one thread idle a third of the time, so
// there each item's keys are cut into slices that make a count dividing evenly. A decode
// step's one item per batch, every kv head in it (attend), is cut into one slice per thread.
// The slices' softmax parts are merged after (a few floats per output row); short caches
// are not worth slicing.
int64_t choose_key_chunks(int64_t items, int64_t keys, int64_t threads, bool whole_heads) {
  constexpr int64_t kMinChunkKeys = 32;
  if (threads <= 1) return 1;
  int64_t chunks = threads;
  if (!whole_heads) {
    if (items % threads == 0 || items >= 4 * threads) return 1;
    for (int64_t c = 2; c < threads; ++c) {
      if ((items * c) % threads == 0) {
        chunks = c;
        break;
      }
    }
  }
  return std::max<int64_t>(1, std::min(chunks, keys / kMinChunkKeys));
}

// out[row] = sum_c w_c o_c / sum_c w_c l_c, w_c = exp(m_c - max_c m_c): the softmax over
// all keys from each slice's (unnormalised output o, max m, sum l).
void merge_key_chunks(const Attention& a) {
  const int64_t d = a.head_dim, rows = a.batch * a.q_len * a.n_heads, stride = rows * (d + 2);
  for (int64_t row = 0; row < rows; ++row) {
    const float* p = a.partial + row * (d + 2);
    float m = -INFINITY;
    for (int64_t c = 0; c < a.key_chunks; ++c) m = std::max(m, p[c * stride + d]);
    float* o = a.out + row * d;
    for (int64_t x = 0; x < d; ++x) o[x] = 0.0f;
    if (!(m > -INFINITY)) continue;
    float total = 0.0f;
    for (int64_t c = 0; c < a.key_chunks; ++c) {
      const float* pc = p + c * stride;
      const float w = std::exp(pc[d] - m);  // a slice with no key: exp(-inf) = 0
      if (w == 0.0f) continue;
      total += w * pc[d + 1];
      for (int64_t x = 0; x < d; ++x) o[x] += w * pc[x];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t x = 0; x < d; ++x) o[x] *= inv;
  }
}

constexpr int64_t kWholeHeadsFrom = 512;  // keys

void attend(Attention& a) {
  // A decode step (fewer query vectors a kv head than a register's lanes: the
  // vector-at-a-time path) over kWholeHeadsFrom keys or more takes all kv heads in each
  // item, a slice of the keys each: the item then reads its positions whole
  // (attend_block_body says why). Fewer keys stay one item per kv head, the keys whole
  // where those divide among the threads.
  const bool whole_heads = a.q_len * a.group < kLanesFrom && a.key_end - a.key_begin >= kWholeHeadsFrom;
  const int64_t heads_per_item = whole_heads ? a.n_kv_heads : 1;
  const int64_t head_items = a.n_kv_heads / heads_per_item;
  const int64_t base = a.batch * head_items * a.row_blocks;
  const int64_t keys = a.key_end - a.key_begin;
  a.key_chunks = choose_key_chunks(base, keys, kernel_thread_count(), whole_heads);
  a.chunk_keys = (keys + a.key_chunks - 1) / a.key_chunks;
  thread_local std::vector<float> partial;
  if (a.key_chunks > 1) {
    partial.resize(a.key_chunks * a.batch * a.q_len * a.n_heads * (a.head_dim + 2));
    a.partial = partial.data();
  }
  const int64_t items = base * a.key_chunks;
  // A causal prompt's later row blocks see more keys; the threads take items one at a time
  // in order, so the row blocks go last to first: the dearest items first, the cheapest
  // ones fill in at the end (docs/performance.md, "What was tried": a causal prompt's row
  // blocks last to first).
  const AttendBlock attend_block = attend_block_for(a.kv_type);
  kernel_parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t chunk = it % a.key_chunks;
      const int64_t blk = a.row_blocks - 1 - (it / a.key_chunks) % a.row_blocks;
      const int64_t g = (it / (a.key_chunks * a.row_blocks)) % head_items * heads_per_item;
      const int64_t b = it / (a.key_chunks * a.row_blocks * head_items);
      const int64_t i0 = blk * kRowBlock;
      attend_block(a, b, g, g + heads_per_item, i0, std::min(a.q_len, i0 + kRowBlock), chunk, scratch);
    }
  });
  if (a.key_chunks > 1) merge_key_chunks(a);
}

const char* dtype_name(ScalarType t) { return executorch::runtime::toString(t); }

// The element types a cache may keep (--kv-cache-dtype), each copied as bytes.
bool cache_type(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Char;
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

uint16_t float_to_bf16(float x) {  // round to nearest even (PyTorch's rounding; NaN stays NaN)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Query rows of a 16-bit call as float32, and its float32 output as 16 bits again.
void widen(const Tensor& t, float* out) {
  const int64_t n = t.numel();
  if (t.scalar_type() == ScalarType::BFloat16) {
    const uint16_t* src = static_cast<const uint16_t*>(t.const_data_ptr());
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(src[i]);
  } else {
    const _Float16* src = static_cast<const _Float16*>(t.const_data_ptr());
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
  }
}

void narrow(const float* src, Tensor& t) {
  const int64_t n = t.numel();
  if (t.scalar_type() == ScalarType::BFloat16) {
    uint16_t* dst = static_cast<uint16_t*>(t.mutable_data_ptr());
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  } else {
    _Float16* dst = static_cast<_Float16*>(t.mutable_data_ptr());
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(src[i]);
  }
}

// The shape, mask and argument checks custom_sdpa and custom_quantized_sdpa share; the
// caller has checked the element types. False: ctx holds the failure.
bool check_attention(KernelRuntimeContext& ctx, const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                     int64_t start_pos, const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, !(attn_mask.has_value() && is_causal), InvalidArgument, false,
                      "%s: attn_mask and is_causal cannot both be set (the mask says what is seen)", op);
  ET_KERNEL_CHECK_MSG(ctx, dropout_p == 0.0, InvalidArgument, false, "%s: dropout_p must be 0 (got %f)", op, dropout_p);
  ET_KERNEL_CHECK_MSG(ctx, q.dim() == 4 && k.dim() == 4 && v.dim() == 4, InvalidArgument, false,
                      "%s: query, key and value must be 4-D [B, S, H, D]", op);
  ET_KERNEL_CHECK_MSG(ctx, k.sizes() == v.sizes(), InvalidArgument, false, "%s: key and value must have one shape", op);
  const int64_t batch = q.size(0), q_len = q.size(1), n_heads = q.size(2), head_dim = q.size(3);
  const int64_t kv_len = k.size(1), n_kv_heads = k.size(2);
  ET_KERNEL_CHECK_MSG(ctx, k.size(0) == batch && k.size(3) == head_dim, InvalidArgument, false,
                      "%s: key [%lld, %lld, %lld, %lld] does not match query [%lld, %lld, %lld, %lld] "
                      "in batch or head size",
                      op, (long long)k.size(0), (long long)kv_len, (long long)n_kv_heads, (long long)k.size(3),
                      (long long)batch, (long long)q_len, (long long)n_heads, (long long)head_dim);
  ET_KERNEL_CHECK_MSG(ctx, n_kv_heads > 0 && n_heads % n_kv_heads == 0, InvalidArgument, false,
                      "%s: %lld query heads are not a multiple of %lld key/value heads", op, (long long)n_heads,
                      (long long)n_kv_heads);
  // with a mask, positions are the mask's business (a ring buffer holds later ones than its length)
  ET_KERNEL_CHECK_MSG(ctx, attn_mask.has_value() || (start_pos >= 0 && start_pos + q_len <= kv_len), InvalidArgument,
                      false, "%s: positions [%lld, %lld) are outside the cache's %lld", op, (long long)start_pos,
                      (long long)(start_pos + q_len), (long long)kv_len);
  ET_KERNEL_CHECK_MSG(ctx, !scale.has_value() || std::isfinite(*scale), InvalidArgument, false,
                      "%s: scale must be finite", op);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, q.sizes()) == Error::Ok, InvalidArgument, false);
  ET_KERNEL_CHECK_MSG(ctx, dense(q) && dense(k) && dense(v) && dense(out), InvalidArgument, false,
                      "%s: query, key, value and out must be contiguous", op);
  if (attn_mask.has_value()) {
    const Tensor& m = *attn_mask;
    ET_KERNEL_CHECK_MSG(ctx, m.scalar_type() == ScalarType::Float && m.dim() == 2 && m.size(0) == q_len &&
                                 m.size(1) == kv_len && dense(m),
                        InvalidArgument, false,
                        "%s: attn_mask must be a contiguous float32 [%lld, %lld] (query rows x cache rows)", op,
                        (long long)q_len, (long long)kv_len);
  }
  ET_KERNEL_CHECK_MSG(ctx, q.numel() == 0 || head_dim > 0, InvalidArgument, false, "%s: head size must be positive",
                      op);
  return true;
}

// For each row i of mask [q_len, kv_len], [begins[i], ends[i]): its columns between its
// first and its last entry above -inf (empty when every entry is -inf); and [*begin, *end)
// those of all rows together. A key outside a row's range would get a softmax weight of
// exp(-87 - max) at most, below a float's resolution of the sum it joins. Per row, a
// sliding layer's prompt row reads its window: with one range for the whole call, each row
// of a 512-token chunk at positions 512-1023 of Gemma 3's 256-key sliding layers read all
// 1023 rows of their ring buffer, and that chunk's attention took 1.77 s over the 30 layers
// (0.35 s with a range per row; docs/performance.md, "Measurements behind the code").
void row_key_ranges(const float* mask, int64_t q_len, int64_t kv_len, int64_t* begins, int64_t* ends,
                    int64_t* begin, int64_t* end) {
  int64_t lo = kv_len, hi = 0;
  for (int64_t i = 0; i < q_len; ++i) {
    const float* row = mask + i * kv_len;
    int64_t j = 0;
    while (j < kv_len && !(row[j] > -INFINITY)) ++j;
    int64_t k = kv_len;
    while (k > j && !(row[k - 1] > -INFINITY)) --k;
    begins[i] = j < k ? j : 0;
    ends[i] = j < k ? k : 0;
    if (j < k) {
      lo = std::min(lo, j);
      hi = std::max(hi, k);
    }
  }
  *begin = lo < hi ? lo : 0;
  *end = lo < hi ? hi : 0;
}

// Attention of float32 queries q over keys and values of `type` (checked), into float32 out.
void attend_checked(const Tensor& q_shape, const float* q, const Tensor& k, const Tensor& v, KvType type,
                    int64_t start_pos, const std::optional<Tensor>& attn_mask, bool is_causal,
                    std::optional<double> scale, float* out, const float* k_scales = nullptr,
                    const int8_t* k_zero_points = nullptr, const float* v_scales = nullptr,
                    const int8_t* v_zero_points = nullptr, float softcap = 0.0f) {
  Attention a;
  a.q = q;
  a.k = k.const_data_ptr();
  a.v = v.const_data_ptr();
  a.kv_type = type;
  a.k_scales = k_scales;
  a.k_zero_points = k_zero_points;
  a.v_scales = v_scales;
  a.v_zero_points = v_zero_points;
  a.out = out;
  a.batch = q_shape.size(0);
  a.q_len = q_shape.size(1);
  a.n_heads = q_shape.size(2);
  a.head_dim = q_shape.size(3);
  a.kv_len = k.size(1);
  a.n_kv_heads = k.size(2);
  a.start_pos = start_pos;
  a.causal = is_causal;
  a.mask = attn_mask.has_value() ? attn_mask->const_data_ptr<float>() : nullptr;
  a.key_begin = 0;
  a.key_end = a.start_pos + a.q_len;
  thread_local std::vector<int64_t> row_ranges;  // [begins | ends], q_len each
  a.row_begin = a.row_end = nullptr;
  if (a.mask != nullptr) {
    row_ranges.resize(2 * a.q_len);
    a.row_begin = row_ranges.data();
    a.row_end = row_ranges.data() + a.q_len;
    row_key_ranges(a.mask, a.q_len, a.kv_len, row_ranges.data(), row_ranges.data() + a.q_len, &a.key_begin,
                   &a.key_end);
  }
  a.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  a.softcap = softcap;
  a.group = a.n_heads / a.n_kv_heads;
  a.row_blocks = (a.q_len + kRowBlock - 1) / kRowBlock;
  a.partial = nullptr;
  attend(a);
}

// A cache write: value's rows to the cache rows `row_of(b, s)` gives, as bytes.
template <class RowOf>
void copy_rows(const Tensor& value, Tensor& cache, RowOf row_of, bool shared) {
  const int64_t seq = value.size(1), capacity = cache.size(1);
  const int64_t row = value.size(2) * value.size(3) * static_cast<int64_t>(value.element_size());  // bytes
  const char* src = static_cast<const char*>(value.const_data_ptr());
  char* dst = static_cast<char*>(cache.mutable_data_ptr());
  auto copy = [&](int64_t b, int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1;) {  // runs of consecutive cache rows in one memcpy
      const int64_t first = row_of(b, s);
      int64_t n = 1;
      while (s + n < s1 && row_of(b, s + n) == first + n) ++n;
      std::memcpy(dst + (b * capacity + first) * row, src + (b * seq + s) * row, static_cast<size_t>(n * row));
      s += n;
    }
  };
  const int64_t threads = kernel_thread_count();
  for (int64_t b = 0; b < value.size(0); ++b) {
    if (shared && threads > 1 && seq * row >= kSharedCopyBytes) {
      kernel_parallel_for(0, seq, (seq + threads - 1) / threads, [&](int64_t s0, int64_t s1) { copy(b, s0, s1); });
    } else {
      copy(b, 0, seq);
    }
  }
}

}  // namespace

Tensor& update_cache_out(KernelRuntimeContext& ctx, const Tensor& value, Tensor& cache, int64_t start_pos,
                         Tensor& out) {
  const bool types = value.scalar_type() == cache.scalar_type() && cache_type(value.scalar_type());
  ET_KERNEL_CHECK_MSG(ctx, types, InvalidType, out,
                      "llama::update_cache: takes float32, float16, bfloat16 or int8 alike (value %s, cache %s)",
                      dtype_name(value.scalar_type()), dtype_name(cache.scalar_type()));
  ET_KERNEL_CHECK_MSG(ctx, value.dim() == 4 && cache.dim() == 4, InvalidArgument, out,
                      "llama::update_cache: value and cache must be 4-D [B, S, H, D] (got %zd-D and %zd-D)",
                      (ssize_t)value.dim(), (ssize_t)cache.dim());
  ET_KERNEL_CHECK_MSG(ctx,
                      value.size(0) == cache.size(0) && value.size(2) == cache.size(2) && value.size(3) == cache.size(3),
                      InvalidArgument, out,
                      "llama::update_cache: value [%zd, %zd, %zd, %zd] does not fit cache [%zd, %zd, %zd, %zd] "
                      "(batch, heads and head size must match)",
                      (ssize_t)value.size(0), (ssize_t)value.size(1), (ssize_t)value.size(2), (ssize_t)value.size(3),
                      (ssize_t)cache.size(0), (ssize_t)cache.size(1), (ssize_t)cache.size(2), (ssize_t)cache.size(3));
  const int64_t seq = value.size(1), capacity = cache.size(1);
  ET_KERNEL_CHECK_MSG(ctx, start_pos >= 0 && start_pos + seq <= capacity, InvalidArgument, out,
                      "llama::update_cache: positions [%lld, %lld) are outside the cache's %lld",
                      (long long)start_pos, (long long)(start_pos + seq), (long long)capacity);
  ET_KERNEL_CHECK_MSG(ctx, dense(value) && dense(cache), InvalidArgument, out,
                      "llama::update_cache: value and cache must be contiguous");
  copy_rows(value, cache, [&](int64_t, int64_t s) { return start_pos + s; }, /*shared=*/true);
  return out;
}

Tensor& update_cache_with_indices_out(KernelRuntimeContext& ctx, const Tensor& value, Tensor& cache,
                                      int64_t start_pos, const Tensor& indices, Tensor& out) {
  (void)start_pos;  // the rows come from indices
  const bool types = value.scalar_type() == cache.scalar_type() && cache_type(value.scalar_type());
  ET_KERNEL_CHECK_MSG(ctx, types, InvalidType, out,
                      "llama::update_cache_with_indices: takes float32, float16, bfloat16 or int8 alike (value %s, "
                      "cache %s)",
                      dtype_name(value.scalar_type()), dtype_name(cache.scalar_type()));
  ET_KERNEL_CHECK_MSG(ctx, indices.scalar_type() == ScalarType::Long, InvalidType, out,
                      "llama::update_cache_with_indices: indices must be int64 (got %s)",
                      dtype_name(indices.scalar_type()));
  ET_KERNEL_CHECK_MSG(ctx, value.dim() == 4 && cache.dim() == 4 && indices.dim() == 2, InvalidArgument, out,
                      "llama::update_cache_with_indices: value and cache must be 4-D [B, S, H, D], indices 2-D [B, S]");
  ET_KERNEL_CHECK_MSG(ctx,
                      value.size(0) == cache.size(0) && value.size(2) == cache.size(2) &&
                          value.size(3) == cache.size(3) && indices.size(0) == value.size(0) &&
                          indices.size(1) == value.size(1),
                      InvalidArgument, out,
                      "llama::update_cache_with_indices: value [%zd, %zd, %zd, %zd], cache [%zd, %zd, %zd, %zd] and "
                      "indices [%zd, %zd] do not fit (batch, rows, heads and head size must match)",
                      (ssize_t)value.size(0), (ssize_t)value.size(1), (ssize_t)value.size(2), (ssize_t)value.size(3),
                      (ssize_t)cache.size(0), (ssize_t)cache.size(1), (ssize_t)cache.size(2), (ssize_t)cache.size(3),
                      (ssize_t)indices.size(0), (ssize_t)indices.size(1));
  ET_KERNEL_CHECK_MSG(ctx, dense(value) && dense(cache) && dense(indices), InvalidArgument, out,
                      "llama::update_cache_with_indices: value, cache and indices must be contiguous");
  const int64_t seq = value.size(1), capacity = cache.size(1);
  const int64_t* rows = indices.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.numel(); ++i) {
    ET_KERNEL_CHECK_MSG(ctx, rows[i] >= 0 && rows[i] < capacity, InvalidArgument, out,
                        "llama::update_cache_with_indices: row %lld is outside the cache's %lld",
                        (long long)rows[i], (long long)capacity);
  }
  copy_rows(value, cache, [&](int64_t b, int64_t s) { return rows[b * seq + s]; }, /*shared=*/false);
  return out;
}

namespace {

// custom_sdpa and softcap_sdpa: queries, keys, values and out of one float type; 16-bit
// calls compute in float32 (queries widened, the output narrowed: a few rows; the cache is
// read as it is).
Tensor& float_sdpa(KernelRuntimeContext& ctx, const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                   int64_t start_pos, const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, float softcap, Tensor& out) {
  const ScalarType type = q.scalar_type();
  const bool types = (type == ScalarType::Float || type == ScalarType::Half || type == ScalarType::BFloat16) &&
                     k.scalar_type() == type && v.scalar_type() == type && out.scalar_type() == type;
  ET_KERNEL_CHECK_MSG(ctx, types, InvalidType, out,
                      "%s: takes float32, float16 or bfloat16 alike (query %s, key %s, value %s, out %s)", op,
                      dtype_name(q.scalar_type()), dtype_name(k.scalar_type()), dtype_name(v.scalar_type()),
                      dtype_name(out.scalar_type()));
  if (!check_attention(ctx, op, q, k, v, start_pos, attn_mask, dropout_p, is_causal, scale, out)) return out;
  if (q.numel() == 0) return out;
  if (type == ScalarType::Float) {
    attend_checked(q, q.const_data_ptr<float>(), k, v, KvType::f32, start_pos, attn_mask, is_causal, scale,
                   out.mutable_data_ptr<float>(), nullptr, nullptr, nullptr, nullptr, softcap);
    return out;
  }
  thread_local std::vector<float> q32, out32;
  q32.resize(q.numel());
  out32.resize(q.numel());
  widen(q, q32.data());
  attend_checked(q, q32.data(), k, v, type == ScalarType::Half ? KvType::f16 : KvType::bf16, start_pos, attn_mask,
                 is_causal, scale, out32.data(), nullptr, nullptr, nullptr, nullptr, softcap);
  narrow(out32.data(), out);
  return out;
}

}  // namespace

Tensor& custom_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        int64_t start_pos, const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                        std::optional<double> scale, Tensor& out) {
  return float_sdpa(ctx, "llama::custom_sdpa", q, k, v, start_pos, attn_mask, dropout_p, is_causal, scale, 0.0f, out);
}

Tensor& softcap_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                         int64_t start_pos, const std::optional<Tensor>& attn_mask, std::optional<double> scale,
                         double softcap, Tensor& out) {
  constexpr const char* op = "llmcore::softcap_sdpa";
  ET_KERNEL_CHECK_MSG(ctx, softcap > 0.0 && std::isfinite(softcap), InvalidArgument, out,
                      "%s: softcap must be positive and finite (got %f)", op, softcap);
  return float_sdpa(ctx, op, q, k, v, start_pos, attn_mask, 0.0, /*is_causal=*/!attn_mask.has_value(), scale,
                    static_cast<float>(softcap), out);
}

Tensor& custom_quantized_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                  int64_t start_pos, const std::optional<Tensor>& attn_mask, double dropout_p,
                                  bool is_causal, std::optional<double> scale,
                                  const std::optional<Tensor>& q_zero_points, const std::optional<Tensor>& q_scales,
                                  const std::optional<Tensor>& k_zero_points, const std::optional<Tensor>& k_scales,
                                  const std::optional<Tensor>& v_zero_points, const std::optional<Tensor>& v_scales,
                                  bool is_seq_at_dim_2, Tensor& out) {
  constexpr const char* op = "llama::custom_quantized_sdpa";
  ET_KERNEL_CHECK_MSG(ctx, !is_seq_at_dim_2, InvalidArgument, out,
                      "%s: llmcore's kernel takes [B, S, H, D] only (is_seq_at_dim_2 must be false)", op);
  const bool types = q.scalar_type() == ScalarType::Char && k.scalar_type() == ScalarType::Char &&
                     v.scalar_type() == ScalarType::Char && out.scalar_type() == ScalarType::Float;
  ET_KERNEL_CHECK_MSG(ctx, types, InvalidType, out, "%s: query, key and value must be int8 and out float32 (got %s, %s, %s, %s)",
                      op, dtype_name(q.scalar_type()), dtype_name(k.scalar_type()), dtype_name(v.scalar_type()),
                      dtype_name(out.scalar_type()));
  const std::optional<Tensor>* params[][2] = {{&q_scales, &q_zero_points}, {&k_scales, &k_zero_points},
                                             {&v_scales, &v_zero_points}};
  const Tensor* values[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const std::optional<Tensor>& sc = *params[i][0];
    const std::optional<Tensor>& zp = *params[i][1];
    ET_KERNEL_CHECK_MSG(ctx, sc.has_value() && zp.has_value(), InvalidArgument, out,
                        "%s: the scales and zero points of query, key and value must all be given", op);
    const Tensor& x = *values[i];
    const bool fits = sc->scalar_type() == ScalarType::Float && zp->scalar_type() == ScalarType::Char &&
                      sc->numel() * x.size(3) == x.numel() && zp->numel() == sc->numel() && dense(*sc) && dense(*zp);
    ET_KERNEL_CHECK_MSG(ctx, fits, InvalidArgument, out,
                        "%s: scales (float32) and zero points (int8) must be contiguous, one per row of the head size",
                        op);
  }
  if (!check_attention(ctx, op, q, k, v, start_pos, attn_mask, dropout_p, is_causal, scale, out)) return out;
  if (q.numel() == 0) return out;
  // queries read back as floats: (q - zero point) * scale, a row of head_dim at a time
  thread_local std::vector<float> q32;
  const int64_t d = q.size(3), rows = q.numel() / d;
  q32.resize(q.numel());
  const int8_t* qi = q.const_data_ptr<int8_t>();
  const float* qs = q_scales->const_data_ptr<float>();
  const int8_t* qz = q_zero_points->const_data_ptr<int8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < d; ++c) q32[r * d + c] = (static_cast<float>(qi[r * d + c]) - qz[r]) * qs[r];
  }
  attend_checked(q, q32.data(), k, v, KvType::i8, start_pos, attn_mask, is_causal, scale,
                 out.mutable_data_ptr<float>(), k_scales->const_data_ptr<float>(),
                 k_zero_points->const_data_ptr<int8_t>(), v_scales->const_data_ptr<float>(),
                 v_zero_points->const_data_ptr<int8_t>());
  return out;
}

namespace {

// One row of quantize_rows, PyTorch's arithmetic step for step (finite inputs): the
// parameters in float32 (quantized_decomposed's choose_qparams_per_token_asymmetric), the
// rounding in float64, where PyTorch's type promotion puts quantize_per_token's (a float32
// row times the float64 reciprocal of its scale, plus the zero point). Each product and sum
// is rounded on its own, as PyTorch's elementwise kernels round them: no fused multiply-add.
__attribute__((optimize("fp-contract=off"))) void quantize_row(const float* x, int64_t n, int8_t* q, float* scale_out,
                                                              int8_t* zero_point_out) {
  float lo = 0.0f, hi = 0.0f;  // min(row, 0) and max(row, 0)
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float scale = std::max((hi - lo) / 255.0f, std::numeric_limits<float>::epsilon());
  const float descaled_min = lo / scale, descaled_max = hi / scale;
  const float from_min = -128.0f + descaled_min, from_max = 127.0f + descaled_max;
  const float zero_point = std::nearbyint(
      std::min(std::max(from_min + from_max > 0.0f ? -128.0f - descaled_min : 127.0f - descaled_max, -128.0f), 127.0f));
  const double inverse = 1.0 / static_cast<double>(scale), offset = zero_point;
  for (int64_t i = 0; i < n; ++i) {
    const double scaled = static_cast<double>(x[i]) * inverse;
    const double shifted = scaled + offset;
    q[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(shifted), -128.0), 127.0));
  }
  *scale_out = scale;
  *zero_point_out = static_cast<int8_t>(zero_point);
}

}  // namespace

void quantize_rows_out(KernelRuntimeContext& ctx, const Tensor& x, Tensor& q, Tensor& scales, Tensor& zero_points) {
  constexpr const char* op = "llmcore::quantize_rows";
  const bool types = x.scalar_type() == ScalarType::Float && q.scalar_type() == ScalarType::Char &&
                     scales.scalar_type() == ScalarType::Float && zero_points.scalar_type() == ScalarType::Char;
  ET_KERNEL_CHECK_MSG(ctx, types, InvalidType, ,
                      "%s: takes float32 rows into int8, float32 scales and int8 zero points (got %s, %s, %s, %s)", op,
                      dtype_name(x.scalar_type()), dtype_name(q.scalar_type()), dtype_name(scales.scalar_type()),
                      dtype_name(zero_points.scalar_type()));
  ET_KERNEL_CHECK_MSG(ctx, x.dim() >= 1 && x.size(x.dim() - 1) > 0, InvalidArgument, ,
                      "%s: x must have rows (a last dimension of at least one element)", op);
  executorch::aten::SizesType sizes[16];
  ET_KERNEL_CHECK_MSG(ctx, x.dim() <= 16, InvalidArgument, , "%s: at most 16 dimensions", op);
  for (ssize_t i = 0; i < x.dim(); ++i) sizes[i] = x.size(i);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(q, x.sizes()) == Error::Ok, InvalidArgument, );
  sizes[x.dim() - 1] = 1;
  const executorch::aten::ArrayRef<executorch::aten::SizesType> row_sizes(sizes, static_cast<size_t>(x.dim()));
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(scales, row_sizes) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(zero_points, row_sizes) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK_MSG(ctx, dense(x) && dense(q) && dense(scales) && dense(zero_points), InvalidArgument, ,
                      "%s: x and its outputs must be contiguous", op);
  const int64_t n = x.size(x.dim() - 1), rows = x.numel() / n;
  const float* in = x.const_data_ptr<float>();
  int8_t* integers = q.mutable_data_ptr<int8_t>();
  float* row_scales = scales.mutable_data_ptr<float>();
  int8_t* row_zero_points = zero_points.mutable_data_ptr<int8_t>();
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(in + r * n, n, integers + r * n, row_scales + r, row_zero_points + r);
  };
  // a decode step's rows (a few heads) on this thread; a prefill's on the kernels' threads
  constexpr int64_t kParallelElements = 1 << 16;
  if (x.numel() >= kParallelElements) {
    kernel_parallel_for(0, rows, std::max<int64_t>(1, kParallelElements / n / 4), quantize);
  } else {
    quantize(0, rows);
  }
}

namespace {

// EXECUTORCH_LIBRARY's wrapper takes operators with one output; llmcore::quantize_rows.out
// has three, so it is unboxed here: the stack holds x, the outputs q, scales, zero_points,
// then the returned values (the same tensors). Each argument's kind is checked before it
// is read (EValue's accessors abort the process on a wrong one).
void quantize_rows_boxed(KernelRuntimeContext& ctx, executorch::runtime::Span<executorch::runtime::EValue*> stack) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "llmcore::quantize_rows.out");
  bool fits = stack.size() >= 4;
  for (size_t i = 0; fits && i < 4; ++i) fits = stack[i]->isTensor();
  ET_KERNEL_CHECK_MSG(ctx, fits, InvalidProgram, ,
                      "llmcore::quantize_rows.out: called with other arguments than (x, *, q, scales, zero_points)");
  quantize_rows_out(ctx, stack[0]->toTensor(), stack[1]->toTensor(), stack[2]->toTensor(), stack[3]->toTensor());
}

}  // namespace

}  // namespace llmcore_kernels

#ifndef LLMCORE_LLM_OPS_KEYED
// Run at load time of the executable that links these objects (llmcore_runner): the
// fallback kernels of these ops, for every dtype and dim order (the kernels refuse what
// they do not take).
EXECUTORCH_LIBRARY(llama, "update_cache.out", llmcore_kernels::update_cache_out);
EXECUTORCH_LIBRARY(llama, "update_cache_with_indices.out", llmcore_kernels::update_cache_with_indices_out);
EXECUTORCH_LIBRARY(llama, "custom_sdpa.out", llmcore_kernels::custom_sdpa_out);
EXECUTORCH_LIBRARY(llama, "custom_quantized_sdpa.out", llmcore_kernels::custom_quantized_sdpa_out);
#endif

// llmcore's own attention op: no other library registers it, so both builds do, under the
// fallback key (llmcore_runner and libllmcore_llm_ops.so are never in one process).
EXECUTORCH_LIBRARY(llmcore, "softcap_sdpa.out", llmcore_kernels::softcap_sdpa_out);
namespace {
const auto quantize_rows_registered = executorch::runtime::register_kernel(
    executorch::runtime::Kernel("llmcore::quantize_rows.out", llmcore_kernels::quantize_rows_boxed));
}  // namespace

#ifdef LLMCORE_LLM_OPS_KEYED
// The shared library a Python process loads (libllmcore_llm_ops.so). ExecuTorch's own LLM
// custom ops library registers llama::custom_sdpa.out there under the fallback kernel key,
// and registering one name under one key twice aborts the process. An ExecuTorch kernel
// key (the dtype and dim order of each tensor argument) is a different entry: the runtime
// picks the kernel whose key matches a call's tensors exactly, and the fallback only when
// none does. So here the attention kernel is registered for contiguous float32, float16 and
// bfloat16 queries, keys, values and out (a 16-bit KV cache calls it in the cache's type,
// --kv-cache-dtype; ExecuTorch's own kernel took a SmolLM2 prefill call of an fp16 cache 125
// ms), a float32 mask, and the two libraries load in either order. The keys list the tensor
// arguments in schema order, as a method builds them when it binds its kernels: query, key,
// value, the mask when given (2-D), out, and the returned out (the same tensor again) in the
// programs ExecuTorch emits; the forms without the returned value cover other emitters.
namespace {
// ScalarType codes: 6 float32, 5 float16, 15 bfloat16
#define LLMCORE_SDPA_KEYS(T)                                                          \
  "v1/" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3",         \
      "v1/" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3|6;0,1|" T ";0,1,2,3|" T ";0,1,2,3", \
      "v1/" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3",                    \
      "v1/" T ";0,1,2,3|" T ";0,1,2,3|" T ";0,1,2,3|6;0,1|" T ";0,1,2,3"
constexpr const char* kSdpaKeys[] = {LLMCORE_SDPA_KEYS("6"), LLMCORE_SDPA_KEYS("5"), LLMCORE_SDPA_KEYS("15")};
#undef LLMCORE_SDPA_KEYS
// llama::custom_quantized_sdpa.out of an int8 cache (code 1): int8 query, key and value, the
// mask when given, then each one's int8 zero points and float32 scales, out, the returned out
// (ExecuTorch's own kernel decoded a SmolLM2 int8-cache program at 45 tok/s where the runner
// did 188).
#define LLMCORE_Q8 "1;0,1,2,3|"
#define LLMCORE_QPARAMS LLMCORE_Q8 "6;0,1,2,3|" LLMCORE_Q8 "6;0,1,2,3|" LLMCORE_Q8 "6;0,1,2,3|"
constexpr const char* kQuantizedSdpaKeys[] = {
    "v1/" LLMCORE_Q8 LLMCORE_Q8 LLMCORE_Q8 LLMCORE_QPARAMS "6;0,1,2,3|6;0,1,2,3",
    "v1/" LLMCORE_Q8 LLMCORE_Q8 LLMCORE_Q8 "6;0,1|" LLMCORE_QPARAMS "6;0,1,2,3|6;0,1,2,3",
    "v1/" LLMCORE_Q8 LLMCORE_Q8 LLMCORE_Q8 LLMCORE_QPARAMS "6;0,1,2,3",
    "v1/" LLMCORE_Q8 LLMCORE_Q8 LLMCORE_Q8 "6;0,1|" LLMCORE_QPARAMS "6;0,1,2,3"};
#undef LLMCORE_QPARAMS
#undef LLMCORE_Q8

// Calls that reached this library's kernel: how a caller (a test, a benchmark) tells that
// the runtime picked it over the fallback.
std::atomic<uint64_t> keyed_sdpa_calls{0};

using executorch::aten::Tensor;

Tensor& keyed_custom_sdpa_out(executorch::runtime::KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k,
                              const Tensor& v, int64_t start_pos, const std::optional<Tensor>& attn_mask,
                              double dropout_p, bool is_causal, std::optional<double> scale, Tensor& out) {
  keyed_sdpa_calls.fetch_add(1, std::memory_order_relaxed);
  return llmcore_kernels::custom_sdpa_out(ctx, q, k, v, start_pos, attn_mask, dropout_p, is_causal, scale, out);
}

Tensor& keyed_custom_quantized_sdpa_out(
    executorch::runtime::KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t start_pos,
    const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
    const std::optional<Tensor>& q_zero_points, const std::optional<Tensor>& q_scales,
    const std::optional<Tensor>& k_zero_points, const std::optional<Tensor>& k_scales,
    const std::optional<Tensor>& v_zero_points, const std::optional<Tensor>& v_scales, bool is_seq_at_dim_2,
    Tensor& out) {
  keyed_sdpa_calls.fetch_add(1, std::memory_order_relaxed);
  return llmcore_kernels::custom_quantized_sdpa_out(ctx, q, k, v, start_pos, attn_mask, dropout_p, is_causal, scale,
                                                    q_zero_points, q_scales, k_zero_points, k_scales, v_zero_points,
                                                    v_scales, is_seq_at_dim_2, out);
}

constexpr char kSdpaName[] = "llama::custom_sdpa.out";
constexpr char kQuantizedSdpaName[] = "llama::custom_quantized_sdpa.out";

// One boxed kernel under each of `keys`: kernels[] outlives the registration (the registry
// keeps pointers into it).
template <size_t N>
executorch::runtime::Error register_keyed(const executorch::runtime::Kernel& boxed, const char* const (&keys)[N],
                                          executorch::runtime::Kernel (&kernels)[N]) {
  for (size_t i = 0; i < N; ++i) {
    kernels[i] = executorch::runtime::Kernel(boxed.name_, executorch::runtime::KernelKey(keys[i]), boxed.op_);
  }
  return executorch::runtime::register_kernels({kernels, N});
}

executorch::runtime::Error register_keyed_sdpa() {
  static executorch::runtime::Kernel sdpa[sizeof kSdpaKeys / sizeof *kSdpaKeys];
  static executorch::runtime::Kernel quantized[sizeof kQuantizedSdpaKeys / sizeof *kQuantizedSdpaKeys];
  const executorch::runtime::Error done = register_keyed(
      executorch::extension::make_boxed_kernel(kSdpaName, EXECUTORCH_FN(keyed_custom_sdpa_out, kSdpaName)),
      kSdpaKeys, sdpa);
  if (done != executorch::runtime::Error::Ok) return done;
  return register_keyed(executorch::extension::make_boxed_kernel(
                            kQuantizedSdpaName, EXECUTORCH_FN(keyed_custom_quantized_sdpa_out, kQuantizedSdpaName)),
                        kQuantizedSdpaKeys, quantized);
}

const executorch::runtime::Error keyed_sdpa_registered = register_keyed_sdpa();
}  // namespace

extern "C" __attribute__((visibility("default"))) uint64_t llmcore_llm_ops_sdpa_calls() {
  return keyed_sdpa_calls.load(std::memory_order_relaxed);
}
#endif
