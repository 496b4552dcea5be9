// The int4 GEMM probe (int4_gemm.h): checks the kernel, and times it on SmolLM2-135M's
// linear layers, for the comparison with XNNPACK's GEMMs in docs/performance.md.
//
//   c++ -O3 -std=c++17 -ffp-contract=off -pthread -Iplugins/kernels/csrc -Iruntime/kernels
//       benchmarks/int4_gemm_probe/probe.cpp plugins/kernels/csrc/int4_gemm.cpp -o int4_probe
//   (runtime/kernels: cpu_isa.h, the instruction-set choice int4_gemm.cpp shares with the runner)
//   int4_probe check
//       the best code this CPU runs (AVX-512 VNNI, AVX-VNNI, AVX2; LLMCORE_KERNELS_MAX_ISA=avx_vnni, =avx2
//       or =portable caps it) against the portable loops and both against a double-precision
//       sum over the same integers; the activation rounding against its definition; the
//       offset term of blocks with offsets (add_block_offsets) against a double-precision sum;
//       int8 rows (Format::int8_rows) and int8 blocks (Format::int8_blocks) the same way.
//       Prints "ok" and exits 0, or names the first mismatch and exits 1.
//   int4_probe time TOKENS THREADS [REPEAT] [mlp] [int8]
//       every linear layer of SmolLM2-135M's 30 blocks (q, k, v, o, gate, up, down; with
//       "mlp" gate, up and down only), random weights (int4 blocks; with "int8" int8 rows),
//       TOKENS rows of activations: the
//       milliseconds one forward pass spends in them, min and median over REPEAT passes.
//       The rows of each layer's weight are split between THREADS threads, which wait
//       for each layer at a spinning barrier (as a thread pool's workers do).
//       Also the multiply-adds a second at the median (GMAC/s), for the ceiling below.
//   int4_probe ceiling [REPEAT]
//       the AVX2 prompt tile's inner step alone (4 tokens x 3 rows: 12 vpmaddubsw into 12
//       running 16-bit sums in registers by vpaddw), on one thread, in two forms: GCC's code
//       of the C++ step (every weight row read from L1 by each product) and the 4 x 3
//       tile's asm (two of the three rows held in registers): the multiply-adds a second
//       this core's ports allow the step, of which `time TOKENS 1 ... mlp` with
//       LLMCORE_KERNELS_MAX_ISA=avx2 reaches a share (the rest of its time: each group's
//       widening and scaling, unpacking, finishing, rounding the activations).
//   int4_probe output THREADS [REPEAT] [rows|blocks] [COPIES]
//       SmolLM2-135M's output layer (576 -> 49152, its tied table) for one token as int8 rows
//       or int8 blocks (Format::int8_blocks, the GGUF's Q8_0), COPIES copies (default 12,
//       ~350 MiB: more than a last-level cache) a pass each in turn: milliseconds a pass, min
//       and median, and the weight bytes read a second at the median.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "int4_gemm.h"

using namespace llmcore_kernels::int4;

