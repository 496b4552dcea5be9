// llmcore::block_scale_search: the export's search for each block's scale among candidates,
// the one whose rounding costs the least output error (llmcore_xnnpack.qlinear's
// activation-aware int4 recipe; the export's, not a program's, operator: nothing here runs in
// a runtime).
//
// Why native: in Python each candidate is seven passes over the weight's float temporaries
// (scale, round, clamp, subtract, square, weigh, sum), 26 candidates a block; that was 16 s of
// a 1B model's 39 s quantize stage. Here a block's weights and energies are loaded once and
// every candidate is scored in registers.
//
// Each candidate is scored with the float operations of the Python search
// (qlinear._least_output_error): 1/d by division, w * (1/d), rounding half to even, the clamp,
// (s - r)^2 * e, each rounded to float32 (this file is compiled with -ffp-contract=off: no
// fused multiply-add), the block's sum times d^2, the first candidate of the least error
// winning. Only the sum's order is this file's own, where torch picks one by CPU: eight
// lanes, the block's chunks of eight added into them in turn, then lanes 0-3 + 4-7, 0-1 + 2-3,
// 0 + 1. plugins/kernels/tests/test_scale_search.py checks the choices bit for bit against
// that order written in torch, in every ISA view, and against the Python search.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_isa.h"
#include "own_threads.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LLMCORE_SEARCH_AVX2 __attribute__((target("avx2")))
#endif

namespace {

constexpr const char* kOp = "llmcore::block_scale_search";
constexpr int64_t kLanes = 8;

struct Search {
  const float* w;           // [blocks, block]: blocks = rows * groups
  const float* energy;      // [groups, block]
  const float* candidates;  // [blocks, count]
  int64_t groups, block, count;
  float qmin, qmax;
  float* best;  // [blocks]
};

// The error of scale d on one block, in lane_sum's order (portable C++: any CPU).
float block_error(const float* w, const float* e, int64_t block, float d, float qmin, float qmax) {
  const float inv = 1.0f / d;
  float lanes[kLanes];
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

void search_portable(const Search& s, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const float* w = s.w + b * s.block;
    const float* e = s.energy + (b % s.groups) * s.block;
    const float* d = s.candidates + b * s.count;
    float best_d = d[0], best_err = block_error(w, e, s.block, d[0], s.qmin, s.qmax);
    for (int64_t c = 1; c < s.count; ++c) {
      const float err = block_error(w, e, s.block, d[c], s.qmin, s.qmax);
      if (err < best_err) best_err = err, best_d = d[c];
    }
    s.best[b] = best_d;
  }
}

#ifdef LLMCORE_SEARCH_AVX2
// The same with eight candidates a register, one in each lane: weight j of the block is
// scored for all eight at once into accumulator j % 8, so that accumulator l holds, for each
// candidate, what lane_sum's lane l holds; the lanes' tree is then added register to register.
// Eight independent accumulators keep the pipes full, where one candidate a register waited
// on its own chain of adds and its horizontal sum (1.5x the time).
LLMCORE_SEARCH_AVX2 void search_avx2(const Search& s, int64_t begin, int64_t end) {
  const __m256 lo = _mm256_set1_ps(s.qmin), hi = _mm256_set1_ps(s.qmax);
  const int64_t padded = (s.count + kLanes - 1) / kLanes * kLanes;
  std::vector<float> d(padded), errors(padded);
  for (int64_t b = begin; b < end; ++b) {
    const float* wb = s.w + b * s.block;
    const float* eb = s.energy + (b % s.groups) * s.block;
    const float* candidates = s.candidates + b * s.count;
    // the last lanes repeat the last candidate: a later equal error never wins
    for (int64_t c = 0; c < padded; ++c) d[c] = candidates[std::min(c, s.count - 1)];
    for (int64_t c0 = 0; c0 < padded; c0 += kLanes) {
      const __m256 dc = _mm256_loadu_ps(d.data() + c0);
      const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), dc);
      __m256 acc[kLanes];
      for (int64_t j = 0; j < s.block; ++j) {
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
      _mm256_storeu_ps(errors.data() + c0, _mm256_mul_ps(sum, _mm256_mul_ps(dc, dc)));
    }
    float best_d = d[0], best_err = errors[0];
    for (int64_t c = 1; c < s.count; ++c) {
      if (errors[c] < best_err) best_err = errors[c], best_d = d[c];
    }
    s.best[b] = best_d;
  }
}
#endif

// w [rows, groups, block], energy [groups, block], candidates [rows, groups, count] (each
// block's scales to try, in order), all float32 -> [rows, groups]: each block's candidate of
// the least sum_j energy_j (w_j / d - q_j)^2 * d^2, q_j being w_j / d rounded into [qmin, qmax].
at::Tensor block_scale_search(const at::Tensor& w, const at::Tensor& energy, const at::Tensor& candidates,
                              int64_t qmin, int64_t qmax) {
  for (const at::Tensor* t : {&w, &energy, &candidates})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), kOp, ": float32 CPU tensors only, got ",
                t->scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) > 0 && w.size(2) % kLanes == 0, kOp,
              ": w must be [rows, groups, block] with a block a multiple of 8, got ", w.sizes());
  const int64_t rows = w.size(0), groups = w.size(1), block = w.size(2);
  TORCH_CHECK(energy.dim() == 2 && energy.size(0) == groups && energy.size(1) == block, kOp,
              ": energy must be [groups, block] = [", groups, ", ", block, "], got ", energy.sizes());
  TORCH_CHECK(candidates.dim() == 3 && candidates.size(0) == rows && candidates.size(1) == groups &&
                  candidates.size(2) > 0,
              kOp, ": candidates must be [rows, groups, count] = [", rows, ", ", groups, ", count], got ",
              candidates.sizes());
  TORCH_CHECK(qmin < qmax, kOp, ": qmin must be below qmax");
  const at::Tensor wc = w.contiguous(), ec = energy.contiguous(), cc = candidates.contiguous();
  at::Tensor best = at::empty({rows, groups}, w.options());
  Search s{wc.const_data_ptr<float>(), ec.const_data_ptr<float>(), cc.const_data_ptr<float>(), groups, block,
           candidates.size(2), static_cast<float>(qmin), static_cast<float>(qmax), best.mutable_data_ptr<float>()};
  const bool avx2 = llmcore_kernels::kernels_isa() >= llmcore_kernels::Isa::avx2;
  const auto body = [&](int64_t begin, int64_t end) {
#ifdef LLMCORE_SEARCH_AVX2
    if (avx2) return search_avx2(s, begin, end);
#endif
    (void)avx2;
    search_portable(s, begin, end);
  };
  // Each block is scored whole by one thread, so the choice does not depend on the split;
  // threads of its own (own_threads.h). A call scores ~30k blocks.
  llmcore_kernels::aten::own_threads(rows * groups, 4096, body);
  return best;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmcore, m) {
  m.def("block_scale_search(Tensor w, Tensor energy, Tensor candidates, int qmin, int qmax) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmcore, CPU, m) { m.impl("block_scale_search", TORCH_FN(block_scale_search)); }
