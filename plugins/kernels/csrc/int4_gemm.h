// llmcore-kernels: the int4 x int8 GEMM under llmcore::int4_mlp (int4_mlp.cpp), on plain
// buffers. benchmarks/int4_gemm_probe times it against XNNPACK's on SmolLM2's shapes and
// checks it against a double-precision sum (docs/performance.md, "An int4 GEMM of our own").
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
//
// with the weights int4 per block of 32 inputs, w[n, k] = d[n, k / 32] * (u[n, k] - 8), u in
// [0, 15], d a bfloat16 scale (as XNNPACK's blockwise int4 GEMM keeps its scales: the same
// weights as the 8da4w programs'), and the activations rounded to int8 per block of 32,
// symmetric: x[m, k] ~ s[m, k / 32] * q[m, k] (QuantizedRows; per row, asymmetric, as XNNPACK
// rounds them, until 2026-12-08).
//
// Why a kernel of our own: XNNPACK 1.5.1's AVX2 int4 GEMM widens each nibble to 16 bits
// and multiplies with vpmaddwd (16 products an instruction). Here the weights, read as the
// unsigned nibbles u, meet the signed activations in vpmaddubsw (32 products an
// instruction), the product llama.cpp's Q4_0 kernels are built on. The offset of 8 never
// enters the inner loop; it comes out as one integer correction a block and token:
//
//   sum_k x_k w_k ~ sum_g s_g d_g (D_g - 8 Q_g)
//
// where D_g = sum_{k in g} u_k q_k (the vpmaddubsw dot of block g) and Q_g = sum_{k in g} q_k
// (QuantizedRows::lane_shifts holds -8 Q_g, computed once a token for every row).
//
// The arranged order. A block's scale multiplies only its own products, so a kernel that
// keeps one block in a register must convert its sums to float and multiply once per
// block and row pair: four instructions for one vpmaddubsw. Here a register holds eight
// blocks instead, one per 4-byte lane: a row's blocks go in groups of G = 8 (then one
// group of 4, 2 and 1 for the rest), and a group is G steps of 32 bytes, step s's lane L
// holding values [4 (s p + l), 4 (s p + l) + 4) of block L / p (p = 8 / G lanes a block,
// l = L % p). The G steps' vpmaddubsw results add in 16-bit lanes (2 products of at most
// 15 * 127 a lane: eight steps stay below 2^15); one addition of the lanes' corrections,
// one conversion and one multiply by the lanes' scales then serve G blocks. The activations
// are stored in this order (quantize_blocks, arrange), the weights packed in it:
//
// Packed weight layout, per row: its groups in order, each G * 16 bytes; within a group
// of G >= 2, each 32 bytes hold two steps, byte b = u(step 2i, byte b) | u(step 2i + 1,
// byte b) << 4 (one load and two masks give both); in a group of 1, 16 bytes, byte b =
// u(byte b) | u(byte 16 + b) << 4. Row n starts at packed[n * K/2]; the scales stay one
// bfloat16 per block in block order, [n, K/32].
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#if defined(__GNUC__)
#define LLMCORE_INT4_API __attribute__((visibility("default")))  // the PyTorch library packs with it
#else
#define LLMCORE_INT4_API
#endif

