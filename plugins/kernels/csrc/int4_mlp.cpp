// llmcore::int4_mlp.out: a gated MLP (SwiGLU) with int4 weights in one operator.
//
// Why: XNNPACK 1.5.1's AVX2 int4 GEMM widens nibbles to 16 bits and multiplies 16 pairs an
// instruction; int4_gemm.cpp multiplies 32 with vpmaddubsw, eight blocks a register, and
// prefetches the weight rows. On AVX2 that prefills faster than 8da4w's XNNPACK MLPs
// (plugins/kernels/README.md; docs/performance.md, "An int4 GEMM of our own"). One
// operator for the whole MLP, not one per linear, because an operator outside the delegate
// splits XNNPACK's partition where it stands: three projections and the SiLU between them
// would cut each block's partition into four, each piece a delegate call with its fixed
// cost. As one operator the MLP costs one cut per block.
//
// Registered with EXECUTORCH_LIBRARY into the runtime this library links, like
// llmcore::rms_norm (rms_norm.cpp).
#include "int4_mlp.h"
#include "int4_executorch.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace llmcore_kernels {

// Programs from before the arranged order (int4_gemm.h) hold [rows, in/2] weights: their
// bytes mean something else, so they are refused by their shape.
const char* const kPackedShapeError =
    "packed weights must be a contiguous [rows, in/32, 16] uint8 tensor, int8 weights [rows, in], or Q6_K "
    "super-blocks [rows, in/256, 210] "
    "(programs exported before the kernel's arranged layout hold [rows, in/2]: export it again)";

const char* int4_mlp_shape_error(const Int4MlpWeights& w) {
  const int64_t dim = w.gate_up.k, hidden = w.gate_up.n / 2;
  if (dim <= 0 || dim % int4::kBlock != 0) return "the model dimension must be a positive multiple of 32";
  if (w.gate_up.n % 2 != 0 || hidden % int4::kBlock != 0)
    return "gate_up must hold gate's and up's rows, a multiple of 32 each";
  if (w.down.k != hidden || w.down.n != dim) return "down must map the hidden size back to the model dimension";
  return nullptr;
}

const char* glu_activation(std::string_view name, GluActivation* out) {
  if (name == "silu") return *out = GluActivation::silu, nullptr;
  if (name == "gelu_tanh") return *out = GluActivation::gelu_tanh, nullptr;
  return "activation must be \"silu\" or \"gelu_tanh\"";
}

namespace {

constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)

#if defined(__x86_64__) && defined(__GNUC__)
#define LLMCORE_MLP_X86 1
#define LLMCORE_MLP_AVX2 __attribute__((target("avx2,fma")))

// exp(x) for eight floats, x clamped to [-87, 88] (the activations need no more: beyond,
// 1 + exp(-s) is 1 or overflows the quotient to 0 either way): x = n ln2 + r, |r| <= ln2/2, exp(r) by
// its degree-7 Taylor polynomial (relative error below 1e-7), 2^n put in the exponent.
LLMCORE_MLP_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203094172e-06f), r);     // ln2, low bits
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n in [-126, 127]: 2^n is a normal float
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// act(g) = g / (1 + exp(-s)) for eight floats: s = g for silu, 2 sqrt(2/pi) (g + 0.044715 g^3)
// for gelu_tanh.
LLMCORE_MLP_AVX2 inline __m256 act8(GluActivation activation, __m256 g) {
  __m256 s = g;
  if (activation == GluActivation::gelu_tanh) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    s = _mm256_mul_ps(_mm256_fmadd_ps(cube, _mm256_set1_ps(0.044715f), g), _mm256_set1_ps(kTwoSqrtTwoOverPi));
  }
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), s));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// glu_times (below) over the whole eights of [0, count); returns where it stopped.
LLMCORE_MLP_AVX2 int64_t glu_times_avx2(GluActivation activation, const float* gu, int64_t count, float* h) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 a = _mm256_loadu_ps(gu + 2 * j), b = _mm256_loadu_ps(gu + 2 * j + 8);
    // per 128-bit lane: a's and b's even (gate) / odd (up) elements, then lanes in order
    const __m256 g = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), 0xd8));
    const __m256 u = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), 0xd8));
    _mm256_storeu_ps(h + j, _mm256_mul_ps(act8(activation, g), u));
  }
  return j;
}

// activate (below) over the whole eights of [0, count); returns where it stopped.
LLMCORE_MLP_AVX2 int64_t activate_avx2(GluActivation activation, float* y, int64_t count) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) _mm256_storeu_ps(y + j, act8(activation, _mm256_loadu_ps(y + j)));
  return j;
}

#else
#define LLMCORE_MLP_X86 0
#endif

// act(g), one float at a time (the portable loops, and what the eights leave).
inline float act1(GluActivation activation, float g) {
  const float s = activation == GluActivation::gelu_tanh ? (g + 0.044715f * (g * g * g)) * kTwoSqrtTwoOverPi : g;
  return g / (1.0f + std::exp(-s));
}