namespace {

struct Layer {
  int64_t n, k;
  std::vector<uint8_t> packed;
  std::vector<uint16_t> scales;  // bfloat16 bits
  std::vector<float> row_sums;
  std::vector<float> bias;
  std::vector<int8_t> q;  // the integers, u - 8 (int8 rows: q), kept for the reference
  std::vector<float> row_scales;  // int8 rows only
  std::vector<uint16_t> block_scales;  // int8 blocks only: [n, k/32], float16 bits
};

float bf16_bits_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fill: every integer that value (-8 or 7), or 0 for random ones
Layer random_layer(int64_t n, int64_t k, bool with_bias, std::mt19937& rng, int fill = 0) {
  Layer l{n, k, std::vector<uint8_t>(n * k / 2), std::vector<uint16_t>(n * k / kBlock), std::vector<float>(n),
          {}, std::vector<int8_t>(n * k)};
  std::uniform_int_distribution<int> nibble(-8, 7);
  for (auto& v : l.q) v = static_cast<int8_t>(fill != 0 ? fill : nibble(rng));
  // bfloat16 scales around 2^-6 .. 2^-4 (exponents 121..123), any mantissa
  for (auto& s : l.scales) s = static_cast<uint16_t>(((121 + rng() % 3) << 7) | (rng() & 0x7fu));
  for (int64_t r = 0; r < n; ++r) {
    pack_row(l.q.data() + r * k, k, l.packed.data() + r * (k / 2));
    double sum = 0.0;
    for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(bf16_bits_to_float(l.scales[r * (k / kBlock) + i / kBlock])) * l.q[r * k + i];
    l.row_sums[r] = static_cast<float>(sum);
  }
  if (with_bias) {
    l.bias.resize(n);
    for (auto& b : l.bias) b = std::normal_distribution<float>()(rng);
  }
  return l;
}

// Rounded activations: per row for int8 rows (quantize_rows), per block for int4 blocks
// (quantize_blocks: with the lanes' scales and shifts) and int8 blocks (with block scales).
struct Activations {
  std::vector<uint8_t> a;
  std::vector<float> scale, zero, lane_scales;
  std::vector<int32_t> lane_shifts;
  std::vector<float> block_scales;
  QuantizedRows rows(int64_t m, int64_t k) const {
    QuantizedRows r{a.data(), scale.data(), zero.data(), m, k};
    if (!lane_scales.empty()) {
      r.lane_scales = lane_scales.data();
      r.lane_shifts = lane_shifts.data();
      r.slots = group_count(k / kBlock);
    }
    if (!block_scales.empty()) r.block_scales = block_scales.data();
    return r;
  }
};

// An int8_rows weight: q in [-128, 127] (every one `fill` when not 0), scales around 2^-7.
Layer random_int8_layer(int64_t n, int64_t k, bool with_bias, std::mt19937& rng, int fill = 0) {
  Layer l{n, k, std::vector<uint8_t>(n * k), {}, std::vector<float>(n), {}, std::vector<int8_t>(n * k),
          std::vector<float>(n)};
  std::uniform_int_distribution<int> value(-128, 127);
  for (auto& v : l.q) v = static_cast<int8_t>(fill != 0 ? fill : value(rng));
  std::memcpy(l.packed.data(), l.q.data(), l.q.size());
  for (int64_t r = 0; r < n; ++r) {
    l.row_scales[r] = std::ldexp(1.0f + std::uniform_real_distribution<float>()(rng), -7);
    double sum = 0.0;
    for (int64_t i = 0; i < k; ++i) sum += l.q[r * k + i];
    l.row_sums[r] = static_cast<float>(sum * l.row_scales[r]);
  }
  if (with_bias) {
    l.bias.resize(n);
    for (auto& b : l.bias) b = std::normal_distribution<float>()(rng);
  }
  return l;
}

// A finite float16 number's value, subnormals too (the offsets' check writes some).
float f16_bits_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const float magnitude = exponent == 0 ? std::ldexp((h & 0x3ff) / 1024.0f, -14)
                                        : std::ldexp(1.0f + (h & 0x3ff) / 1024.0f, exponent - 15);
  return (h & 0x8000) != 0 ? -magnitude : magnitude;
}

// An int8_blocks weight (a GGUF's Q8_0): q in [-128, 127] (every one `fill` when not 0), a
// float16 scale a block of 32 around 2^-7, some of them negative.
Layer random_int8_blocks_layer(int64_t n, int64_t k, bool with_bias, std::mt19937& rng, int fill = 0) {
  Layer l = random_int8_layer(n, k, with_bias, rng, fill);
  l.row_scales.clear();
  l.block_scales.resize(n * (k / kBlock));
  std::uniform_int_distribution<int> mantissa(0, 1023), sign(0, 3);
  for (auto& d : l.block_scales)
    d = static_cast<uint16_t>((sign(rng) == 0 ? 0x8000 : 0) | (8 << 10) | mantissa(rng));  // +-2^-7 (1 + m/1024)
  for (int64_t r = 0; r < n; ++r) {
    double sum = 0.0;
    for (int64_t i = 0; i < k; ++i) sum += double(f16_bits_to_float(l.block_scales[r * (k / kBlock) + i / kBlock])) * l.q[r * k + i];
    l.row_sums[r] = static_cast<float>(sum);
  }
  return l;
}

PackedWeight view(const Layer& l) {
  PackedWeight w{l.packed.data(), l.scales.empty() ? nullptr : l.scales.data(), l.row_sums.data(),
                 l.bias.empty() ? nullptr : l.bias.data(), l.n, l.k};
  if (!l.row_scales.empty()) {
    w.format = Format::int8_rows;
    w.row_scales = l.row_scales.data();
  }
  if (!l.block_scales.empty()) {
    w.format = Format::int8_blocks;
    w.block_scales = l.block_scales.data();
  }
  return w;
}

// The weight's value at [r, i] (for the double-precision references).
double weight_value(const Layer& l, int64_t r, int64_t i) {
  const double scale = !l.row_scales.empty()   ? l.row_scales[r]
                       : !l.block_scales.empty() ? f16_bits_to_float(l.block_scales[r * (l.k / kBlock) + i / kBlock])
                                                 : bf16_bits_to_float(l.scales[r * (l.k / kBlock) + i / kBlock]);
  return scale * l.q[r * l.k + i];
}

