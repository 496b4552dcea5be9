// The int4 x int8 GEMM of llmcore::int4_mlp (see int4_gemm.h): activation rounding, and
// the products in AVX2 (vpmaddubsw) or, on other CPUs, in portable loops.
//
// Built with -ffp-contract=off: the activation rounding mirrors torch's
// quantize_per_token operation for operation (x * (1 / s) + z in double, then round half
// to even), so that the integers here are the integers torch computes; a fused
// multiply-add would round once where torch rounds twice.
#include "int4_gemm.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LLMCORE_HAVE_X86 1
#define LLMCORE_AVX2 __attribute__((target("avx2,fma")))
#else
#define LLMCORE_HAVE_X86 0
#endif

namespace llmcore_kernels {
namespace int4 {
namespace {

// bfloat16 bits -> float: the upper half of a float's bits.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// torch's choose_qparams_per_token_asymmetric for one row, in its own precision (float32).
void row_qparams(float lo, float hi, float* scale, float* zero) {
  const float min_neg = std::min(lo, 0.0f);
  const float max_pos = std::max(hi, 0.0f);
  float s = (max_pos - min_neg) / 255.0f;
  s = std::max(s, FLT_EPSILON);
  const float descaled_min = min_neg / s;
  const float descaled_max = max_pos / s;
  const float from_min_error = -128.0f + descaled_min;
  const float from_max_error = 127.0f + descaled_max;
  float z = (from_min_error + from_max_error > 0.0f) ? -128.0f - descaled_min : 127.0f - descaled_max;
  z = std::nearbyint(std::min(std::max(z, -128.0f), 127.0f));
  *scale = s;
  *zero = z;
}

void quantize_row_portable(const float* x, int64_t k, double inv, double zero, uint8_t* a) {
  for (int64_t i = 0; i < k; ++i) {
    double v = std::nearbyint(static_cast<double>(x[i]) * inv + zero);
    v = std::min(std::max(v, -128.0), 127.0);
    a[i] = static_cast<uint8_t>(static_cast<int>(v) + 128);
  }
}

void min_max_portable(const float* x, int64_t k, float* lo, float* hi) {
  float a = x[0], b = x[0];
  for (int64_t i = 1; i < k; ++i) {
    a = std::min(a, x[i]);
    b = std::max(b, x[i]);
  }
  *lo = a;
  *hi = b;
}

#if LLMCORE_HAVE_X86
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

LLMCORE_AVX2 void min_max_avx2(const float* x, int64_t k, float* lo, float* hi) {
  __m256 a = _mm256_set1_ps(x[0]), b = a;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a = _mm256_min_ps(a, v);
    b = _mm256_max_ps(b, v);
  }
  alignas(32) float la[8], lb[8];
  _mm256_store_ps(la, a);
  _mm256_store_ps(lb, b);
  float mn = la[0], mx = lb[0];
  for (int j = 1; j < 8; ++j) {
    mn = std::min(mn, la[j]);
    mx = std::max(mx, lb[j]);
  }
  for (; i < k; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
  }
  *lo = mn;
  *hi = mx;
}

// Eight values: round(x * inv + zero) in double, clamped, as int32 lanes.
LLMCORE_AVX2 inline __m256i round8(const float* x, __m256d inv, __m256d zero, __m256d qmin, __m256d qmax) {
  const __m256 v = _mm256_loadu_ps(x);
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  lo = _mm256_add_pd(_mm256_mul_pd(lo, inv), zero);
  hi = _mm256_add_pd(_mm256_mul_pd(hi, inv), zero);
  lo = _mm256_round_pd(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  hi = _mm256_round_pd(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  lo = _mm256_min_pd(_mm256_max_pd(lo, qmin), qmax);
  hi = _mm256_min_pd(_mm256_max_pd(hi, qmin), qmax);
  return _mm256_set_m128i(_mm256_cvtpd_epi32(hi), _mm256_cvtpd_epi32(lo));
}

// One row, k a multiple of 32: 32 values a step, packed to int8 in order, stored + 128.
LLMCORE_AVX2 void quantize_row_avx2(const float* x, int64_t k, double inv_d, double zero_d, uint8_t* a) {
  const __m256d inv = _mm256_set1_pd(inv_d), zero = _mm256_set1_pd(zero_d);
  const __m256d qmin = _mm256_set1_pd(-128.0), qmax = _mm256_set1_pd(127.0);
  // packs interleave 128-bit lanes; this permutation puts the 32 bytes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));  // q + 128 as a byte: flip the sign bit
  for (int64_t i = 0; i < k; i += 32) {
    const __m256i r0 = round8(x + i, inv, zero, qmin, qmax);
    const __m256i r1 = round8(x + i + 8, inv, zero, qmin, qmax);
    const __m256i r2 = round8(x + i + 16, inv, zero, qmin, qmax);
    const __m256i r3 = round8(x + i + 24, inv, zero, qmin, qmax);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1), _mm256_packs_epi32(r2, r3));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i), _mm256_xor_si256(ordered, offset));
  }
}