// h[j] = act(gu[2j]) * gu[2j + 1] for j in [0, count): gate and up interleaved.
void glu_times(GluActivation activation, const float* gu, int64_t count, float* h) {
  int64_t j = 0;
#if LLMCORE_MLP_X86
  if (int4::uses_avx2()) j = glu_times_avx2(activation, gu, count, h);  // the GEMM's CPU check
#endif
  for (; j < count; ++j) h[j] = act1(activation, gu[2 * j]) * gu[2 * j + 1];
}

}  // namespace

void activate(GluActivation activation, float* y, int64_t count) {
  int64_t j = 0;
#if LLMCORE_MLP_X86
  if (int4::uses_avx2()) j = activate_avx2(activation, y, count);
#endif
  for (; j < count; ++j) y[j] = act1(activation, y[j]);
}

#if LLMCORE_MLP_X86
// add_residual_columns eight columns at a time (below): one row's [n_begin, n_end); returns
// where it stopped. Written out because the baseline build's loop adds four floats at a
// time, with a scalar prologue and tail for each of a prompt's short rows (gemm_all's slices
// of 48 columns) (docs/performance.md, "What was tried": RoPE and the residual add eight
// channels a step).
static LLMCORE_MLP_AVX2 int64_t add_row_avx2(const float* residual, const float* y, int64_t n_begin, int64_t n_end,
                                             float* out) {
  int64_t n = n_begin;
  for (; n + 8 <= n_end; n += 8)
    _mm256_storeu_ps(out + n, _mm256_add_ps(_mm256_loadu_ps(residual + n), _mm256_loadu_ps(y + n)));
  return n;
}
#endif

void add_residual_columns(const float* residual, const float* y, int64_t rows, int64_t width, int64_t n_begin,
                          int64_t n_end, float* out) {
#if LLMCORE_MLP_X86
  const bool avx2 = int4::uses_avx2();  // the GEMM's CPU check
#endif
  for (int64_t t = 0; t < rows; ++t) {
    const float *rt = residual + t * width, *yt = y + t * width;
    float* ot = out + t * width;
    int64_t n = n_begin;
#if LLMCORE_MLP_X86
    if (avx2) n = add_row_avx2(rt, yt, n_begin, n_end, ot);
#endif
    for (; n < n_end; ++n) ot[n] = rt[n] + yt[n];
  }
}

int4::QuantizedRows RoundedRows::round(const float* x, int64_t rows, const ParallelFor& parallel,
                                       const int4::PackedWeight& w, const RangeWork& prepare) {
  const int64_t k = w.k;
  // per block for the weights whose blocks meet the activations' blocks (int4 blocks, Q4_K,
  // int8 blocks); per row for int8 rows and Q6_K (int4_gemm.h, QuantizedRows)
  const bool block_means = int4::needs_block_means(w), lanes = int4::arranged_rows(w),
             int8_blocks = w.format == int4::Format::int8_blocks;
  const int64_t blocks = k / int4::kBlock, slots = lanes ? int4::group_count(blocks) : 0;
  a.resize(rows * k);
  scale.resize(rows);
  zero.resize(rows);
  means.resize(block_means ? rows * blocks : 0);
  lane_scales.resize(rows * slots * 8);
  lane_shifts.resize(rows * slots * 8);
  block_scales.resize(int8_blocks ? rows * blocks : 0);
  uint8_t* pa = a.data();
  float *ps = scale.data(), *pz = zero.data(), *pm = means.data();
  const int4::BlockRounding by_block{lanes, lane_scales.data(), lane_shifts.data(), block_scales.data()};
  auto body = [&](int64_t b, int64_t e) {
    if (prepare) prepare(b, e);
    float* const block_means_out = block_means ? pm : nullptr;
    if (lanes || int8_blocks)
      int4::quantize_blocks(x, k, b, e, pa, by_block, ps, pz, /*portable=*/false, block_means_out);
    else
      int4::quantize_rows(x, k, b, e, pa, ps, pz, /*arranged=*/false, /*portable=*/false, block_means_out);
  };
  if (rows == 1)
    body(0, 1);  // one token: not worth waking the pool
  else
    parallel(0, rows, body);
  return {pa,
          ps,
          pz,
          rows,
          k,
          block_means ? pm : nullptr,
          lanes ? lane_scales.data() : nullptr,
          lanes ? lane_shifts.data() : nullptr,
          slots,
          int8_blocks ? block_scales.data() : nullptr};
}

// y's columns [n_begin, n_end) = x W^T for them, with W's block offsets when it has them.
static void gemm_columns(const int4::QuantizedRows& x, const int4::PackedWeight& w, int64_t n_begin, int64_t n_end,
                         float* y) {
  int4::gemm_rows(x, w, n_begin, n_end, y);
  if (w.offsets != nullptr) int4::add_block_offsets(x, w, n_begin, n_end, y);
}