// Both codes' y (AVX2 or VNNI, and portable) on `input` against a double-precision sum over
// the values the rounded activations stand for, in x's order (`xv`, [m, k]); 0 or 1.
int check_gemm(const char* what, const Activations& input, const std::vector<double>& xv, const Layer& w, int64_t m,
               bool bias) {
  std::vector<float> y_fast(m * w.n), y_plain(m * w.n);
  gemm_rows(input.rows(m, w.k), view(w), 0, w.n, y_fast.data(), false);
  gemm_rows(input.rows(m, w.k), view(w), 0, w.n, y_plain.data(), true);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t r = 0; r < w.n; ++r) {
      double ref = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < w.k; ++i) {
        ref += xv[t * w.k + i] * weight_value(w, r, i);
        magnitude += std::fabs(xv[t * w.k + i] * weight_value(w, r, i));
      }
      if (bias) ref += w.bias[r];
      const double tolerance = 1e-5 * magnitude + 1e-6;
      for (const auto* y : {&y_fast, &y_plain}) {
        const double got = (*y)[t * w.n + r];
        if (!(std::fabs(got - ref) <= tolerance)) {
          std::printf("mismatch: %s %s y[%lld, %lld] = %.7g, reference %.7g (m=%lld n=%lld k=%lld)\n", what,
                      y == &y_fast ? gemm_isa_name() : "portable", (long long)t, (long long)r, got, ref,
                      (long long)m, (long long)w.n, (long long)w.k);
          return 1;
        }
      }
    }
  }
  // A prompt's rows (its tiles) are the floats each row gives alone (a decode step's code):
  // a token's output must not depend on how many tokens came with it.
  for (int64_t t = 0; t < m; ++t) {
    QuantizedRows one = input.rows(1, w.k);
    one.a += t * w.k;
    one.scale += t;
    one.zero += t;
    if (one.lane_scales != nullptr) {
      one.lane_scales += t * one.slots * 8;
      one.lane_shifts += t * one.slots * 8;
    }
    if (one.block_scales != nullptr) one.block_scales += t * (w.k / kBlock);
    std::vector<float> y_one(w.n);
    gemm_rows(one, view(w), 0, w.n, y_one.data(), false);
    if (std::memcmp(y_one.data(), y_fast.data() + t * w.n, w.n * sizeof(float)) != 0) {
      std::printf("mismatch: %s %s row %lld alone differs from its row among %lld (n=%lld k=%lld)\n", what,
                  gemm_isa_name(), (long long)t, (long long)m, (long long)w.n, (long long)w.k);
      return 1;
    }
  }
  return 0;
}

Activations quantize(const std::vector<float>& x, int64_t m, int64_t k, bool arranged, bool portable) {
  Activations q{std::vector<uint8_t>(m * k), std::vector<float>(m), std::vector<float>(m)};
  quantize_rows(x.data(), k, 0, m, q.a.data(), q.scale.data(), q.zero.data(), arranged, portable);
  return q;
}

// quantize_rows' block means, fast and portable: the same bits (memcmp: a zero's sign
// too), each within float error of a double-precision mean.
int check_block_means(const std::vector<float>& x, int64_t m, int64_t k) {
  const int64_t blocks = k / kBlock;
  Activations q{std::vector<uint8_t>(m * k), std::vector<float>(m), std::vector<float>(m)};
  std::vector<float> fast(m * blocks), plain(m * blocks);
  quantize_rows(x.data(), k, 0, m, q.a.data(), q.scale.data(), q.zero.data(), true, false, fast.data());
  quantize_rows(x.data(), k, 0, m, q.a.data(), q.scale.data(), q.zero.data(), true, true, plain.data());
  if (std::memcmp(fast.data(), plain.data(), fast.size() * sizeof(float)) != 0) {
    std::printf("mismatch: the %s and portable block means differ (m=%lld k=%lld)\n", gemm_isa_name(),
                (long long)m, (long long)k);
    return 1;
  }
  for (int64_t i = 0; i < m * blocks; ++i) {
    double ref = 0.0, magnitude = 0.0;
    for (int64_t j = 0; j < kBlock; ++j) {
      ref += x[i * kBlock + j];
      magnitude += std::fabs(x[i * kBlock + j]);
    }
    if (!(std::fabs(fast[i] - ref / kBlock) <= 1e-6 * magnitude / kBlock + 1e-30)) {
      std::printf("mismatch: block mean %lld = %.9g, reference %.9g\n", (long long)i, fast[i], ref / kBlock);
      return 1;
    }
  }
  return 0;
}

// Per block: for int4 blocks (`lanes`: arranged, the lanes' scales and shifts) or int8 blocks.
Activations quantize_per_block(const std::vector<float>& x, int64_t m, int64_t k, bool portable, bool lanes = true) {
  const int64_t lane_count = lanes ? m * group_count(k / kBlock) * 8 : 0;
  Activations q{std::vector<uint8_t>(m * k), std::vector<float>(m), std::vector<float>(m),
                std::vector<float>(lane_count), std::vector<int32_t>(lane_count),
                std::vector<float>(lanes ? 0 : m * (k / kBlock))};
  const BlockRounding out{lanes, q.lane_scales.data(), q.lane_shifts.data(), q.block_scales.data()};
  quantize_blocks(x.data(), k, 0, m, q.a.data(), out, q.scale.data(), q.zero.data(), portable);
  return q;
}

// What per-row activations stand for, in x's order: scale (a - 128 - zero).
std::vector<double> row_values(const Activations& q, int64_t m, int64_t k) {
  std::vector<double> v(m * k);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t i = 0; i < k; ++i) v[t * k + i] = double(q.scale[t]) * (q.a[t * k + i] - 128.0 - q.zero[t]);
  return v;
}