LLMCORE_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block's 16 bytes as 32 signed bytes u - 8 in [-8, 7], the block's order.
LLMCORE_AVX2 inline __m256i unpack_block(const uint8_t* p, __m256i low_nibbles, __m256i eight) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_sub_epi8(_mm256_and_si256(both, low_nibbles), eight);
}

// acc + (x . w over one block) * d, the dot in 32-bit lanes: u8 x s8 pairs summed to 16 bits
// (|sum| <= 2 * 255 * 8: no saturation), then to 32.
LLMCORE_AVX2 inline __m256 multiply_add(__m256 acc, __m256i xv, __m256i wv, __m256i ones, const float* d) {
  const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(xv, wv), ones));
  return _mm256_fmadd_ps(sums, _mm256_broadcast_ss(d), acc);
}

// How far ahead of the block being multiplied its row's weights are prefetched. The
// hardware prefetcher alone left one decode pass of SmolLM2's 210 layers at 3.1 ms on two
// threads; 2 KiB ahead, 2.3 ms (256 B: 2.7, 8 KiB: 2.2, 16 KiB: 2.8).
constexpr int64_t kPrefetchBytes = 2048;

// MR rows of x times NR rows of w over all blocks: MR x NR dot products (before the
// per-row corrections), each as 8 float lanes to be summed.
template <int MR, int NR>
LLMCORE_AVX2 inline void tile(const QuantizedRows& x, int64_t m0, const PackedWeight& w, int64_t n0,
                              const float* scales /* [NR][blocks] */, int64_t blocks, float* dots /* [MR][NR] */) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i eight = _mm256_set1_epi8(8);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NR];
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm256_setzero_ps();
  const int64_t row_bytes = w.k / 2;
  for (int64_t g = 0; g < blocks; ++g) {
    // One prefetch per 64-byte line of each weight row, kPrefetchBytes ahead (past the
    // row's end it lands in the next rows, which come next).
    if ((g & 3) == 0)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w.packed + (n0 + r) * row_bytes + g * 16 + kPrefetchBytes),
                     _MM_HINT_T0);
    __m256i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = unpack_block(w.packed + (n0 + r) * row_bytes + g * 16, low_nibbles, eight);
    for (int t = 0; t < MR; ++t) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a + (m0 + t) * x.k + g * kBlock));
      for (int r = 0; r < NR; ++r) acc[t][r] = multiply_add(acc[t][r], xv, wv[r], ones, scales + r * blocks + g);
    }
  }
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) dots[t * NR + r] = hsum(acc[t][r]);
}

LLMCORE_AVX2 void convert_scales_avx2(const uint16_t* h, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(wide, 16));
  }
  for (; i < count; ++i) out[i] = bf16_to_float(h[i]);
}
#endif  // LLMCORE_HAVE_X86

// u of value j of block g in a packed row (the layout of int4_gemm.h).
inline int nibble(const uint8_t* row, int64_t g, int j) {
  const uint8_t byte = row[g * 16 + (j & 15)];
  return j < 16 ? byte & 0x0f : byte >> 4;
}

// y[t, n] from sum_g d_g D_g (`dot`): the zero point's and the offset's correction, the
// activation scale, the bias.
inline void finish(const QuantizedRows& x, int64_t t, const PackedWeight& w, int64_t n, float dot, float* y) {
  float v = x.scale[t] * (dot - (128.0f + x.zero[t]) * w.row_sums[n]);
  if (w.bias != nullptr) v += w.bias[n];
  y[t * w.n + n] = v;
}