// A prompt's columns of a weight with block offsets, in slices of this many: the offsets
// pass (and `finish`) read a slice's outputs right after the GEMM wrote them, from L1 (66
// tokens x 48 columns: 12.4 KiB), not from L2 after a thread's whole range (SmolLM2's
// gate_up: 66 x 1536 columns, 396 KiB). A 66-token prefill of SmolLM2's Q4_1 program took
// 43.5-43.7 ms against 44.3-45.1 in one pass (Xeon, Python, min of 30); without offsets the
// slices cost 1-3% (37.9-38.5 against 36.9-37.3 ms), so such weights keep one pass. A
// multiple of every tile's row count (3, 6) and of the offsets' 16, so that the tiles start
// where they did without slices and compute the same floats.
constexpr int64_t kPromptColumns = 48;

void gemm_all(const int4::QuantizedRows& x, const int4::PackedWeight& w, float* y, const ParallelFor& parallel,
              const RangeWork& finish) {
  parallel(0, (w.n + 1) / 2, [&](int64_t b, int64_t e) {
    const int64_t n_begin = 2 * b, n_end = std::min(2 * e, w.n);
    const int64_t slice = x.m >= 2 && w.offsets != nullptr ? kPromptColumns : n_end - n_begin;
    for (int64_t n = n_begin; n < n_end; n += slice) {
      const int64_t n_stop = std::min(n + slice, n_end);
      gemm_columns(x, w, n, n_stop, y);
      if (finish) finish(n, n_stop);
    }
  });
}

void int4_mlp_forward(const float* x, int64_t rows, const Int4MlpWeights& w, float* out, const ParallelFor& parallel,
                      const RangeWork& prepare, const float* residual) {
  const int64_t hidden = w.gate_up.n / 2, dim = w.down.n;
  // Scratch of the calling thread, kept between calls (a decode step reuses it).
  thread_local RoundedRows rounded_x, rounded_h;
  thread_local std::vector<float> gate_up, h, down;
  gate_up.resize(rows * 2 * hidden);
  h.resize(rows * hidden);
  float *gu = gate_up.data(), *hv = h.data();

  const int4::QuantizedRows qx = rounded_x.round(x, rows, parallel, w.gate_up, prepare);
  // gate_up's rows interleave gate and up (row 2j: gate j, row 2j + 1: up j): a thread that
  // computes the columns [2b, 2e) has what act(gate) * up needs for hidden units [b, e).
  gemm_all(qx, w.gate_up, gu, parallel, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t t = 0; t < rows; ++t)
      glu_times(w.activation, gu + t * 2 * hidden + n_begin, (n_end - n_begin) / 2, hv + t * hidden + n_begin / 2);
  });
  const int4::QuantizedRows qh = rounded_h.round(hv, rows, parallel, w.down);
  if (residual == nullptr) return gemm_all(qh, w.down, out, parallel);
  down.resize(rows * dim);
  float* dv = down.data();
  gemm_all(qh, w.down, dv, parallel, [&](int64_t n_begin, int64_t n_end) {
    add_residual_columns(residual, dv, rows, dim, n_begin, n_end, out);  // h + mlp(norm(h))
  });
}

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;


// llmcore::int4_mlp.out(Tensor x, Tensor gate_up, Tensor gate_up_scales, Tensor gate_up_sums,
//     Tensor down, Tensor down_scales, Tensor down_sums, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_mlp_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& gate_up, const Tensor& gate_up_scales,
                     const Tensor& gate_up_sums, const Tensor& down, const Tensor& down_scales,
                     const Tensor& down_sums, Tensor& out) {
  Int4MlpWeights w{};
  const char* part = "";
  const char* why = et::mlp_weights(gate_up, gate_up_scales, gate_up_sums, down, down_scales, down_sums, &w, &part);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "llmcore::int4_mlp: %s%s", part, why);
  ET_KERNEL_CHECK_MSG(ctx, x.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float,
                      InvalidType, out, "llmcore::int4_mlp: x and out must be float32");
  ET_KERNEL_CHECK_MSG(ctx, x.dim() >= 1 && x.size(x.dim() - 1) == w.gate_up.k, InvalidArgument, out,
                      "llmcore::int4_mlp: x's last size must be the model dimension (%lld)",
                      (long long)w.gate_up.k);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, x.sizes()) == Error::Ok, InvalidArgument, out);
  ET_KERNEL_CHECK_MSG(ctx, et::dense(x) && et::dense(out), InvalidArgument, out,
                      "llmcore::int4_mlp: x and out must be contiguous");
  if (x.numel() == 0) return out;
  int4_mlp_forward(x.const_data_ptr<float>(), x.numel() / w.gate_up.k, w, out.mutable_data_ptr<float>(),
                   et::runtime_parallel);
  return out;
}

}  // namespace llmcore_kernels

EXECUTORCH_LIBRARY(llmcore, "int4_mlp.out", llmcore_kernels::int4_mlp_out);
