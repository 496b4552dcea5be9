// llmcore::block_round_least_error: the export's int4 (or int8) rounding of a weight by
// blocks, each block's scale the candidate whose rounding costs the least output error
// (llmcore_xnnpack.qlinear's activation-aware int4 recipe; the export's, not a program's,
// operator: nothing here runs in a runtime).
//
// Why native: in Python each candidate is seven passes over the weight's float temporaries
// (scale, round, clamp, subtract, square, weigh, sum), 26 candidates a block; that was 16 s of
// a 1B model's 39 s quantize stage. Here a block's weights and energies are loaded once and
// every candidate is scored in registers; the steps around the search (the block's largest
// value, its candidates, its rounding, the error) are done on the same loads.
//
// Each candidate is scored with the float operations of the Python search
// (qlinear._least_output_error): 1/d by division, w * (1/d), rounding half to even, the clamp,
// (s - r)^2 * e, each rounded to float32 (this file is compiled with -ffp-contract=off: no
// fused multiply-add), the block's sum times d^2, the first candidate of the least error
// winning. Only the sum's order is this file's own, where torch picks one by CPU: eight
// lanes, the block's chunks of eight added into them in turn, then lanes 0-3 + 4-7, 0-1 + 2-3,
// 0 + 1. plugins/kernels/tests/test_scale_search.py checks the choices and integers bit for
// bit against that order written in torch, in every ISA view, and against the Python recipe.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

#include "cpu_isa.h"
#include "own_threads.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LLMCORE_SEARCH_AVX2 __attribute__((target("avx2")))
#define LLMCORE_SEARCH_AVX512 __attribute__((target("avx512f")))
#endif

namespace {

constexpr const char* kOp = "llmcore::block_round_least_error";
constexpr int64_t kLanes = 8;
constexpr int64_t kWideLanes = 16;  // candidates a register with AVX-512

// The candidate of the least error, the first of equal ones.
float first_least(const float* d, const float* errors, int64_t count) {
  float best_d = d[0], best_err = errors[0];
  for (int64_t c = 1; c < count; ++c) {
    if (errors[c] < best_err) best_err = errors[c], best_d = d[c];
  }
  return best_d;
}

// The error of scale d on one block, in lane_sum's order (portable C++: any CPU).
float block_error(const float* w, const float* e, int64_t block, float d, float qmin, float qmax) {
  const float inv = 1.0f / d;
  float lanes[kLanes] = {};  // (each written by the first chunk: block >= 8)
  for (int64_t chunk = 0; chunk < block; chunk += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float s = w[chunk + l] * inv;
      const float r = std::fmin(std::fmax(std::nearbyint(s), qmin), qmax);
      float t = s - r;
      t = t * t;
      t = t * e[chunk + l];
      lanes[l] = chunk == 0 ? t : lanes[l] + t;
    }
  }
  float half[4], quarter[2];
  for (int l = 0; l < 4; ++l) half[l] = lanes[l] + lanes[l + 4];
  for (int l = 0; l < 2; ++l) quarter[l] = half[l] + half[l + 2];
  return (quarter[0] + quarter[1]) * (d * d);
}