// Per-block activations (quantize_blocks) checked against x, and what they stand for in x's
// order (s_b q), or an empty vector after printing the mismatch: each value its nearest level
// of its block's scale max |x| / 127, the lanes' scales and shifts (-8 sum q in a block's first
// lane) where the arranged order puts the block.
std::vector<double> block_values(const Activations& q, const std::vector<float>& x, int64_t m, int64_t k) {
  const int64_t blocks = k / kBlock, slots = group_count(blocks);
  std::vector<uint8_t> natural(k);
  std::vector<double> v(m * k);
  for (int64_t t = 0; t < m; ++t) {
    // back to x's order: arrange() moves 4-byte pieces, so inverting it on indices does
    std::vector<uint32_t> ids(k / 4), moved(k / 4);
    for (int64_t i = 0; i < k / 4; ++i) ids[i] = static_cast<uint32_t>(i);
    arrange(reinterpret_cast<const uint8_t*>(ids.data()), k, reinterpret_cast<uint8_t*>(moved.data()));
    for (int64_t j = 0; j < k / 4; ++j)
      for (int b = 0; b < 4; ++b) natural[moved[j] * 4 + b] = q.a[t * k + j * 4 + b];
    int64_t slot = 0, b = 0;
    std::vector<float> scales(blocks);
    std::vector<int32_t> sums(blocks);
    for (int size = 8; size >= 1; size /= 2)
      for (; blocks - b >= size; b += size, ++slot)
        for (int lane = 0; lane < 8; ++lane) {
          const int64_t block = b + lane / (8 / size), at = (t * slots + slot) * 8 + lane;
          scales[block] = q.lane_scales[at];
          if (lane % (8 / size) == 0) sums[block] = q.lane_shifts[at];
          else if (q.lane_shifts[at] != 0) {
            std::printf("mismatch: a block's second lane has a shift (k=%lld)\n", (long long)k);
            return {};
          }
        }
    for (int64_t g = 0; g < blocks; ++g) {
      float amax = 0.0f;
      int32_t sum = 0;
      for (int64_t i = g * kBlock; i < (g + 1) * kBlock; ++i) amax = std::max(amax, std::fabs(x[t * k + i]));
      const float s = scales[g];
      if (s != amax / 127.0f) {
        std::printf("mismatch: block %lld of row %lld has scale %g, max |x| %g\n", (long long)g, (long long)t, s, amax);
        return {};
      }
      for (int64_t i = g * kBlock; i < (g + 1) * kBlock; ++i) {
        const int8_t qi = static_cast<int8_t>(natural[i]);
        sum += qi;
        v[t * k + i] = double(s) * qi;
        if (qi < -127 || std::fabs(s * qi - x[t * k + i]) > 0.5f * s * 1.001f) {
          std::printf("mismatch: x[%lld, %lld] = %g rounds to %d (scale %g)\n", (long long)t, (long long)i,
                      x[t * k + i], qi, s);
          return {};
        }
      }
      if (sums[g] != -8 * sum) {
        std::printf("mismatch: block %lld of row %lld has shift %d, -8 sum q %d\n", (long long)g, (long long)t, sums[g],
                    -8 * sum);
        return {};
      }
    }
  }
  return v;
}