void gemm_rows_portable(const QuantizedRows& x, const PackedWeight& w, int64_t n_begin, int64_t n_end, float* y) {
  const int64_t blocks = w.k / kBlock;
  const int64_t row_bytes = w.k / 2;
  thread_local std::vector<float> converted;  // the row's scales as floats
  converted.resize(blocks);
  float* scales = converted.data();
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t g = 0; g < blocks; ++g) scales[g] = bf16_to_float(w.scales[n * blocks + g]);
    for (int64_t t = 0; t < x.m; ++t) {
      const uint8_t* a = x.a + t * x.k;
      float dot = 0.0f;
      for (int64_t g = 0; g < blocks; ++g) {
        int32_t d = 0;
        for (int j = 0; j < kBlock; ++j) d += a[g * kBlock + j] * (nibble(w.packed + n * row_bytes, g, j) - 8);
        dot += scales[g] * static_cast<float>(d);
      }
      finish(x, t, w, n, dot, y);
    }
  }
}

#if LLMCORE_HAVE_X86
// Rows of w in fours (each x row's activations read once for four weight rows), x rows
// in fours within them (each unpacked weight block used four times): the unpacking is
// paid once per four rows of a prompt.
template <int MR, int NR>
LLMCORE_AVX2 void tiles_for_rows(const QuantizedRows& x, const PackedWeight& w, int64_t n0, const float* scales,
                                 int64_t blocks, float* y) {
  float dots[MR * NR];
  int64_t t = 0;
  for (; t + MR <= x.m; t += MR) {
    tile<MR, NR>(x, t, w, n0, scales, blocks, dots);
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) finish(x, t + i, w, n0 + r, dots[i * NR + r], y);
  }
  for (; t < x.m; ++t) {
    tile<1, NR>(x, t, w, n0, scales, blocks, dots);
    for (int r = 0; r < NR; ++r) finish(x, t, w, n0 + r, dots[r], y);
  }
}

LLMCORE_AVX2 void gemm_rows_avx2(const QuantizedRows& x, const PackedWeight& w, int64_t n_begin, int64_t n_end,
                                 float* y) {
  const int64_t blocks = w.k / kBlock;
  constexpr int NR = 2;  // 2 and 4 measured alike
  thread_local std::vector<float> converted;  // NR rows' scales as floats
  converted.resize(NR * blocks);
  float* scales = converted.data();
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {
    convert_scales_avx2(w.scales + n * blocks, NR * blocks, scales);
    if (x.m >= 4)
      tiles_for_rows<4, NR>(x, w, n, scales, blocks, y);
    else
      tiles_for_rows<1, NR>(x, w, n, scales, blocks, y);
  }
  for (; n < n_end; ++n) {
    convert_scales_avx2(w.scales + n * blocks, blocks, scales);
    tiles_for_rows<1, 1>(x, w, n, scales, blocks, y);
  }
}
#endif

}  // namespace

void pack_row(const int8_t* q, int64_t k, uint8_t* out) {
  for (int64_t g = 0; g < k / kBlock; ++g)
    for (int j = 0; j < 16; ++j)
      out[g * 16 + j] = static_cast<uint8_t>((q[g * kBlock + j] + 8) | ((q[g * kBlock + 16 + j] + 8) << 4));
}

bool uses_avx2() {
#if LLMCORE_HAVE_X86
  return cpu_has_avx2();
#else
  return false;
#endif
}

void quantize_rows(const float* x, int64_t k, int64_t row_begin, int64_t row_end, uint8_t* a, float* scale,
                   float* zero, bool portable) {
#if LLMCORE_HAVE_X86
  const bool avx2 = !portable && cpu_has_avx2();
#else
  (void)portable;
#endif
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float* xr = x + t * k;
    uint8_t* ar = a + t * k;
    float lo, hi;
#if LLMCORE_HAVE_X86
    if (avx2)
      min_max_avx2(xr, k, &lo, &hi);
    else
#endif
      min_max_portable(xr, k, &lo, &hi);
    row_qparams(lo, hi, &scale[t], &zero[t]);
    // torch: input.mul(1.0 / scales) with scales in float64
    const double inv = 1.0 / static_cast<double>(scale[t]);
#if LLMCORE_HAVE_X86
    if (avx2)
      quantize_row_avx2(xr, k, inv, zero[t], ar);
    else
#endif
      quantize_row_portable(xr, k, inv, zero[t], ar);
  }
}

void gemm_rows(const QuantizedRows& x, const PackedWeight& w, int64_t n_begin, int64_t n_end, float* y,
               bool portable) {
#if LLMCORE_HAVE_X86
  if (!portable && cpu_has_avx2()) {
    gemm_rows_avx2(x, w, n_begin, n_end, y);
    return;
  }
#endif
  gemm_rows_portable(x, w, n_begin, n_end, y);
}

}  // namespace int4
}  // namespace llmcore_kernels