#ifdef LLMCORE_SEARCH_AVX2
// The same with eight candidates a register, one in each lane: weight j of the block is
// scored for all eight at once into accumulator j % 8, so that accumulator l holds, for each
// candidate, what lane_sum's lane l holds; the lanes' tree is then added register to register.
// Eight independent accumulators keep the pipes full, where one candidate a register waited
// on its own chain of adds and its horizontal sum (1.5x the time). `d` holds the block's
// candidates padded to a multiple of eight (the last lanes repeat the last candidate: a later
// equal error never wins; the operator pads to sixteen, for either); `errors` as many floats.
LLMCORE_SEARCH_AVX2 float block_best_avx2(const float* wb, const float* eb, int64_t block, const float* d,
                                          int64_t count, float qmin, float qmax, float* errors) {
  const __m256 lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax);
  const int64_t padded = (count + kLanes - 1) / kLanes * kLanes;
  for (int64_t c0 = 0; c0 < padded; c0 += kLanes) {
    const __m256 dc = _mm256_loadu_ps(d + c0);
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), dc);
    __m256 acc[kLanes];
    for (int64_t j = 0; j < block; ++j) {
      const __m256 x = _mm256_mul_ps(_mm256_broadcast_ss(wb + j), inv);
      const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                                   lo), hi);
      __m256 t = _mm256_sub_ps(x, r);
      t = _mm256_mul_ps(_mm256_mul_ps(t, t), _mm256_broadcast_ss(eb + j));
      acc[j % kLanes] = j < kLanes ? t : _mm256_add_ps(acc[j % kLanes], t);
    }
    __m256 half[4], quarter[2];
    for (int l = 0; l < 4; ++l) half[l] = _mm256_add_ps(acc[l], acc[l + 4]);
    for (int l = 0; l < 2; ++l) quarter[l] = _mm256_add_ps(half[l], half[l + 2]);
    const __m256 sum = _mm256_add_ps(quarter[0], quarter[1]);
    _mm256_storeu_ps(errors + c0, _mm256_mul_ps(sum, _mm256_mul_ps(dc, dc)));
  }
  return first_least(d, errors, count);
}

// The same with sixteen candidates a register (AVX-512): each lane's arithmetic and order are
// the AVX2 code's, so the same errors bit for bit, in half the instructions (26 candidates:
// two registers, not four). `d` and `errors` padded to a multiple of sixteen. (GCC 12 warns
// that the 512-bit intrinsics' own "undefined" values may be used uninitialized; they are
// not. Silenced here alone, as in int4_gemm_tiles.inc.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
LLMCORE_SEARCH_AVX512 float block_best_avx512(const float* wb, const float* eb, int64_t block, const float* d,
                                              int64_t count, float qmin, float qmax, float* errors) {
  const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax);
  const int64_t padded = (count + kWideLanes - 1) / kWideLanes * kWideLanes;
  for (int64_t c0 = 0; c0 < padded; c0 += kWideLanes) {
    const __m512 dc = _mm512_loadu_ps(d + c0);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), dc);
    __m512 acc[kLanes];
    for (int64_t j = 0; j < block; ++j) {
      const __m512 x = _mm512_mul_ps(_mm512_set1_ps(wb[j]), inv);
      const __m512 r = _mm512_min_ps(
          _mm512_max_ps(_mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      __m512 t = _mm512_sub_ps(x, r);
      t = _mm512_mul_ps(_mm512_mul_ps(t, t), _mm512_set1_ps(eb[j]));
      acc[j % kLanes] = j < kLanes ? t : _mm512_add_ps(acc[j % kLanes], t);
    }
    __m512 half[4], quarter[2];
    for (int l = 0; l < 4; ++l) half[l] = _mm512_add_ps(acc[l], acc[l + 4]);
    for (int l = 0; l < 2; ++l) quarter[l] = _mm512_add_ps(half[l], half[l + 2]);
    const __m512 sum = _mm512_add_ps(quarter[0], quarter[1]);
    _mm512_storeu_ps(errors + c0, _mm512_mul_ps(sum, _mm512_mul_ps(dc, dc)));
  }
  return first_least(d, errors, count);
}
#pragma GCC diagnostic pop
#endif