namespace llmcore_kernels {
namespace int4 {

constexpr int64_t kBlock = 32;

// An allocator of cache-line-aligned storage, for the buffers the tiles read 32 bytes at a
// time (the activations rounded to int8, a prompt's unpacked weight rows). malloc aligns to
// 16 bytes, and a buffer at 16 modulo 32 splits every other 32-byte load across two cache
// lines, which slowed a prompt's tiles on one thread and the runner's prefill MLP (on two
// threads the probe could not tell; docs/performance.md, "What was tried": tile buffers on
// cache lines, and "Measurements behind the code").
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using CacheLineVector = std::vector<T, CacheLineAllocator<T>>;

// x rounded to int8, in one of three forms, chosen by the weight's format (RoundedRows::round):
//   for int8 rows and Q6_K: per row, asymmetric, a [m, k] = q + 128 (q the int8 value torch's
//     quantize_per_token gives) in x's order; scale [m], zero [m] (whole numbers, as floats).
//   for int8 blocks (quantize_blocks without lanes): per block of 32 as for int4
//     blocks, below, in x's order, each block's scale in block_scales [m, k/32].
//   for int4 blocks and Q4_K (quantize_blocks): per block of 32, symmetric, as llama.cpp rounds the
//     activations of its Q4 dot products (Q8_0's form, scales kept in float32): a [m, k] the
//     bytes of q = round(x * (1 / s_b)) in [-127, 127], s_b = max |x| over the block / 127, each row
//     in the arranged order. Each block's products meet s_b with its weight scale, so a token's
//     outliers coarsen only their own blocks: `make demo`'s program's mean KL from the GGUF's own
//     floats 0.0188 per row, 0.0033 per block (docs/quantization.md, "Activations rounded per
//     block"). The block's scale and its correction (the weights are
//     read unsigned, u = w + 8: sum q (u - 8) = sum q u + (-8 sum q)) are laid out as a group's
//     lanes hold the block (int4_gemm.h's arranged order): lane_scales and lane_shifts, [m,
//     slots, 8] for a row's `slots` groups in order; the shift in the first lane of its block's
//     lanes, zero in the others. scale [m] holds 1 and zero [m] -128, so that finish(), which
//     the int8 weights need, leaves the dot as it is.
struct QuantizedRows {
  const uint8_t* a;
  const float* scale;
  const float* zero;
  int64_t m;
  int64_t k;
  const float* means = nullptr;  // [m, k/32]: each block's mean of x, for weights with offsets
  const float* lane_scales = nullptr;   // int4 blocks: [m, slots, 8], s_b in each lane of block b
  const int32_t* lane_shifts = nullptr;  // int4 blocks: [m, slots, 8], -8 sum q of block b in its first lane
  int64_t slots = 0;                     // groups a row (group_count(k / 32))
  const float* block_scales = nullptr;   // int8 blocks: [m, k/32], s_b
};

// The groups of a row of `blocks` blocks (eights, then one each of 4, 2 and 1 as needed).
inline int64_t group_count(int64_t blocks) {
  return blocks / 8 + (blocks % 8 >= 4) + (blocks % 4 >= 2) + (blocks % 2);
}

// How a PackedWeight holds its integers.
//   int4_blocks: int4 per block of 32 with a bfloat16 scale each (above; `packed`, `scales`).
//   int8_rows: int8 per output channel (8da8w's linears, XNNPACK's qc8w): w[n, k] =
//       row_scales[n] * q[n, k], q in [-128, 127], `packed` q's bytes as they are, [n, k] in
//       x's order (one scale a row: the order of a row's products does not matter, so rows are
//       not arranged). A row's products add in 32 bits over the whole row (AVX2: vpmaddwd on
//       values widened to 16 bits, as vpmaddubsw's 16-bit pair sums would saturate at
//       255 * 127 * 2; VNNI: vpdpbusd), then meet the row's scale once. Exact for k < 65536.
//   int8_blocks: int8 per block of 32 inputs with a float16 scale each (a GGUF's Q8_0 as the
//       file holds it, 34 bytes a block): w[n, k] = block_scales[n, k / 32] * q[n, k],
//       `packed` q's bytes as they are, [n, k] in x's order, so that one table serves
//       the output layer and the embedding's lookups (quantized_decomposed::embedding_byte
//       reads the same two tensors). Each block's products add in 32 bits (as int8_rows'),
//       lane by lane; the lanes meet the block's scale in one multiply-add into float
//       accumulators, which cross their lanes once a row.
//   q6_k: a GGUF's Q6_K super-blocks as the file holds them, so that a Q4_K_M file's output
//       layer (and the token table tied to it) keeps the file's 6.56 bits a weight and its
//       exact values, where int8 rows took 8 bits and rounded every weight again. A row is
//       k/256 super-blocks, `packed` [n, k/256, 210] the file's bytes as they are (ql[128]: the
//       values' low four bits; qh[64]: their high two; int8 scales[16], one per 16 values;
//       float16 d), so that the program holds the file's tensor itself:
//         w[n, 256 s + i] = d * scales[i / 16] * (q_i - 32),  q_i in [0, 63]
//       (int4_gemm_tiles.inc, "Q6_K super-blocks", has which bits of ql and qh make q_i). Each
//       16 products of u8 x and q_i add in vpmaddubsw's 16-bit pairs (255 * 63 * 2 fits), meet
//       their scale in vpmaddwd and add in 32 bits over the super-block, less 32 times the
//       scales against the token's sums of 16 activations; that sum meets d in one
//       multiply-add into float accumulators. The output layer's operator alone takes it (one
//       token a step: no prompt tiles).
//   q4_k: a GGUF's Q4_K, its 4.5 bits a weight as the file holds them, where int4 blocks
//       with a bfloat16 scale and a float16 offset take 5 and round each block's scale
//       again (to 8 bits of its 17). The integers are int4 blocks' (`packed` as above: the
//       file's nibbles moved into the arranged order, u in [0, 15]); the scales stay the
//       file's 16-byte super-block headers as they are (`super_blocks` [n, k/256, 16]: float16
//       d, float16 dmin, then 12 bytes of 6-bit codes: a scale sc_j and a minimum m_j for each
//       of the super-block's 8 blocks of 32, packed as the file packs them):
//         w[n, 32 j + i] = s_j (u - 8) + c_j,   s_j = d sc_j,   c_j = 8 s_j - dmin m_j
//       s_j is exact in float32 (11 bits times 6) and c_j rounded once, the values the
//       loader's IntegerWeight holds. A super-block is a group of 8 (k a multiple of 256):
//       its lane scales are the s_j, and gemm_rows adds the offsets itself: in each lane
//       32 c_j times block j's mean of x (x.means), added over the row's super-blocks with
//       multiply-adds in order, the lanes summed as hsum sums them, after `finish`. A decode
//       step so reads each header once, for both terms.
enum class Format { int4_blocks, int8_rows, int8_blocks, q6_k, q4_k };

// A Q6_K super-block: 256 values in 210 bytes: ql from byte 0, qh from kQ6KHighBitsAt, the
// int8 scales from kQ6KScalesAt, the float16 d at kQ6KScaleAt.
constexpr int64_t kQ6KValues = 256;
constexpr int64_t kQ6KBytes = 210;
constexpr int64_t kQ6KHighBitsAt = 128;
constexpr int64_t kQ6KScalesAt = 192;
constexpr int64_t kQ6KScaleAt = 208;

// A Q4_K super-block: 256 values; its header (d, dmin, the codes from byte 4) is 16 bytes.
constexpr int64_t kQ4KValues = 256;
constexpr int64_t kQ4KHeaderBytes = 16;

struct PackedWeight {
  const uint8_t* packed;     // int4_blocks, q4_k: [n, k/2]; int8_rows: [n, k] int8 bytes; q6_k: [n, k/256, 210]
  const uint16_t* scales;    // int4_blocks: [n, k/32], bfloat16 bits; int8_rows: unused
  const float* row_sums;     // [n]: sum_k of the dequantized row
  const float* bias;         // [n] or null
  int64_t n;
  int64_t k;
  // [ceil(n/8), k/32, 8] or null: each block's offset times 32, o[n, g], for a weight
  // w[n, k] = d (u - 8) + o / 32 (a GGUF's Q4_1 and Q4_K minima, llmcore-xnnpack's
  // BlockInt4Linear.offset_weight), eight rows side by side, block after block (one load
  // serves eight outputs; a decode step reads them in order): o[n, g] at
  // [n / 8, g, n % 8], zeros past the last row; IEEE float16 bits, the module's own values
  // (it rounds its offsets to float16: 2 bytes a block beside its 18, not 4). The GEMM adds
  // sum_g o[n, g] means[t, g] (add_block_offsets), o widened exactly to float32.
  const uint16_t* offsets = nullptr;
  Format format = Format::int4_blocks;
  const float* row_scales = nullptr;  // int8_rows: [n], float32
  const uint16_t* block_scales = nullptr;  // int8_blocks: [n, k/32], IEEE float16 bits
  const uint8_t* super_blocks = nullptr;   // q4_k: [n, k/256, 16], the file's headers
};

// Whether w's products need each block's mean of x (QuantizedRows::means): int4 blocks with
// offsets, and Q4_K (its minima).
inline bool needs_block_means(const PackedWeight& w) { return w.offsets != nullptr || w.format == Format::q4_k; }

// Whether w's rows hold their integers in the arranged order (int4 blocks and Q4_K), so that
// x's rows must be rounded into it too.
inline bool arranged_rows(const PackedWeight& w) { return w.format == Format::int4_blocks || w.format == Format::q4_k; }

// A Q4_K super-block's header (Format::q4_k) -> its 8 block scales s_j and 8 offsets times
// 32, 32 c_j: the floats the tiles compute from it, for the portable loops and the checks.
LLMCORE_INT4_API void q4_k_block_values(const uint8_t* header, float* scales, float* offsets32);

// The largest k an int8_rows weight may have: its 32-bit sums stay exact below it.
constexpr int64_t kInt8MaxK = 65536;

// Quantize rows [row_begin, row_end) of x [m, k] (k a multiple of 32) into a [m, k],
// scale [m] and zero [m]; a's rows in the arranged order (`arranged`) or in x's. With
// `means` ([m, k/32]), each block's mean of x as well, for weights with offsets
// (QuantizedRows::means): the sum of a block's four eights lane by lane, the eight lanes
// added in order, divided by 32, the floats the module's mean over a [.., 32] view gives.
// `portable`: the plain loops even where AVX2 is available (the check compares the two).
void quantize_rows(const float* x, int64_t k, int64_t row_begin, int64_t row_end, uint8_t* a, float* scale,
                   float* zero, bool arranged = true, bool portable = false, float* means = nullptr);

// Rows [row_begin, row_end) of x [m, k] (k a multiple of 32) rounded per block (QuantizedRows,
// above), scale [m] = 1 and zero [m] = -128: for int4 blocks (`lanes`) a [m, k] arranged and
// lane_scales and lane_shifts [m, group_count(k/32), 8]; for int8 blocks (`!lanes`) a in x's
// order and block_scales [m, k/32]. `portable`: the plain loops even where AVX2 is there.
// `means`, when given, as quantize_rows'.
struct BlockRounding {
  bool lanes;
  float* lane_scales = nullptr;
  int32_t* lane_shifts = nullptr;
  float* block_scales = nullptr;
};
void quantize_blocks(const float* x, int64_t k, int64_t row_begin, int64_t row_end, uint8_t* a,
                     const BlockRounding& out, float* scale, float* zero, bool portable = false,
                     float* means = nullptr);

// One row of k bytes (k a multiple of 32), one per value, from x's order into the arranged one.
void arrange(const uint8_t* in, int64_t k, uint8_t* out);

// y[:, n_begin:n_end] for every row of x. y is [m, n] row-major. x's rows must be in the
// arranged order for int4_blocks and Q4_K weights and in their own order for the others
// (int8, Q6_K). A Q4_K weight's offsets are added here too (x.means must be given); int4
// blocks' are add_block_offsets'.
void gemm_rows(const QuantizedRows& x, const PackedWeight& w, int64_t n_begin, int64_t n_end, float* y,
               bool portable = false);

// y[t, n] += sum_g o[n, g] x.means[t, g] (w.offsets) for n in [n_begin, n_end), every row t of x:
// the offset term of weights with per-block offsets, on the float activations' block means
// (as the module computes it; not the rounded ones). Each output is summed in one order.
void add_block_offsets(const QuantizedRows& x, const PackedWeight& w, int64_t n_begin, int64_t n_end, float* y);

// Row `row` of a Q6_K weight (Format::q6_k) as w.k floats, each d times the integer
// scale * (q - 32), rounded once (the float (d * scale) * (q - 32) gives, d * scale being
// exact): the values the loader's dequantizer gives, for the lookups of a token table the
// output layer shares.
LLMCORE_INT4_API void q6_k_row_values(const PackedWeight& w, int64_t row, float* out);

// One row's packing, from its integers q (u - 8, in [-8, 7], in x's order) into k/2 bytes.
LLMCORE_INT4_API void pack_row(const int8_t* q, int64_t k, uint8_t* out);

// Whether this CPU has AVX2 and FMA: gemm_rows then runs its AVX2 code (else the portable
// loops), and int4_mlp its vectorised SiLU.
bool uses_avx2();

// Which code gemm_rows runs here: "AVX-512 VNNI" (vpdpbusd), "AVX2" or
// "portable"; LLMCORE_KERNELS_MAX_ISA=avx2 or =portable caps it (llmcore/testing/isa_view.py).
const char* gemm_isa_name();

}  // namespace int4
}  // namespace llmcore_kernels
