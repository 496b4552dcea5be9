// llmcore-kernels: the int4 x int8 GEMM under llmcore::int4_mlp (int4_mlp.cpp), on plain
// buffers. benchmarks/int4_gemm_probe times it against XNNPACK's on SmolLM2's shapes and
// checks it against a double-precision sum (docs/performance.md, "An int4 GEMM of our own").
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
//
// with the activations rounded to int8 per row (asymmetric: scale s and zero point z per
// row, chosen as torch's choose_qparams_per_token_asymmetric chooses them, the scheme
// XNNPACK's int4 GEMM uses too) and the weights int4 per block of 32 inputs:
// w[n, k] = d[n, k / 32] * (u[n, k] - 8), u in [0, 15], d a bfloat16 scale (as XNNPACK's
// blockwise int4 GEMM keeps its scales: the same weights as the 8da4w programs').
//
// Why a kernel of our own: XNNPACK 1.5.1's AVX2 int4 GEMM widens each nibble to 16 bits
// and multiplies with vpmaddwd (16 products an instruction). Here the activations, held
// unsigned (a = q + 128 in [0, 255]), meet the signed int4 weights in vpmaddubsw (32
// products an instruction), the product llama.cpp's Q4_0 kernels are built on. The
// zero point and the offset of 128 never enter the inner loop; they come out as one
// correction per output:
//
//   sum_k (q_k - z) w_k = sum_g d_g D_g - (128 + z) R_n
//
// where D_g = sum_{k in g} a_k (u_k - 8) (the vpmaddubsw dot of block g) and
// R_n = sum_k w[n, k], the row sum of the dequantized weight (computed when packing).
//
// The activations are rounded as the 8da4w programs round them, so the arithmetic is the
// one XNNPACK runs for those programs: a like-for-like comparison.
//
// Packed weight layout, per row n and block g: 16 bytes, byte j = u[32g + j] |
// u[32g + 16 + j] << 4 (the low nibbles are the block's first 16 values). Row n's blocks
// are contiguous: packed[n * K/2 + 16 g + j]. (Two blocks in 32 bytes, one load and two
// masks for both, measured alike at one token and 10% slower at 64: more registers.)
#pragma once

#include <cstdint>

namespace llmcore_kernels {
namespace int4 {

constexpr int64_t kBlock = 32;

// x quantized per row: a [m, k] = q + 128 (q the int8 value torch's quantize_per_token
// gives), scale [m], zero [m] (whole numbers, as floats).
struct QuantizedRows {
  const uint8_t* a;
  const float* scale;
  const float* zero;
  int64_t m;
  int64_t k;
};

struct PackedWeight {
  const uint8_t* packed;     // [n, k/2]
  const uint16_t* scales;    // [n, k/32], bfloat16 bits
  const float* row_sums;     // [n]: sum_k of the dequantized row
  const float* bias;         // [n] or null
  int64_t n;
  int64_t k;
};

// Quantize rows [row_begin, row_end) of x [m, k] (k a multiple of 32) into a [m, k],
// scale [m] and zero [m].
// `portable`: the plain loops even where AVX2 is available (the check compares the two).
void quantize_rows(const float* x, int64_t k, int64_t row_begin, int64_t row_end, uint8_t* a, float* scale,
                   float* zero, bool portable = false);

// y[:, n_begin:n_end] for every row of x. y is [m, n] row-major.
void gemm_rows(const QuantizedRows& x, const PackedWeight& w, int64_t n_begin, int64_t n_end, float* y,
               bool portable = false);

// One row's packing, from its integers q (u - 8, in [-8, 7]) into k/2 bytes.
void pack_row(const int8_t* q, int64_t k, uint8_t* out);

// Whether this CPU has AVX2 and FMA: gemm_rows then runs its AVX2 code (else the portable
// loops), and int4_mlp its vectorised SiLU.
bool uses_avx2();

}  // namespace int4
}  // namespace llmcore_kernels