int check() {
  std::mt19937 rng(1);
  struct Case {
    int64_t m, n, k;
    bool bias;
    int fill = 0;  // not 0: int4 weights all 7 (u = 15), int8 -128 or 127, x a constant 3 (-3 for a negative fill)
  };
  const Case cases[] = {{1, 576, 576, false}, {1, 7, 64, true}, {3, 192, 576, false}, {5, 33, 1536, true},
                        {64, 576, 576, false}, {19, 1536, 576, true}, {4, 2, 32, false},
                        {6, 10, 96, true},  // 96: an odd number of blocks
                        {5, 9, 480, false}, {2, 6, 224, true},  // groups of 8, 4, 2, 1; of 4, 2, 1
                        // past the prompt tiles' rows: a tile of 3 tokens; row pairs and a last row
                        {7, 23, 480, true},
                        // the largest sums a group's 16-bit lanes hold: 8 steps x 2 x 15 x 127 (u = 15,
                        // x all 3, q 127) or x 2 x 15 x -127 (x all -3: fill -8); int8 rows: -128, 127
                        {4, 8, 512, false, -8}, {3, 5, 512, false, 7},
                        // the same extremes for a token or two (AVX2's int8 rows: the widened path)
                        {2, 8, 512, false, -8}, {1, 5, 512, true, 7}};
  for (const Case& c : cases) {
    const Layer w = random_layer(c.n, c.k, c.bias, rng, c.fill != 0 ? 7 : 0);
    std::vector<float> x(c.m * c.k, c.fill < 0 ? -3.0f : 3.0f);
    if (c.fill == 0) {
      for (auto& v : x) v = std::normal_distribution<float>(0.3f, 2.0f)(rng);
      x[0] = 40.0f;  // an outlier, as real activations have
    }
    // the rounding checked in x's order; the GEMM's input arranged (int4_gemm.h)
    const Activations fast = quantize(x, c.m, c.k, false, false), plain = quantize(x, c.m, c.k, false, true);
    if (fast.a != plain.a || fast.scale != plain.scale || fast.zero != plain.zero) {
      std::printf("mismatch: the AVX2 and portable activation rounding differ (m=%lld k=%lld)\n", (long long)c.m,
                  (long long)c.k);
      return 1;
    }
    Activations arranged = fast;
    for (int64_t t = 0; t < c.m; ++t) arrange(fast.a.data() + t * c.k, c.k, arranged.a.data() + t * c.k);
    if (quantize(x, c.m, c.k, true, false).a != arranged.a || quantize(x, c.m, c.k, true, true).a != arranged.a) {
      std::printf("mismatch: quantize_rows' arranged rows are not arrange() of its plain ones (k=%lld)\n",
                  (long long)c.k);
      return 1;
    }
    // the block means: both codes the same bits, each within float error of the mean
    if (int bad = check_block_means(x, c.m, c.k)) return bad;
    for (int64_t t = 0; t < c.m; ++t) {
      const float s = fast.scale[t], z = fast.zero[t];
      if (z != std::nearbyint(z) || z < -128.0f || z > 127.0f || !(s > 0.0f)) {
        std::printf("mismatch: row %lld has scale %g, zero point %g\n", (long long)t, s, z);
        return 1;
      }
      for (int64_t i = 0; i < c.k; ++i) {  // each value rounded to its nearest level
        const float back = s * (static_cast<float>(fast.a[t * c.k + i]) - 128.0f - z);
        if (std::fabs(back - x[t * c.k + i]) > 0.5f * s * 1.001f) {
          std::printf("mismatch: x[%lld, %lld] = %g rounds to %g (scale %g)\n", (long long)t, (long long)i,
                      x[t * c.k + i], back, s);
          return 1;
        }
      }
    }
    // int4 blocks: per block, arranged; AVX2 and portable rounding alike
    const Activations blocks_fast = quantize_per_block(x, c.m, c.k, false),
                      blocks_plain = quantize_per_block(x, c.m, c.k, true);
    if (blocks_fast.a != blocks_plain.a || blocks_fast.lane_scales != blocks_plain.lane_scales ||
        blocks_fast.lane_shifts != blocks_plain.lane_shifts) {
      std::printf("mismatch: the AVX2 and portable per-block rounding differ (m=%lld k=%lld)\n", (long long)c.m,
                  (long long)c.k);
      return 1;
    }
    const std::vector<double> per_block = block_values(blocks_fast, x, c.m, c.k);
    if (per_block.empty() || check_gemm("int4", blocks_fast, per_block, w, c.m, c.bias)) return 1;
    // int8 rows on the per-row activations in x's order; the fills' extremes: -128 and 127
    const int int8_fill = c.fill < 0 ? -128 : c.fill > 0 ? 127 : 0;
    const std::vector<double> per_row = row_values(fast, c.m, c.k);
    if (check_gemm("int8", fast, per_row, random_int8_layer(c.n, c.k, c.bias, rng, int8_fill), c.m, c.bias)) return 1;
    // int8 blocks: per block in x's order, the same integers and scales as int4's in the arranged one
    const Activations plain_blocks = quantize_per_block(x, c.m, c.k, false, false),
                      plain_blocks_portable = quantize_per_block(x, c.m, c.k, true, false);
    if (plain_blocks.a != plain_blocks_portable.a || plain_blocks.block_scales != plain_blocks_portable.block_scales) {
      std::printf("mismatch: the AVX2 and portable per-block rounding in x's order differ (k=%lld)\n", (long long)c.k);
      return 1;
    }
    std::vector<double> plain_values(c.m * c.k);
    for (int64_t i = 0; i < c.m * c.k; ++i)
      plain_values[i] = double(plain_blocks.block_scales[i / kBlock]) * static_cast<int8_t>(plain_blocks.a[i]);
    if (plain_values != per_block) {
      std::printf("mismatch: per-block rounding in x's order is not the arranged one's (k=%lld)\n", (long long)c.k);
      return 1;
    }
    if (check_gemm("int8 blocks", plain_blocks, plain_values,
                   random_int8_blocks_layer(c.n, c.k, c.bias, rng, int8_fill), c.m, c.bias))
      return 1;
    // the offset term (add_block_offsets) on float16 offsets in its layout ([ceil(n/8), k/32,
    // 8]; exponents from 2^-14, the smallest normal, to 2^3, and subnormals, of both signs)
    // and float block means, over a split of the rows that leaves odd pieces, against a
    // double-precision sum
    const int64_t blocks = c.k / kBlock;
    std::vector<uint16_t> offsets((c.n + 7) / 8 * 8 * blocks);
    std::vector<float> means(c.m * blocks), y_offsets(c.m * c.n, 1.0f);
    for (auto& v : offsets)
      v = static_cast<uint16_t>((rng() & 0x8000u) | ((rng() % 19) << 10) | (rng() & 0x3ffu));
    for (auto& v : means) v = std::normal_distribution<float>()(rng);
    QuantizedRows with_means = blocks_fast.rows(c.m, c.k);
    with_means.means = means.data();
    PackedWeight with_offsets = view(w);
    with_offsets.offsets = offsets.data();
    const int64_t split = std::min<int64_t>(c.n, 3), split2 = std::max<int64_t>(split, c.n - 5);
    add_block_offsets(with_means, with_offsets, 0, split, y_offsets.data());
    add_block_offsets(with_means, with_offsets, split, split2, y_offsets.data());
    add_block_offsets(with_means, with_offsets, split2, c.n, y_offsets.data());
    for (int64_t t = 0; t < c.m; ++t) {
      for (int64_t r = 0; r < c.n; ++r) {
        double ref = 1.0, magnitude = 1.0;
        for (int64_t g = 0; g < blocks; ++g) {
          const double o = f16_bits_to_float(offsets[(r / 8) * blocks * 8 + g * 8 + r % 8]);
          ref += o * means[t * blocks + g];
          magnitude += std::fabs(o * means[t * blocks + g]);
        }
        if (!(std::fabs(y_offsets[t * c.n + r] - ref) <= 1e-5 * magnitude)) {
          std::printf("mismatch: the offset term at [%lld, %lld] = %.7g, reference %.7g (m=%lld n=%lld k=%lld)\n",
                      (long long)t, (long long)r, y_offsets[t * c.n + r], ref, (long long)c.m, (long long)c.n,
                      (long long)c.k);
          return 1;
        }
      }
    }
  }
  if (uses_avx2())
    std::printf("ok (the %s and the portable code checked)\n", gemm_isa_name());
  else
    std::printf("ok (the portable code checked)\n");
  return 0;
}