// float32 -> bfloat16 (rounding to nearest, ties to even, as torch's .to(torch.bfloat16))
// -> float32: a scale as XNNPACK's int4 GEMM keeps it. Finite inputs only.
float bf16_rounded(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One thread's part of a call: the call's arguments and the thread's scratch.
struct BlockRounding {
  const float* multipliers;  // [padded]: the call's, the last one repeated past `count`
  int64_t count, padded, block;
  float lo, hi;
  float* d;       // [padded]: a block's candidates
  float* errors;  // [padded]: their errors
};

// One block w -> q, its chosen scale returned, (d q - w)^2 and w^2 added to diff and norm.
float round_block_portable(const BlockRounding& r, const float* w, const float* e, int8_t* q, double& diff,
                           double& norm) {
  float amax = 0.0f;
  for (int64_t j = 0; j < r.block; ++j) amax = std::fmax(amax, std::fabs(w[j]));
  amax = std::fmax(amax, 1e-12f);
  for (int64_t c = 0; c < r.padded; ++c) r.d[c] = bf16_rounded(amax * r.multipliers[c]);
  for (int64_t c = 0; c < r.count; ++c) r.errors[c] = block_error(w, e, r.block, r.d[c], r.lo, r.hi);
  const float best = first_least(r.d, r.errors, r.count);
  const float inv = 1.0f / best;
  float block_diff = 0.0f, block_norm = 0.0f;
  for (int64_t j = 0; j < r.block; ++j) {
    const float rounded = std::fmin(std::fmax(std::nearbyint(w[j] * inv), r.lo), r.hi);
    q[j] = static_cast<int8_t>(rounded);
    const float err = rounded * best - w[j];
    block_diff += err * err;
    block_norm += w[j] * w[j];
  }
  diff += block_diff;
  norm += block_norm;
  return best;
}

#ifdef LLMCORE_SEARCH_AVX2
LLMCORE_SEARCH_AVX2 inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

LLMCORE_SEARCH_AVX2 inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// The same steps eight values a register, the search on AVX-512 where `wide`: the block's
// largest |w| (a maximum: exact in any order), its candidates rounded to bfloat16 as
// bf16_rounded rounds them, the rounding with the chosen scale (the same float operations
// as the portable code; the sums in an order of their own). On the portable steps around
// the AVX-512 search, the steps took as long as the search.
LLMCORE_SEARCH_AVX2 float round_block_avx2(const BlockRounding& r, const float* w, const float* e, int8_t* q,
                                           double& diff, double& norm, bool wide) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < r.block; j += kLanes)
    amax8 = _mm256_max_ps(amax8, _mm256_and_ps(_mm256_loadu_ps(w + j), magnitude));
  const __m256 amax = _mm256_set1_ps(std::fmax(hmax8(amax8), 1e-12f));
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), high = _mm256_set1_epi32(-65536);
  for (int64_t c = 0; c < r.padded; c += kLanes) {
    const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(amax, _mm256_loadu_ps(r.multipliers + c)));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(bits, bias), lsb), high);
    _mm256_storeu_ps(r.d + c, _mm256_castsi256_ps(rounded));
  }
  const float best = wide ? block_best_avx512(w, e, r.block, r.d, r.count, r.lo, r.hi, r.errors)
                          : block_best_avx2(w, e, r.block, r.d, r.count, r.lo, r.hi, r.errors);
  const __m256 d = _mm256_set1_ps(best), inv = _mm256_set1_ps(1.0f / best);
  const __m256 lo = _mm256_set1_ps(r.lo), hi = _mm256_set1_ps(r.hi);
  __m256 diff8 = _mm256_setzero_ps(), norm8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < r.block; j += kLanes) {
    const __m256 wv = _mm256_loadu_ps(w + j);
    const __m256 rounded = _mm256_min_ps(
        _mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(wv, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    const __m256i ints = _mm256_cvtps_epi32(rounded);  // exact: whole numbers in the int8 range
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + j), _mm_packs_epi16(words, words));
    const __m256 err = _mm256_sub_ps(_mm256_mul_ps(rounded, d), wv);
    diff8 = _mm256_add_ps(diff8, _mm256_mul_ps(err, err));
    norm8 = _mm256_add_ps(norm8, _mm256_mul_ps(wv, wv));
  }
  diff += hsum8(diff8);
  norm += hsum8(norm8);
  return best;
}
#endif

