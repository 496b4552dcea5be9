// llmcore-kernels: the gated MLP of llmcore::int4_mlp on plain buffers.
//
//   out = down(act(gate(x)) * up(x))      act: silu (SwiGLU) or tanh-approximated GELU (GeGLU)
//
// with each projection an int4 GEMM on int8 activations (int4_gemm.h): x is rounded to
// int8 per row once for gate and up, and silu(gate) * up once for down, as the 8da4w
// programs' linears round their inputs. The ExecuTorch kernel (int4_mlp.cpp) and the
// PyTorch registration (int4_mlp_aten.cpp) both call int4_mlp_forward, each with its
// runtime's parallel_for: eager PyTorch computes what the program computes.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "int4_gemm.h"

#if defined(__GNUC__)
#define LLMCORE_KERNELS_CXX_API __attribute__((visibility("default")))
#else
#define LLMCORE_KERNELS_CXX_API
#endif

namespace llmcore_kernels {

// The gate's activation. gelu_tanh is F.gelu(g, approximate="tanh") (Gemma's GeGLU),
// computed as g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), which is 0.5 g (1 + tanh(..))
// without the tanh: the same exp-and-divide as silu's g * sigmoid(g).
enum class GluActivation { silu, gelu_tanh };

// The activation an operator's `activation` argument names ("silu", "gelu_tanh"), or
// nullptr with *out unset when it names none.
LLMCORE_KERNELS_CXX_API const char* glu_activation(std::string_view name, GluActivation* out);

// y[j] = act(y[j]) for j in [0, count): the activation of a plain (not gated) MLP, GPT-2's.
LLMCORE_KERNELS_CXX_API void activate(GluActivation activation, float* y, int64_t count);

// out[t, n] = residual[t, n] + y[t, n] for every row t of [rows, width] matrices and n in
// [n_begin, n_end): a `finish` (gemm_all) that adds a layer's input back, residual first, the
// order of `h + f(h)` in the modules. out may be residual.
LLMCORE_KERNELS_CXX_API void add_residual_columns(const float* residual, const float* y, int64_t rows, int64_t width,
                                                  int64_t n_begin, int64_t n_end, float* out);

struct Int4MlpWeights {
  int4::PackedWeight gate_up;  // [2 * hidden, dim]: row 2j gate's row j, row 2j + 1 up's
  int4::PackedWeight down;     // [dim, hidden]
  GluActivation activation = GluActivation::silu;
};

// parallel(begin, end, body) calls body on disjoint subranges covering [begin, end).
using ParallelFor =
    std::function<void(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& body)>;

// Work on a range [begin, end) of rows or columns, run by the thread that handles it
// inside a parallel region (RoundedRows::round's `prepare`, gemm_all's `finish`): a pass
// that would otherwise be a region of its own, or run on one thread.
using RangeWork = std::function<void(int64_t begin, int64_t end)>;

// The error for packed weights of another shape than [rows, in/32, 16] (both registrations).
LLMCORE_KERNELS_CXX_API extern const char* const kPackedShapeError;

// Why the shapes cannot be run, or nullptr: dim and hidden multiples of 32, gate and up of
// one size, down back to dim.
LLMCORE_KERNELS_CXX_API const char* int4_mlp_shape_error(const Int4MlpWeights& w);

// Activations rounded to int8 (int4::QuantizedRows: per block for int4 blocks and int8 blocks,
// int4::quantize_blocks; per row for int8 rows, int4::quantize_rows), in storage the caller
// keeps (thread_local in the operators: a decode step reuses it).
struct LLMCORE_KERNELS_CXX_API RoundedRows {
  int4::CacheLineVector<uint8_t> a;  // read 32 bytes at a time by the tiles
  std::vector<float> scale, zero, means, lane_scales, block_scales;
  std::vector<int32_t> lane_shifts;
  // x [rows, w.k]'s rows rounded for w, split among the threads when there is more than
  // one: per block in the arranged order for int4 blocks; with each block's mean of x too
  // when w has block offsets. `prepare`, when given, first writes each range of x's rows (a norm).
  int4::QuantizedRows round(const float* x, int64_t rows, const ParallelFor& parallel, const int4::PackedWeight& w,
                            const RangeWork& prepare = nullptr);
};

// y [x.m, w.n] = x W^T (with w's block offsets when it has them: x must carry its block
// means), W's rows split among the threads in pairs. `finish`, when given, is called on
// each range of y's columns (even bounds) once its thread has computed them.
LLMCORE_KERNELS_CXX_API void gemm_all(const int4::QuantizedRows& x, const int4::PackedWeight& w, float* y,
                                      const ParallelFor& parallel, const RangeWork& finish = nullptr);

// out [rows, dim] from x [rows, dim]; the weights must pass int4_mlp_shape_error.
// `prepare` writes x's rows before they are rounded (RoundedRows::round); with `residual`
// [rows, dim], out = residual + the MLP's output (out may be residual).
LLMCORE_KERNELS_CXX_API void int4_mlp_forward(const float* x, int64_t rows, const Int4MlpWeights& w, float* out,
                                              const ParallelFor& parallel, const RangeWork& prepare = nullptr,
                                              const float* residual = nullptr);

}  // namespace llmcore_kernels