// The milliseconds each of `repeat` passes over `passes` (each a list of layers, one pass
// after another, cycling) spends in gemm_rows on m tokens, sorted. The rows of each layer
// are split between `threads` threads, which wait for each layer at a spinning barrier (as
// a thread pool's workers do). int8 weights take the activations in x's order.
std::vector<double> time_passes(const std::vector<std::vector<Layer>>& passes, int64_t m, int threads, int repeat) {
  std::mt19937 rng(0);
  int64_t widest = 0;
  for (const auto& pass : passes)
    for (const Layer& l : pass) widest = std::max(widest, std::max(l.k, l.n));
  std::vector<float> x(m * widest), y(m * widest);
  for (auto& v : x) v = std::normal_distribution<float>()(rng);
  const int64_t lanes = m * group_count(widest / kBlock) * 8;
  Activations q{std::vector<uint8_t>(m * widest), std::vector<float>(m), std::vector<float>(m),
                std::vector<float>(lanes), std::vector<int32_t>(lanes), std::vector<float>(m * (widest / kBlock))};

  std::atomic<int> generation{0}, finished{0};
  std::atomic<bool> stop{false};
  const Layer* current = nullptr;
  auto share = [&](int id) {
    const Layer& l = *current;
    const int64_t per = ((l.n + threads - 1) / threads + 1) & ~int64_t{1};  // even: whole row pairs
    const int64_t begin = std::min<int64_t>(l.n, id * per), end = std::min<int64_t>(l.n, begin + per);
    if (begin < end) gemm_rows(q.rows(m, l.k), view(l), begin, end, y.data());
  };
  std::vector<std::thread> workers;
  for (int id = 1; id < threads; ++id)
    workers.emplace_back([&, id] {
      int seen = 0;
      while (!stop.load(std::memory_order_acquire)) {
        const int g = generation.load(std::memory_order_acquire);
        if (g == seen) continue;
        seen = g;
        share(id);
        finished.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  std::vector<double> ms;
  for (int rep = 0; rep < repeat; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (const Layer& l : passes[rep % passes.size()]) {
      if (l.row_scales.empty())  // int4 blocks, int8 blocks: per block (QuantizedRows)
        quantize_blocks(x.data(), l.k, 0, m, q.a.data(),
                        {l.block_scales.empty(), q.lane_scales.data(), q.lane_shifts.data(), q.block_scales.data()},
                        q.scale.data(), q.zero.data());
      else
        quantize_rows(x.data(), l.k, 0, m, q.a.data(), q.scale.data(), q.zero.data(), false);
      current = &l;
      finished.store(0, std::memory_order_release);
      generation.fetch_add(1, std::memory_order_acq_rel);
      share(0);
      while (finished.load(std::memory_order_acquire) != threads - 1) {
      }
    }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  stop.store(true, std::memory_order_release);
  for (auto& t : workers) t.join();
  std::sort(ms.begin(), ms.end());
  return ms;
}

// SmolLM2-135M: 30 blocks of q, k, v, o (576 -> 576, 192, 192, 576), gate and up (576 -> 1536),
// down (1536 -> 576).
int time_layers(int64_t m, int threads, int repeat, bool mlp_only, bool int8) {
  std::mt19937 rng(0);
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (n, k)
  if (!mlp_only) shapes = {{576, 576}, {192, 576}, {192, 576}, {576, 576}};
  shapes.insert(shapes.end(), {{1536, 576}, {1536, 576}, {576, 1536}});
  std::vector<std::vector<Layer>> pass(1);
  for (int block = 0; block < 30; ++block)
    for (auto [n, k] : shapes)
      pass[0].push_back(int8 ? random_int8_layer(n, k, false, rng) : random_layer(n, k, false, rng));
  const std::vector<double> ms = time_passes(pass, m, threads, repeat);
  double macs = 0;  // multiply-adds a pass
  for (const Layer& l : pass[0]) macs += static_cast<double>(l.n) * l.k * m;
  std::printf("%zu %s linear layers (%s), %lld token(s), %d thread(s), %s: min %.3f ms, median %.3f ms per pass "
              "(%d passes), %.1f GMAC/s at the median\n",
              pass[0].size(), int8 ? "int8-row" : "int4-block", mlp_only ? "gate, up, down" : "all seven per block",
              (long long)m, threads, gemm_isa_name(), ms.front(), ms[ms.size() / 2], repeat,
              macs / (ms[ms.size() / 2] * 1e6));
  return 0;
}

#if defined(__x86_64__)
// The AVX2 prompt tile's step (int4_gemm_tiles.inc, unpacked_tile with INT4_VNNI 0) in the
// instructions GCC makes of its C++ (`step`, which the tiles of fewer tokens or two rows
// still run): per token a load of its 32 activation bytes, then 3 vpmaddubsw, each reading
// a weight row from L1 as its memory operand, each product added into its own running
// 16-bit sum by vpaddw; the 12 sums in registers. In asm so that the compiler's choices are
// the tile's: an earlier version in intrinsics held the 3 weights in registers as well, and
// GCC kept its sums on the stack (100 GMAC/s on the AVX-512 EPYC, where this code runs at
// 170). `steps` steps of 4 x 3 x 32 multiply-adds.
#define PROBE_TOKEN_STEP(t, s0, s1, s2)                                                \
  "vmovdqu " #t "*32(%[x]), %%ymm12\n\t"                                               \
  "vpmaddubsw 0(%[w]), %%ymm12, %%ymm13\n\tvpaddw %%ymm13, %%ymm" #s0 ", %%ymm" #s0 "\n\t"  \
  "vpmaddubsw 32(%[w]), %%ymm12, %%ymm14\n\tvpaddw %%ymm14, %%ymm" #s1 ", %%ymm" #s1 "\n\t" \
  "vpmaddubsw 64(%[w]), %%ymm12, %%ymm15\n\tvpaddw %%ymm15, %%ymm" #s2 ", %%ymm" #s2 "\n\t"
__attribute__((target("avx2"), noinline)) void avx2_tile_steps(int64_t steps, const uint8_t* x, const int8_t* w) {
  __asm__ volatile(
      "1:\n\t" PROBE_TOKEN_STEP(0, 0, 1, 2) PROBE_TOKEN_STEP(1, 3, 4, 5) PROBE_TOKEN_STEP(2, 6, 7, 8)
          PROBE_TOKEN_STEP(3, 9, 10, 11) "dec %[n]\n\tjnz 1b\n\tvzeroupper"
      : [n] "+r"(steps)
      : [x] "r"(x), [w] "r"(w)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}

// The same step as the 4 x 3 tile runs it (step_4x3_rows_held, in asm there too): weight
// rows 0 and 1 loaded into registers once a step, row 2 read as the memory operand, and the
// token's register taking its last product (12 sums, 2 weights, the token and one product:
// AVX2's 16 registers). 10 loads a step where the C++ step makes 16.
#define PROBE_TOKEN_STEP_HELD(t, s0, s1, s2)                                           \
  "vmovdqu " #t "*32(%[x]), %%ymm12\n\t"                                               \
  "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\tvpaddw %%ymm15, %%ymm" #s0 ", %%ymm" #s0 "\n\t" \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\tvpaddw %%ymm15, %%ymm" #s1 ", %%ymm" #s1 "\n\t" \
  "vpmaddubsw 64(%[w]), %%ymm12, %%ymm12\n\tvpaddw %%ymm12, %%ymm" #s2 ", %%ymm" #s2 "\n\t"
__attribute__((target("avx2"), noinline)) void avx2_tile_steps_held(int64_t steps, const uint8_t* x,
                                                                     const int8_t* w) {
  __asm__ volatile(
      "1:\n\tvmovdqu 0(%[w]), %%ymm13\n\tvmovdqu 32(%[w]), %%ymm14\n\t" PROBE_TOKEN_STEP_HELD(0, 0, 1, 2)
          PROBE_TOKEN_STEP_HELD(1, 3, 4, 5) PROBE_TOKEN_STEP_HELD(2, 6, 7, 8) PROBE_TOKEN_STEP_HELD(3, 9, 10, 11)
              "dec %[n]\n\tjnz 1b\n\tvzeroupper"
      : [n] "+r"(steps)
      : [x] "r"(x), [w] "r"(w)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef PROBE_TOKEN_STEP
#undef PROBE_TOKEN_STEP_HELD

int time_ceiling(int repeat) {
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "int4_probe ceiling: this CPU has no AVX2\n");
    return 2;
  }
  alignas(32) uint8_t x[128];
  alignas(32) int8_t w[96];
  for (int i = 0; i < 128; ++i) x[i] = static_cast<uint8_t>(i * 7);
  for (int i = 0; i < 96; ++i) w[i] = static_cast<int8_t>(i % 15 - 7);
  const int64_t steps = 20000000;
  const struct {
    const char* name;
    void (*run)(int64_t, const uint8_t*, const int8_t*);
  } forms[2] = {{"in GCC's code of the C++ step (16 loads a step)", avx2_tile_steps},
                {"as the 4 x 3 tile runs it, two weight rows held (10 loads a step)", avx2_tile_steps_held}};
  for (const auto& form : forms) {
    std::vector<double> rates;
    for (int rep = 0; rep < repeat; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      form.run(steps, x, w);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rates.push_back(steps * 12.0 * 32 / s / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    std::printf("AVX2 tile step (12 vpmaddubsw + 12 vpaddw), %s, 1 thread: median %.1f GMAC/s, max %.1f (%d runs)\n",
                form.name, rates[rates.size() / 2], rates.back(), repeat);
  }
  return 0;
}
#endif

// SmolLM2-135M's output layer (576 -> 49152) for one token, as a decode step computes it:
// int8 rows or int8 blocks (its GGUF's tied Q8_0 table). `copies` of it, a pass each in
// turn, so that passes read the weights from memory, not from a last-level cache that holds
// one copy (the Xeon's 300 MiB holds the whole program: docs/performance.md).
int time_output(int threads, int repeat, bool blocks, int copies) {
  std::mt19937 rng(0);
  const int64_t n = 49152, k = 576;
  std::vector<std::vector<Layer>> passes(copies);
  for (auto& pass : passes)
    pass.push_back(blocks ? random_int8_blocks_layer(n, k, false, rng) : random_int8_layer(n, k, false, rng));
  const std::vector<double> ms = time_passes(passes, 1, threads, repeat);
  const double bytes = n * k + n * (blocks ? k / kBlock * 2 : 4) + n * 4.0;  // values, scales, row sums
  std::printf("output layer %lldx%lld as %s, %d copies (%.0f MiB), 1 token, %d thread(s), %s: min %.3f ms, "
              "median %.3f ms per pass (%d passes), %.1f GB/s at the median\n",
              (long long)n, (long long)k, blocks ? "int8 blocks" : "int8 rows", copies,
              copies * bytes / (1 << 20), threads, gemm_isa_name(), ms.front(), ms[ms.size() / 2], repeat,
              bytes / (ms[ms.size() / 2] * 1e6));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "check") return check();
  if (mode == "time" && argc >= 4) {
    const int64_t m = std::atoll(argv[2]);
    const int threads = std::atoi(argv[3]);
    const int repeat = argc > 4 ? std::atoi(argv[4]) : 15;
    bool mlp = false, int8 = false;
    for (int i = 5; i < argc; ++i) {
      mlp = mlp || std::string(argv[i]) == "mlp";
      int8 = int8 || std::string(argv[i]) == "int8";
    }
    if (m < 1 || threads < 1 || repeat < 1) {
      std::fprintf(stderr, "int4_probe: TOKENS, THREADS and REPEAT must be positive\n");
      return 2;
    }
    return time_layers(m, threads, repeat, mlp, int8);
  }
  if (mode == "output" && argc >= 3) {
    const int threads = std::atoi(argv[2]);
    const int repeat = argc > 3 ? std::atoi(argv[3]) : 48;
    const bool blocks = argc > 4 && std::string(argv[4]) == "blocks";
    const int copies = argc > 5 ? std::atoi(argv[5]) : 12;
    if (threads < 1 || repeat < 1 || copies < 1) {
      std::fprintf(stderr, "int4_probe: THREADS, REPEAT and COPIES must be positive\n");
      return 2;
    }
    return time_output(threads, repeat, blocks, copies);
  }
#if defined(__x86_64__)
  if (mode == "ceiling") return time_ceiling(argc > 2 ? std::max(1, std::atoi(argv[2])) : 5);
#endif
  std::fprintf(stderr, "usage: int4_probe check | int4_probe time TOKENS THREADS [REPEAT] [mlp] [int8] | "
                       "int4_probe ceiling [REPEAT] | int4_probe output THREADS [REPEAT] [rows|blocks] [COPIES]\n");
  return 2;
}