// w [rows, in] float32, energy [in / block, block], multipliers [count] -> (q [rows, in] int8,
// scales [rows, in / block] float32, float64 [2]: sum (d q - w)^2 and sum w^2): the 8da4w
// recipe's activation-aware rounding (llmcore_xnnpack.qlinear.int4_blocks_activation_aware) in
// one pass over the weight. Each block's candidates are amax * multipliers[c] (amax its
// largest |w|, at least 1e-12), rounded to bfloat16, and the chosen one rounds the block:
// q = w * (1 / d) rounded half to even into [qmin, qmax]. The same float operations as the
// recipe's torch code, so the same integers and scales as that code with this file's order
// of the sum (above); the error's sums are this file's (float a block, double across
// blocks): the recipe reports them. In torch, with only the search native, the steps around
// it were five of a 1B model's 12 seconds of int4 rounding, each a pass over the weight's
// float temporaries.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_round_least_error(const at::Tensor& w, const at::Tensor& energy,
                                                                       const at::Tensor& multipliers, int64_t block,
                                                                       int64_t qmin, int64_t qmax) {
  for (const at::Tensor* t : {&w, &energy, &multipliers})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), kOp, ": float32 CPU tensors only, got ",
                t->scalar_type());
  TORCH_CHECK(block > 0 && block % kLanes == 0, kOp, ": the block must be a multiple of 8, got ", block);
  TORCH_CHECK(w.dim() == 2 && w.size(1) % block == 0, kOp, ": w must be [rows, in] with in a multiple of ",
              block, ", got ", w.sizes());
  const int64_t rows = w.size(0), groups = w.size(1) / block;
  TORCH_CHECK(energy.dim() == 2 && energy.size(0) == groups && energy.size(1) == block, kOp,
              ": energy must be [in / block, block] = [", groups, ", ", block, "], got ", energy.sizes());
  TORCH_CHECK(multipliers.dim() == 1 && multipliers.size(0) > 0, kOp, ": multipliers must be 1-D, got ",
              multipliers.sizes());
  TORCH_CHECK(qmin < qmax && qmin >= -128 && qmax <= 127, kOp, ": [qmin, qmax] must be an int8 range");
  const at::Tensor wc = w.contiguous(), ec = energy.contiguous(), mc = multipliers.contiguous();
  at::Tensor q = at::empty({rows, groups * block}, w.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, groups}, w.options());
  const float *wp = wc.const_data_ptr<float>(), *ep = ec.const_data_ptr<float>(), *mp = mc.const_data_ptr<float>();
  int8_t* qp = q.mutable_data_ptr<int8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  const int64_t count = mc.size(0), padded = (count + kWideLanes - 1) / kWideLanes * kWideLanes;
  std::vector<float> padded_multipliers(padded);  // the last repeated: a later equal error never wins
  for (int64_t c = 0; c < padded; ++c) padded_multipliers[c] = mp[std::min(c, count - 1)];
  const llmcore_kernels::Isa isa = llmcore_kernels::kernels_isa();
  std::mutex sums_lock;
  double diff_sum = 0.0, norm_sum = 0.0;
  const auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> d(padded), errors(padded);
    const BlockRounding r{padded_multipliers.data(), count, padded, block, static_cast<float>(qmin),
                          static_cast<float>(qmax), d.data(), errors.data()};
    double diff = 0.0, norm = 0.0;
    for (int64_t b = begin; b < end; ++b) {
      const float* wb = wp + b * block;
      const float* eb = ep + (b % groups) * block;
#ifdef LLMCORE_SEARCH_AVX2
      if (isa >= llmcore_kernels::Isa::avx2) {
        sp[b] = round_block_avx2(r, wb, eb, qp + b * block, diff, norm, isa >= llmcore_kernels::Isa::avx512_vnni);
        continue;
      }
#endif
      (void)isa;
      sp[b] = round_block_portable(r, wb, eb, qp + b * block, diff, norm);
    }
    std::lock_guard<std::mutex> hold(sums_lock);
    diff_sum += diff;
    norm_sum += norm;
  };
  llmcore_kernels::aten::own_threads(rows * groups, 4096, body);  // each block whole on one thread
  at::Tensor sums = at::empty({2}, w.options().dtype(at::kDouble));
  sums.mutable_data_ptr<double>()[0] = diff_sum;
  sums.mutable_data_ptr<double>()[1] = norm_sum;
  return {q, scales, sums};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmcore, m) {
  m.def("block_round_least_error(Tensor w, Tensor energy, Tensor multipliers, int block, int qmin, int qmax) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmcore, CPU, m) {
  m.impl("block_round_least_error", TORCH_FN(block_round_least_error));
}
