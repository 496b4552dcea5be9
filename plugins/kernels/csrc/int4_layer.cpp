// llmcore::int4_norm_qkv_rope.out, llmcore::int4_linear_add.out, llmcore::int4_norm_mlp_add.out:
// a Llama layer's int4 projections, norms and residual adds (int4_layer.h says why;
// llmcore::int4_norm_qkv_norm_rope.out with Qwen3's and Gemma 3's per-head q/k norms), and
// llmcore::int4_linear.out, the output layer after them; llmcore::int4_linear_norm_add.out and
// llmcore::int4_norm_glu_add.out for layers with sandwich norms or a GeGLU MLP.
//
// Registered with the ExecuTorch runtime this library links, like llmcore::int4_mlp.
#include "int4_layer.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>

#include "int4_executorch.h"
#include "rms_norm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace llmcore_kernels {

namespace {

constexpr int kFloat = 6;  // ScalarType::Float, as rms_norm.h takes it

// out [rows, dim] = rms_norm(h) with the operator llmcore::rms_norm runs.
void rms_norm(const float* h, int64_t rows, int64_t dim, const float* weight, double eps, float* out) {
  const int64_t sizes[2] = {rows, dim};
  llmcore_kernels_rms_norm(kFloat, 2, sizes, h, weight, eps, out);
}

// out[j], out[j + 1] = y[j] cos[j] - y[j + 1] sin[j], y[j + 1] cos[j + 1] + y[j] sin[j + 1]
// for the pairs of [0, count) (count even): a RoPE rotation of interleaved channel pairs, each
// product rounded and then added, as the module computes it (-ffp-contract=off: no fused
// multiply-add). Eight channels a step where the CPU has AVX2, the same operations lane by
// lane (the odd channel's negation exact), where the baseline build's loop took four.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) int64_t rotate_pairs_avx2(const float* y, const float* cos, const float* sin,
                                                          int64_t count, float* out) {
  const __m256 signs = _mm256_setr_ps(-1.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f);
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 v = _mm256_loadu_ps(y + j);
    const __m256 swapped = _mm256_mul_ps(_mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)), signs);  // -odd, even
    _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(cos + j)),
                                            _mm256_mul_ps(swapped, _mm256_loadu_ps(sin + j))));
  }
  return j;
}
#endif

void rotate_pairs(const float* y, const float* cos, const float* sin, int64_t count, float* out) {
  int64_t j = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (int4::uses_avx2()) j = rotate_pairs_avx2(y, cos, sin, count, out);  // the GEMM's CPU check
#endif
  for (; j < count; j += 2) {
    const float even = y[j], odd = y[j + 1];
    out[j] = even * cos[j] + (-odd) * sin[j];
    out[j + 1] = odd * cos[j + 1] + even * sin[j + 1];
  }
}

// Columns [n_begin, n_end) (even bounds) of one token's qkv row y into its rows of q, k and
// v: q's and k's interleaved channel pairs rotated by the token's cos and sin rows, v's
// copied. q_width and kv_width are whole heads of head_dim.
void place_columns(const float* y, int64_t n_begin, int64_t n_end, int64_t q_width, int64_t kv_width,
                   int64_t head_dim, const float* cos, const float* sin, float* q, float* k, float* v) {
  // each part as (its first column, its width, where it goes, rotated or not)
  const struct {
    int64_t first, width;
    float* out;
    bool rotate;
  } parts[3] = {{0, q_width, q, true}, {q_width, kv_width, k, true}, {q_width + kv_width, kv_width, v, false}};
  for (const auto& part : parts) {
    const int64_t b = std::max(n_begin, part.first), e = std::min(n_end, part.first + part.width);
    if (b >= e) continue;
    if (!part.rotate) {
      std::copy(y + b, y + e, part.out + (b - part.first));
      continue;
    }
    // head by head from the head holding column b: no division a pair
    for (int64_t c = b, i = (b - part.first) % head_dim; c < e; c += head_dim - i, i = 0) {
      const int64_t pairs_end = std::min(e - c, head_dim - i);
      rotate_pairs(y + c, cos + i, sin + i, pairs_end, part.out + (c - part.first));
    }
  }
}

// out's rows [rows, dim] = residual + rms_norm(y): y's rows normed in place, then added to
// the residual (the order of `x + post_norm(a)` in the module), the rows split among the threads.
void norm_add_rows(float* y, int64_t rows, int64_t dim, const float* norm_weight, double eps, const float* residual,
                   float* out, const ParallelFor& parallel) {
  auto body = [&](int64_t b, int64_t e) {
    rms_norm(y + b * dim, e - b, dim, norm_weight, eps, y + b * dim);  // reads each value before it writes it
    for (int64_t i = b * dim; i < e * dim; ++i) out[i] = residual[i] + y[i];
  };
  if (rows == 1)
    body(0, 1);  // one token: not worth waking the pool
  else
    parallel(0, rows, body);
}

// out [rows, dim] = layer_norm(x): each row's mean, then its mean square deviation, in eight
// running sums each (independent lanes the compiler vectorises), then (x - mean) * rstd *
// weight + bias. PyTorch's CPU kernel rounds its own way (x * rstd - mean * rstd, fused):
// the two differ by float rounding, which the swap check's tolerance allows.
void layer_norm_rows(const float* x, int64_t rows, int64_t dim, const LayerNorm& norm, float* out) {
  constexpr int kLanes = 8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    float lanes[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= dim; c += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += xr[c + l];
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    for (; c < dim; ++c) sum += xr[c];
    const float mean = sum / static_cast<float>(dim);
    float squares[kLanes] = {};
    for (c = 0; c + kLanes <= dim; c += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float d = xr[c + l] - mean;
        squares[l] += d * d;
      }
    float deviation = 0.0f;
    for (int l = 0; l < kLanes; ++l) deviation += squares[l];
    for (; c < dim; ++c) deviation += (xr[c] - mean) * (xr[c] - mean);
    const float rstd = 1.0f / std::sqrt(deviation / static_cast<float>(dim) + static_cast<float>(norm.eps));
    for (c = 0; c < dim; ++c) {
      const float normed = (xr[c] - mean) * rstd * norm.weight[c];
      yr[c] = norm.bias != nullptr ? normed + norm.bias[c] : normed;
    }
  }
}

// The heads qkv's rows hold: q's, k's and, unless v has a weight of its own, v's.
int64_t stacked_heads(const Int4NormQkvRope& a) { return a.n_heads + (a.v == nullptr ? 2 : 1) * a.n_kv_heads; }

}  // namespace

const char* int4_norm_qkv_rope_shape_error(const Int4NormQkvRope& a, int64_t* head_dim) {
  if (a.qkv.k <= 0 || a.qkv.k % int4::kBlock != 0) return "the model dimension must be a positive multiple of 32";
  if (a.n_heads <= 0 || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0)
    return "n_heads must be a positive multiple of n_kv_heads";
  const int64_t heads = stacked_heads(a);
  if (a.qkv.n % heads != 0 || (a.qkv.n / heads) % 2 != 0)
    return a.v == nullptr ? "qkv's rows must be (n_heads + 2 n_kv_heads) heads of an even width"
                          : "qkv's rows must be (n_heads + n_kv_heads) heads of an even width (v apart)";
  if (a.v != nullptr && (a.v->k != a.qkv.k || a.v->n != a.n_kv_heads * (a.qkv.n / heads)))
    return "v must take the model dimension and give n_kv_heads heads of q's and k's width";
  if (a.v != nullptr && (a.v->format == int4::Format::int8_blocks || a.v->format == int4::Format::q6_k))
    return "v holds int8 blocks or Q6_K super-blocks (only the output layer's operator takes them)";
  if (!(a.eps >= 0.0) || !std::isfinite(a.eps)) return "eps must be finite and >= 0";
  if ((a.q_norm == nullptr) != (a.k_norm == nullptr)) return "q_norm and k_norm come together";
  if (a.q_norm != nullptr && (!(a.qk_eps >= 0.0) || !std::isfinite(a.qk_eps)))
    return "qk_eps must be finite and >= 0";
  *head_dim = a.qkv.n / heads;
  return nullptr;
}

void int4_norm_qkv_rope_forward(const float* h, int64_t rows, const Int4NormQkvRope& a, const float* cos,
                                const float* sin, float* q, float* k, float* v, const ParallelFor& parallel) {
  const int64_t dim = a.qkv.k, n = a.qkv.n, head_dim = n / stacked_heads(a);
  thread_local std::vector<float> normed, y;
  thread_local RoundedRows rounded, rounded_for_v;
  normed.resize(rows * dim);
  y.resize(rows * n);
  float *nv = normed.data(), *yv = y.data();
  // The norm, the rounding, the GEMM and RoPE in two parallel regions: each thread norms
  // and rounds its rows, then places the columns it computed.
  const int4::QuantizedRows x = rounded.round(nv, rows, parallel, a.qkv, [&](int64_t b, int64_t e) {
    rms_norm(h + b * dim, e - b, dim, a.norm_weight, a.eps, nv + b * dim);
  });
  if (a.v != nullptr) {
    // v of its own kind: the same normed rows rounded for its layout (the same int8 values,
    // in x's order for int8 rows), its GEMM writing v's rows as they are (no RoPE), before
    // q's and k's, whose placing never reaches v's columns (qkv ends with k's).
    gemm_all(rounded_for_v.round(nv, rows, parallel, *a.v), *a.v, v, parallel);
  }
  const int64_t q_width = a.n_heads * head_dim, kv_width = a.n_kv_heads * head_dim;
  if (a.q_norm == nullptr) {
    gemm_all(x, a.qkv, yv, parallel, [&](int64_t n_begin, int64_t n_end) {
      for (int64_t t = 0; t < rows; ++t)
        place_columns(yv + t * n, n_begin, n_end, q_width, kv_width, head_dim, cos + t * head_dim,
                      sin + t * head_dim, q + t * q_width, k + t * kv_width, v + t * kv_width);
    });
    return;
  }
  // A head's norm needs all its columns, which several threads compute: the GEMM first,
  // then each token's q and k heads normed in place and its row placed, the tokens split
  // among the threads.
  gemm_all(x, a.qkv, yv, parallel);
  auto norm_and_place = [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* yt = yv + t * n;
      rms_norm(yt, a.n_heads, head_dim, a.q_norm, a.qk_eps, yt);  // reads each value before it writes it
      rms_norm(yt + q_width, a.n_kv_heads, head_dim, a.k_norm, a.qk_eps, yt + q_width);
      place_columns(yt, 0, n, q_width, kv_width, head_dim, cos + t * head_dim, sin + t * head_dim, q + t * q_width,
                    k + t * kv_width, v + t * kv_width);
    }
  };
  if (rows == 1)
    norm_and_place(0, 1);  // one token: not worth waking the pool
  else
    parallel(0, rows, norm_and_place);
}

void int4_linear_forward(const float* x, int64_t rows, const int4::PackedWeight& w, float* out,
                         const ParallelFor& parallel) {
  thread_local RoundedRows rounded;
  gemm_all(rounded.round(x, rows, parallel, w), w, out, parallel);
}

void int4_linear_add_forward(const float* x, int64_t rows, const int4::PackedWeight& w, const float* residual,
                             float* out, const ParallelFor& parallel) {
  thread_local RoundedRows rounded;
  thread_local std::vector<float> y;
  y.resize(rows * w.n);
  float* yv = y.data();
  gemm_all(rounded.round(x, rows, parallel, w), w, yv, parallel, [&](int64_t n_begin, int64_t n_end) {
    add_residual_columns(residual, yv, rows, w.n, n_begin, n_end, out);  // residual + linear(x)
  });
}

void int4_linear_norm_add_forward(const float* x, int64_t rows, const int4::PackedWeight& w, const float* norm_weight,
                                  double eps, const float* residual, float* out, const ParallelFor& parallel) {
  thread_local RoundedRows rounded;
  thread_local std::vector<float> y;
  y.resize(rows * w.n);
  // the norm needs whole rows: the GEMM's columns first, then a pass over the rows
  gemm_all(rounded.round(x, rows, parallel, w), w, y.data(), parallel);
  norm_add_rows(y.data(), rows, w.n, norm_weight, eps, residual, out, parallel);
}

void int4_norm_mlp_add_forward(const float* h, int64_t rows, const float* norm_weight, double eps,
                               const Int4MlpWeights& w, float* out, const ParallelFor& parallel,
                               const float* post_norm_weight, double post_eps) {
  const int64_t dim = w.gate_up.k;
  thread_local std::vector<float> normed, mlp_out;
  normed.resize(rows * dim);
  float* nv = normed.data();
  auto norm = [&](int64_t b, int64_t e) { rms_norm(h + b * dim, e - b, dim, norm_weight, eps, nv + b * dim); };
  if (post_norm_weight == nullptr) return int4_mlp_forward(nv, rows, w, out, parallel, norm, /*residual=*/h);
  mlp_out.resize(rows * dim);
  int4_mlp_forward(nv, rows, w, mlp_out.data(), parallel, norm);
  norm_add_rows(mlp_out.data(), rows, dim, post_norm_weight, post_eps, h, out, parallel);
}

const char* int4_ffn_shape_error(const Int4FfnWeights& w) {
  if (w.up.k <= 0 || w.up.k % int4::kBlock != 0) return "the model dimension must be a positive multiple of 32";
  if (w.up.n <= 0 || w.up.n % int4::kBlock != 0) return "up's rows (the hidden size) must be a positive multiple of 32";
  if (w.down.k != w.up.n || w.down.n != w.up.k) return "down must map the hidden size back to the model dimension";
  return nullptr;
}

void int4_layer_norm_linear_forward(const float* h, int64_t rows, const LayerNorm& norm, const int4::PackedWeight& w,
                                    float* out, const ParallelFor& parallel) {
  thread_local std::vector<float> normed;
  thread_local RoundedRows rounded;
  normed.resize(rows * w.k);
  float* nv = normed.data();
  // each thread norms and rounds its rows, then the GEMM (its bias included)
  const int4::QuantizedRows x = rounded.round(nv, rows, parallel, w, [&](int64_t b, int64_t e) {
    layer_norm_rows(h + b * w.k, e - b, w.k, norm, nv + b * w.k);
  });
  gemm_all(x, w, out, parallel);
}

void int4_layer_norm_ffn_add_forward(const float* h, int64_t rows, const LayerNorm& norm, const Int4FfnWeights& w,
                                     float* out, const ParallelFor& parallel) {
  const int64_t dim = w.up.k, hidden = w.up.n;
  thread_local RoundedRows rounded_x, rounded_hidden;
  thread_local std::vector<float> normed, hidden_values, down;
  normed.resize(rows * dim);
  hidden_values.resize(rows * hidden);
  down.resize(rows * dim);
  float *nv = normed.data(), *hv = hidden_values.data(), *dv = down.data();
  const int4::QuantizedRows x = rounded_x.round(nv, rows, parallel, w.up, [&](int64_t b, int64_t e) {
    layer_norm_rows(h + b * dim, e - b, dim, norm, nv + b * dim);
  });
  // the activation on each thread's columns of up(x) + bias as soon as it has them
  gemm_all(x, w.up, hv, parallel, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t t = 0; t < rows; ++t) activate(w.activation, hv + t * hidden + n_begin, n_end - n_begin);
  });
  const int4::QuantizedRows qh = rounded_hidden.round(hv, rows, parallel, w.down);
  gemm_all(qh, w.down, dv, parallel, [&](int64_t n_begin, int64_t n_end) {
    add_residual_columns(h, dv, rows, dim, n_begin, n_end, out);  // h + mlp(ln(h)), its bias in mlp's output
  });
}

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

namespace {

// A float32 vector of `size` values (a norm's weight), or why not.
const char* float_vector(const Tensor& t, int64_t size) {
  if (t.scalar_type() != ScalarType::Float || t.dim() != 1 || t.size(0) != size || !et::dense(t))
    return "the norm's weight must be a contiguous float32 vector of the model dimension";
  return nullptr;
}

// rows of `width` floats: a dense float32 tensor whose last size is width.
bool rows_of(const Tensor& t, int64_t width) {
  return t.scalar_type() == ScalarType::Float && t.dim() >= 1 && t.size(t.dim() - 1) == width && et::dense(t);
}

// An optional float32 vector of `size` values (a bias): its data into *data when given; false
// when it is given in another form.
bool optional_vector(const std::optional<Tensor>& t, int64_t size, const float** data) {
  if (!t.has_value()) return true;
  if (!rows_of(*t, size) || t->dim() != 1) return false;
  *data = t->const_data_ptr<float>();
  return true;
}

// One projection's tensors (et::projection's), its block offsets and bias into *pw, or why not.
const char* projection_with_bias(const Tensor& w, const Tensor& scales, const Tensor& sums,
                                 const std::optional<Tensor>& bias, const std::optional<Tensor>& offsets,
                                 int4::PackedWeight* pw) {
  const char* why = et::projection(w, scales, sums, pw);
  if (why == nullptr) why = et::block_offsets(offsets, pw);
  if (why == nullptr && !optional_vector(bias, pw->n, &pw->bias))
    why = "its bias must be a contiguous float32 vector of its rows";
  return why;
}

// `out` resized to `base`'s sizes with its last one replaced by `last` (one size or more).
Error resize_last(Tensor& out, const Tensor& base, std::initializer_list<int64_t> last) {
  executorch::aten::SizesType sizes[executorch::runtime::kTensorDimensionLimit];
  const int64_t d = base.dim(), n = d - 1 + static_cast<int64_t>(last.size());
  if (d < 1 || n > static_cast<int64_t>(executorch::runtime::kTensorDimensionLimit)) return Error::InvalidArgument;
  for (int64_t i = 0; i + 1 < d; ++i) sizes[i] = base.size(i);
  std::copy(last.begin(), last.end(), sizes + d - 1);
  return executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(n)});
}

}  // namespace

// llmcore::int4_norm_qkv_rope.out(Tensor h, Tensor norm_weight, float eps, Tensor qkv, Tensor qkv_scales,
//     Tensor qkv_sums, Tensor? qkv_bias, Tensor? qkv_offsets, Tensor cos, Tensor sin, int n_heads, int n_kv_heads,
//     Tensor? v_weight=None, Tensor? v_scales=None, Tensor? v_sums=None, Tensor? v_offsets=None,
//     *, Tensor(a!) q, Tensor(b!) k, Tensor(c!) v) -> (Tensor(a!), Tensor(b!), Tensor(c!))
namespace {

// v's own weight (int4_layer.h: Int4NormQkvRope::v), read from the operator's optional tensors.
struct SeparateV {
  const Tensor* weight = nullptr;  // null: qkv holds v's rows
  const Tensor* scales = nullptr;
  const Tensor* sums = nullptr;
  std::optional<Tensor> offsets;
};

// The work of int4_norm_qkv_rope (q_norm null) and int4_norm_qkv_norm_rope, its checks named after `op`.
void norm_qkv_rope(KernelRuntimeContext& ctx, const char* op, const Tensor& h, const Tensor& norm_weight, double eps,
                   const Tensor& qkv, const Tensor& qkv_scales, const Tensor& qkv_sums, const Tensor* qkv_bias,
                   const std::optional<Tensor>& qkv_offsets, const Tensor* q_norm, const Tensor* k_norm,
                   double qk_eps, const Tensor& cos, const Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                   const SeparateV& separate_v, Tensor& q, Tensor& k, Tensor& v) {
  Int4NormQkvRope a{};
  const char* why = et::projection(qkv, qkv_scales, qkv_sums, &a.qkv);
  if (why == nullptr) why = et::block_offsets(qkv_offsets, &a.qkv);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: qkv: %s", op, why);
  int4::PackedWeight v_weight{};
  if (separate_v.weight != nullptr) {
    ET_KERNEL_CHECK_MSG(ctx, separate_v.scales != nullptr && separate_v.sums != nullptr, InvalidArgument, ,
                        "%s: v comes with v_scales and v_sums", op);
    why = et::projection(*separate_v.weight, *separate_v.scales, *separate_v.sums, &v_weight);
    if (why == nullptr) why = et::block_offsets(separate_v.offsets, &v_weight);
    ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: v: %s", op, why);
    a.v = &v_weight;
  }
  if (qkv_bias != nullptr) {
    // q's, k's and v's biases one after another, v's apart or not
    const int64_t rows = a.qkv.n + (a.v != nullptr ? a.v->n : 0);
    ET_KERNEL_CHECK_MSG(ctx, rows_of(*qkv_bias, rows) && qkv_bias->dim() == 1, InvalidArgument, ,
                        "%s: qkv_bias must be a contiguous float32 vector of q's, k's and v's rows", op);
    a.qkv.bias = qkv_bias->const_data_ptr<float>();
    if (a.v != nullptr) v_weight.bias = a.qkv.bias + a.qkv.n;
  }
  a.eps = eps;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  if (q_norm != nullptr) {
    a.q_norm = q_norm->const_data_ptr<float>();
    a.k_norm = k_norm->const_data_ptr<float>();
    a.qk_eps = qk_eps;
  }
  int64_t head_dim = 0;
  why = int4_norm_qkv_rope_shape_error(a, &head_dim);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: %s", op, why);
  why = float_vector(norm_weight, a.qkv.k);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: %s", op, why);
  if (q_norm != nullptr) {
    why = float_vector(*q_norm, head_dim);
    if (why == nullptr) why = float_vector(*k_norm, head_dim);
    ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: q_norm, k_norm: %s", op, why);
  }
  a.norm_weight = norm_weight.const_data_ptr<float>();
  ET_KERNEL_CHECK_MSG(ctx, rows_of(h, a.qkv.k), InvalidArgument, ,
                      "%s: h must be contiguous float32 rows of the model dimension (%lld)", op,
                      (long long)a.qkv.k);
  const int64_t rows = h.numel() / a.qkv.k;
  ET_KERNEL_CHECK_MSG(ctx, rows_of(cos, head_dim) && rows_of(sin, head_dim) && cos.numel() == rows * head_dim &&
                               sin.numel() == rows * head_dim,
                      InvalidArgument, , "%s: cos and sin must hold one float32 row of head_dim (%lld) per token", op,
                      (long long)head_dim);
  ET_KERNEL_CHECK(ctx, resize_last(q, h, {n_heads, head_dim}) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK(ctx, resize_last(k, h, {n_kv_heads, head_dim}) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK(ctx, resize_last(v, h, {n_kv_heads, head_dim}) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK_MSG(ctx, rows_of(q, head_dim) && rows_of(k, head_dim) && rows_of(v, head_dim), InvalidArgument, ,
                      "%s: q, k and v must be contiguous float32", op);
  if (rows == 0) return;
  int4_norm_qkv_rope_forward(h.const_data_ptr<float>(), rows, a, cos.const_data_ptr<float>(),
                             sin.const_data_ptr<float>(), q.mutable_data_ptr<float>(), k.mutable_data_ptr<float>(),
                             v.mutable_data_ptr<float>(), et::runtime_parallel);
}

}  // namespace

// llmcore::int4_norm_qkv_norm_rope.out(Tensor h, Tensor norm_weight, float eps, Tensor qkv, Tensor qkv_scales,
//     Tensor qkv_sums, Tensor? qkv_bias, Tensor? qkv_offsets, Tensor q_norm, Tensor k_norm, float qk_eps,
//     Tensor cos, Tensor sin, int n_heads, int n_kv_heads, Tensor? v_weight=None, Tensor? v_scales=None,
//     Tensor? v_sums=None, Tensor? v_offsets=None, *, Tensor(a!) q, Tensor(b!) k, Tensor(c!) v)
//     -> (Tensor(a!), Tensor(b!), Tensor(c!))
// (both unboxed below, in int4_norm_qkv_rope_boxed and int4_norm_qkv_norm_rope_boxed)

namespace {

// The work of int4_linear_add (norm_weight null) and int4_linear_norm_add, its checks named
// after `op`: out = residual + x W^T, or residual + rms_norm(x W^T).
void linear_residual(KernelRuntimeContext& ctx, const char* op, const Tensor& x, const Tensor& w,
                     const Tensor& w_scales, const Tensor& w_sums, const std::optional<Tensor>& w_offsets,
                     const Tensor* norm_weight, double eps, const Tensor& residual, Tensor& out,
                     const std::optional<Tensor>& w_bias = std::nullopt) {
  int4::PackedWeight pw{};
  const char* why = projection_with_bias(w, w_scales, w_sums, w_bias, w_offsets, &pw);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: w: %s", op, why);
  if (norm_weight != nullptr) {
    why = float_vector(*norm_weight, pw.n);
    ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: %s", op, why);
    ET_KERNEL_CHECK_MSG(ctx, std::isfinite(eps) && eps >= 0.0, InvalidArgument, , "%s: eps must be finite and >= 0",
                        op);
  }
  ET_KERNEL_CHECK_MSG(ctx, rows_of(x, pw.k), InvalidArgument, ,
                      "%s: x must be contiguous float32 rows of w's in-features (%lld)", op, (long long)pw.k);
  const int64_t rows = x.numel() / pw.k;
  ET_KERNEL_CHECK_MSG(ctx, rows_of(residual, pw.n) && residual.numel() == rows * pw.n, InvalidArgument, ,
                      "%s: residual must be contiguous float32, one row of w's out-features (%lld) per row of x", op,
                      (long long)pw.n);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, residual.sizes()) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK_MSG(ctx, rows_of(out, pw.n), InvalidArgument, , "%s: out must be contiguous float32", op);
  if (rows == 0) return;
  if (norm_weight == nullptr)
    int4_linear_add_forward(x.const_data_ptr<float>(), rows, pw, residual.const_data_ptr<float>(),
                            out.mutable_data_ptr<float>(), et::runtime_parallel);
  else
    int4_linear_norm_add_forward(x.const_data_ptr<float>(), rows, pw, norm_weight->const_data_ptr<float>(), eps,
                                 residual.const_data_ptr<float>(), out.mutable_data_ptr<float>(), et::runtime_parallel);
}

// The work of int4_norm_mlp_add (silu, no post-norm) and int4_norm_glu_add, its checks named
// after `op`: out = h + mlp(rms_norm(h)), or h + rms_norm(mlp(rms_norm(h))) with the post-norm.
void norm_mlp_residual(KernelRuntimeContext& ctx, const char* op, const Tensor& h, const Tensor& norm_weight,
                       double eps, const Tensor& gate_up, const Tensor& gate_up_scales, const Tensor& gate_up_sums,
                       const std::optional<Tensor>& gate_up_offsets, const Tensor& down, const Tensor& down_scales,
                       const Tensor& down_sums, const std::optional<Tensor>& down_offsets,
                       std::string_view activation, const std::optional<Tensor>& post_norm_weight, double post_eps,
                       Tensor& out) {
  kernel_threads_for_whole_layers();  // a program of whole layers: the own threads (kernel_threads.h)
  Int4MlpWeights w{};
  const char* part = "";
  const char* why = et::mlp_weights(gate_up, gate_up_scales, gate_up_sums, down, down_scales, down_sums, &w, &part);
  if (why == nullptr && (why = et::block_offsets(gate_up_offsets, &w.gate_up)) != nullptr) part = "gate_up: ";
  if (why == nullptr && (why = et::block_offsets(down_offsets, &w.down)) != nullptr) part = "down: ";
  if (why == nullptr && (why = glu_activation(activation, &w.activation)) != nullptr) part = "";
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: %s%s", op, part, why);
  why = float_vector(norm_weight, w.gate_up.k);
  if (why == nullptr && post_norm_weight.has_value()) why = float_vector(*post_norm_weight, w.gate_up.k);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, , "%s: %s", op, why);
  ET_KERNEL_CHECK_MSG(ctx, std::isfinite(eps) && eps >= 0.0, InvalidArgument, , "%s: eps must be finite and >= 0", op);
  ET_KERNEL_CHECK_MSG(ctx, std::isfinite(post_eps) && post_eps >= 0.0, InvalidArgument, ,
                      "%s: post_eps must be finite and >= 0", op);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(h, w.gate_up.k), InvalidArgument, ,
                      "%s: h must be contiguous float32 rows of the model dimension (%lld)", op,
                      (long long)w.gate_up.k);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, h.sizes()) == Error::Ok, InvalidArgument, );
  ET_KERNEL_CHECK_MSG(ctx, rows_of(out, w.gate_up.k), InvalidArgument, , "%s: out must be contiguous float32", op);
  if (h.numel() == 0) return;
  int4_norm_mlp_add_forward(h.const_data_ptr<float>(), h.numel() / w.gate_up.k, norm_weight.const_data_ptr<float>(),
                            eps, w, out.mutable_data_ptr<float>(), et::runtime_parallel,
                            post_norm_weight.has_value() ? post_norm_weight->const_data_ptr<float>() : nullptr,
                            post_eps);
}

}  // namespace

// llmcore::int4_linear_add.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_offsets,
//     Tensor residual, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_linear_add_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, const Tensor& w_scales,
                            const Tensor& w_sums, const std::optional<Tensor>& w_offsets, const Tensor& residual,
                            Tensor& out) {
  linear_residual(ctx, "llmcore::int4_linear_add", x, w, w_scales, w_sums, w_offsets, nullptr, 0.0, residual, out);
  return out;
}

// llmcore::int4_linear.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_bias,
//     Tensor? w_offsets, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_linear_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, const Tensor& w_scales,
                        const Tensor& w_sums, const std::optional<Tensor>& w_bias,
                        const std::optional<Tensor>& w_offsets, Tensor& out) {
  int4::PackedWeight pw{};
  const char* why = projection_with_bias(w, w_scales, w_sums, w_bias, w_offsets, &pw);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "llmcore::int4_linear: w: %s", why);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(x, pw.k), InvalidArgument, out,
                      "llmcore::int4_linear: x must be contiguous float32 rows of w's in-features (%lld)",
                      (long long)pw.k);
  ET_KERNEL_CHECK(ctx, resize_last(out, x, {pw.n}) == Error::Ok, InvalidArgument, out);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(out, pw.n), InvalidArgument, out,
                      "llmcore::int4_linear: out must be contiguous float32");
  const int64_t rows = x.numel() / pw.k;
  if (rows == 0) return out;
  int4_linear_forward(x.const_data_ptr<float>(), rows, pw, out.mutable_data_ptr<float>(), et::runtime_parallel);
  return out;
}

// llmcore::q6_k_embedding.out(Tensor weight, Tensor indices, *, Tensor(a!) out) -> Tensor(a!): rows of a
// Q6_K table (int4_gemm.h, Format::q6_k: the file's super-blocks; the output layer's own tensor
// when the two are tied) as float32, out [*indices.shape, in].
Tensor& q6_k_embedding_out(KernelRuntimeContext& ctx, const Tensor& weight, const Tensor& indices, Tensor& out) {
  constexpr const char* op = "llmcore::q6_k_embedding";
  ET_KERNEL_CHECK_MSG(ctx, weight.scalar_type() == ScalarType::Byte && weight.dim() == 3 &&
                               weight.size(2) == int4::kQ6KBytes && et::dense(weight),
                      InvalidArgument, out, "%s: weight must be a contiguous [rows, in/256, 210] uint8 tensor", op);
  int4::PackedWeight pw{};
  pw.format = int4::Format::q6_k;
  pw.packed = weight.const_data_ptr<uint8_t>();
  pw.n = weight.size(0);
  pw.k = int4::kQ6KValues * weight.size(1);
  ET_KERNEL_CHECK_MSG(ctx, indices.scalar_type() == ScalarType::Long && et::dense(indices), InvalidArgument, out,
                      "%s: indices must be a contiguous int64 tensor", op);
  const int64_t count = indices.numel();
  const int64_t* ids = indices.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    ET_KERNEL_CHECK_MSG(ctx, ids[i] >= 0 && ids[i] < pw.n, InvalidArgument, out,
                        "%s: index %lld is outside the table's %lld rows", op, (long long)ids[i], (long long)pw.n);
  executorch::aten::SizesType sizes[executorch::runtime::kTensorDimensionLimit];
  const int64_t d = indices.dim();
  ET_KERNEL_CHECK(ctx, d + 1 <= static_cast<int64_t>(executorch::runtime::kTensorDimensionLimit), InvalidArgument,
                  out);
  for (int64_t i = 0; i < d; ++i) sizes[i] = indices.size(i);
  sizes[d] = pw.k;
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(d + 1)}) == Error::Ok,
                  InvalidArgument, out);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(out, pw.k), InvalidArgument, out, "%s: out must be contiguous float32", op);
  float* rows = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) int4::q6_k_row_values(pw, ids[i], rows + i * pw.k);
  return out;
}

// llmcore::int4_norm_mlp_add.out(Tensor h, Tensor norm_weight, float eps, Tensor gate_up, Tensor gate_up_scales,
//     Tensor gate_up_sums, Tensor? gate_up_offsets, Tensor down, Tensor down_scales, Tensor down_sums,
//     Tensor? down_offsets, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_norm_mlp_add_out(KernelRuntimeContext& ctx, const Tensor& h, const Tensor& norm_weight, double eps,
                              const Tensor& gate_up, const Tensor& gate_up_scales, const Tensor& gate_up_sums,
                              const std::optional<Tensor>& gate_up_offsets, const Tensor& down,
                              const Tensor& down_scales, const Tensor& down_sums,
                              const std::optional<Tensor>& down_offsets, Tensor& out) {
  norm_mlp_residual(ctx, "llmcore::int4_norm_mlp_add", h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums,
                    gate_up_offsets, down, down_scales, down_sums, down_offsets, "silu", std::nullopt, 0.0, out);
  return out;
}

// llmcore::int4_linear_norm_add.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_offsets,
//     Tensor norm_weight, float eps, Tensor residual, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_linear_norm_add_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, const Tensor& w_scales,
                                 const Tensor& w_sums, const std::optional<Tensor>& w_offsets,
                                 const Tensor& norm_weight, double eps, const Tensor& residual, Tensor& out) {
  linear_residual(ctx, "llmcore::int4_linear_norm_add", x, w, w_scales, w_sums, w_offsets, &norm_weight, eps,
                  residual, out);
  return out;
}

// llmcore::int4_norm_glu_add.out(Tensor h, Tensor norm_weight, float eps, Tensor gate_up, Tensor gate_up_scales,
//     Tensor gate_up_sums, Tensor? gate_up_offsets, Tensor down, Tensor down_scales, Tensor down_sums,
//     Tensor? down_offsets, str activation, Tensor? post_norm_weight, float post_eps, *, Tensor(a!) out)
//     -> Tensor(a!)
Tensor& int4_norm_glu_add_out(KernelRuntimeContext& ctx, const Tensor& h, const Tensor& norm_weight, double eps,
                              const Tensor& gate_up, const Tensor& gate_up_scales, const Tensor& gate_up_sums,
                              const std::optional<Tensor>& gate_up_offsets, const Tensor& down,
                              const Tensor& down_scales, const Tensor& down_sums,
                              const std::optional<Tensor>& down_offsets, std::string_view activation,
                              const std::optional<Tensor>& post_norm_weight, double post_eps, Tensor& out) {
  norm_mlp_residual(ctx, "llmcore::int4_norm_glu_add", h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums,
                    gate_up_offsets, down, down_scales, down_sums, down_offsets, activation, post_norm_weight,
                    post_eps, out);
  return out;
}

// llmcore::int4_linear_bias_add.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_bias,
//     Tensor? w_offsets, Tensor residual, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_linear_bias_add_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, const Tensor& w_scales,
                                 const Tensor& w_sums, const std::optional<Tensor>& w_bias,
                                 const std::optional<Tensor>& w_offsets, const Tensor& residual, Tensor& out) {
  linear_residual(ctx, "llmcore::int4_linear_bias_add", x, w, w_scales, w_sums, w_offsets, nullptr, 0.0, residual,
                  out, w_bias);
  return out;
}

namespace {

// A LayerNorm's weight, optional bias and eps into *norm, or why not.
const char* layer_norm_of(const Tensor& weight, const std::optional<Tensor>& bias, double eps, int64_t dim,
                          LayerNorm* norm) {
  if (const char* why = float_vector(weight, dim)) return why;
  if (!optional_vector(bias, dim, &norm->bias)) return "the norm's bias must be a contiguous float32 vector of the model dimension";
  if (!std::isfinite(eps) || eps < 0.0) return "eps must be finite and >= 0";
  norm->weight = weight.const_data_ptr<float>();
  norm->eps = eps;
  return nullptr;
}

}  // namespace

// llmcore::int4_layer_norm_linear.out(Tensor h, Tensor norm_weight, Tensor? norm_bias, float eps, Tensor w,
//     Tensor w_scales, Tensor w_sums, Tensor? w_bias, Tensor? w_offsets, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_layer_norm_linear_out(KernelRuntimeContext& ctx, const Tensor& h, const Tensor& norm_weight,
                                   const std::optional<Tensor>& norm_bias, double eps, const Tensor& w,
                                   const Tensor& w_scales, const Tensor& w_sums, const std::optional<Tensor>& w_bias,
                                   const std::optional<Tensor>& w_offsets, Tensor& out) {
  constexpr const char* op = "llmcore::int4_layer_norm_linear";
  int4::PackedWeight pw{};
  const char* why = projection_with_bias(w, w_scales, w_sums, w_bias, w_offsets, &pw);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "%s: w: %s", op, why);
  LayerNorm norm{};
  why = layer_norm_of(norm_weight, norm_bias, eps, pw.k, &norm);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "%s: %s", op, why);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(h, pw.k), InvalidArgument, out,
                      "%s: h must be contiguous float32 rows of w's in-features (%lld)", op, (long long)pw.k);
  ET_KERNEL_CHECK(ctx, resize_last(out, h, {pw.n}) == Error::Ok, InvalidArgument, out);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(out, pw.n), InvalidArgument, out, "%s: out must be contiguous float32", op);
  const int64_t rows = h.numel() / pw.k;
  if (rows == 0) return out;
  int4_layer_norm_linear_forward(h.const_data_ptr<float>(), rows, norm, pw, out.mutable_data_ptr<float>(),
                                 et::runtime_parallel);
  return out;
}

// llmcore::int4_layer_norm_ffn_add.out(Tensor h, Tensor norm_weight, Tensor? norm_bias, float eps, Tensor up,
//     Tensor up_scales, Tensor up_sums, Tensor? up_bias, Tensor? up_offsets, Tensor down, Tensor down_scales,
//     Tensor down_sums, Tensor? down_bias, Tensor? down_offsets, str activation, *, Tensor(a!) out) -> Tensor(a!)
Tensor& int4_layer_norm_ffn_add_out(KernelRuntimeContext& ctx, const Tensor& h, const Tensor& norm_weight,
                                    const std::optional<Tensor>& norm_bias, double eps, const Tensor& up,
                                    const Tensor& up_scales, const Tensor& up_sums, const std::optional<Tensor>& up_bias,
                                    const std::optional<Tensor>& up_offsets, const Tensor& down,
                                    const Tensor& down_scales, const Tensor& down_sums,
                                    const std::optional<Tensor>& down_bias, const std::optional<Tensor>& down_offsets,
                                    std::string_view activation, Tensor& out) {
  constexpr const char* op = "llmcore::int4_layer_norm_ffn_add";
  kernel_threads_for_whole_layers();  // a program of whole layers: the own threads (kernel_threads.h)
  Int4FfnWeights w{};
  const char* why = projection_with_bias(up, up_scales, up_sums, up_bias, up_offsets, &w.up);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "%s: up: %s", op, why);
  why = projection_with_bias(down, down_scales, down_sums, down_bias, down_offsets, &w.down);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "%s: down: %s", op, why);
  why = glu_activation(activation, &w.activation);
  if (why == nullptr) why = int4_ffn_shape_error(w);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "%s: %s", op, why);
  LayerNorm norm{};
  why = layer_norm_of(norm_weight, norm_bias, eps, w.up.k, &norm);
  ET_KERNEL_CHECK_MSG(ctx, why == nullptr, InvalidArgument, out, "%s: %s", op, why);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(h, w.up.k), InvalidArgument, out,
                      "%s: h must be contiguous float32 rows of the model dimension (%lld)", op, (long long)w.up.k);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, h.sizes()) == Error::Ok, InvalidArgument, out);
  ET_KERNEL_CHECK_MSG(ctx, rows_of(out, w.up.k), InvalidArgument, out, "%s: out must be contiguous float32", op);
  if (h.numel() == 0) return out;
  int4_layer_norm_ffn_add_forward(h.const_data_ptr<float>(), h.numel() / w.up.k, norm, w,
                                  out.mutable_data_ptr<float>(), et::runtime_parallel);
  return out;
}

namespace {

// EXECUTORCH_LIBRARY's wrapper takes operators with one output; these have three, so they are
// unboxed here. The stack holds the schema's arguments in order (the outputs q, k, v last of
// them), then the returned values, which alias the outputs. Each argument's kind is checked
// before it is read (EValue's accessors abort the process on a wrong one): a program whose
// call has another form, from another version of the operator, fails with a message.
// Kinds, one letter an argument: 'T' a tensor, 'O' a tensor or None, 'D' a float, 'I' an int.
constexpr const char* kNormQkvRopeKinds = "TTDTTTOOTTIIOOOOTTT";
// int4_norm_qkv_norm_rope's: int4_norm_qkv_rope's with q_norm, k_norm and qk_eps after qkv_offsets
constexpr const char* kNormQkvNormRopeKinds = "TTDTTTOOTTDTTIIOOOOTTT";
// The same operators as programs exported before v could have a weight of its own call them:
// without v, v_scales, v_sums and v_offsets (the stack is then too short for the kinds above).
constexpr const char* kNormQkvRopeKindsWithoutV = "TTDTTTOOTTIITTT";
constexpr const char* kNormQkvNormRopeKindsWithoutV = "TTDTTTOOTTDTTIITTT";

bool has_kind(const EValue& v, char kind) {
  switch (kind) {
    case 'T': return v.isTensor();
    case 'O': return v.isTensor() || v.isNone();
    case 'D': return v.isDouble();
    case 'I': return v.isInt();
  }
  return false;
}

// Whether the stack's first arguments are of the kinds spelled by `kinds`, one letter each.
bool fit(Span<EValue*> stack, std::string_view kinds) {
  bool fits = stack.size() >= kinds.size();
  for (size_t i = 0; fits && i < kinds.size(); ++i) fits = has_kind(*stack[i], kinds[i]);
  return fits;
}

// fit(), and if not, the call fails with a message naming `op`.
bool arguments_fit(KernelRuntimeContext& ctx, Span<EValue*> stack, std::string_view kinds, const char* op) {
  const bool fits = fit(stack, kinds);
  if (!fits) {
    ET_LOG(Error, "%s: called with other arguments than this runtime's (a program from another llmcore-kernels): "
           "export it again", op);
    ctx.fail(Error::InvalidProgram);
  }
  return fits;
}

const Tensor* tensor_or_null(const EValue& v) { return v.isNone() ? nullptr : &v.toTensor(); }

std::optional<Tensor> optional_tensor(const EValue& v) {
  return v.isNone() ? std::nullopt : std::optional<Tensor>(v.toTensor());
}

// v's four optional tensors from stack[first, first + 4), or none for a call without them.
SeparateV separate_v_at(Span<EValue*> stack, size_t first, bool called_with_v) {
  SeparateV v;
  if (!called_with_v) return v;
  v.weight = tensor_or_null(*stack[first]);
  v.scales = tensor_or_null(*stack[first + 1]);
  v.sums = tensor_or_null(*stack[first + 2]);
  v.offsets = optional_tensor(*stack[first + 3]);
  return v;
}

void int4_norm_qkv_rope_boxed(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* op = "llmcore::int4_norm_qkv_rope.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), op);
  const bool with_v = fit(stack, kNormQkvRopeKinds);
  if (!with_v && !arguments_fit(ctx, stack, kNormQkvRopeKindsWithoutV, op)) return;
  const size_t outs = with_v ? 16 : 12;
  norm_qkv_rope(ctx, "llmcore::int4_norm_qkv_rope", stack[0]->toTensor(), stack[1]->toTensor(),
                stack[2]->toDouble(), stack[3]->toTensor(), stack[4]->toTensor(), stack[5]->toTensor(),
                tensor_or_null(*stack[6]), optional_tensor(*stack[7]), nullptr, nullptr, 0.0, stack[8]->toTensor(),
                stack[9]->toTensor(), stack[10]->toInt(), stack[11]->toInt(), separate_v_at(stack, 12, with_v),
                stack[outs]->toTensor(), stack[outs + 1]->toTensor(), stack[outs + 2]->toTensor());
}

const auto registered_norm_qkv_rope = executorch::runtime::register_kernel(
    executorch::runtime::Kernel("llmcore::int4_norm_qkv_rope.out", int4_norm_qkv_rope_boxed));

void int4_norm_qkv_norm_rope_boxed(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* op = "llmcore::int4_norm_qkv_norm_rope.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), op);
  const bool with_v = fit(stack, kNormQkvNormRopeKinds);
  if (!with_v && !arguments_fit(ctx, stack, kNormQkvNormRopeKindsWithoutV, op)) return;
  const size_t outs = with_v ? 19 : 15;
  norm_qkv_rope(ctx, "llmcore::int4_norm_qkv_norm_rope", stack[0]->toTensor(), stack[1]->toTensor(),
                stack[2]->toDouble(), stack[3]->toTensor(), stack[4]->toTensor(), stack[5]->toTensor(),
                tensor_or_null(*stack[6]), optional_tensor(*stack[7]), &stack[8]->toTensor(), &stack[9]->toTensor(),
                stack[10]->toDouble(), stack[11]->toTensor(), stack[12]->toTensor(), stack[13]->toInt(),
                stack[14]->toInt(), separate_v_at(stack, 15, with_v), stack[outs]->toTensor(),
                stack[outs + 1]->toTensor(), stack[outs + 2]->toTensor());
}

const auto registered_norm_qkv_norm_rope = executorch::runtime::register_kernel(
    executorch::runtime::Kernel("llmcore::int4_norm_qkv_norm_rope.out", int4_norm_qkv_norm_rope_boxed));

}  // namespace

}  // namespace llmcore_kernels

EXECUTORCH_LIBRARY(llmcore, "int4_linear.out", llmcore_kernels::int4_linear_out);
EXECUTORCH_LIBRARY(llmcore, "q6_k_embedding.out", llmcore_kernels::q6_k_embedding_out);
EXECUTORCH_LIBRARY(llmcore, "int4_linear_add.out", llmcore_kernels::int4_linear_add_out);
EXECUTORCH_LIBRARY(llmcore, "int4_norm_mlp_add.out", llmcore_kernels::int4_norm_mlp_add_out);
EXECUTORCH_LIBRARY(llmcore, "int4_linear_norm_add.out", llmcore_kernels::int4_linear_norm_add_out);
EXECUTORCH_LIBRARY(llmcore, "int4_norm_glu_add.out", llmcore_kernels::int4_norm_glu_add_out);
EXECUTORCH_LIBRARY(llmcore, "int4_linear_bias_add.out", llmcore_kernels::int4_linear_bias_add_out);
EXECUTORCH_LIBRARY(llmcore, "int4_layer_norm_linear.out", llmcore_kernels::int4_layer_norm_linear_out);
EXECUTORCH_LIBRARY(llmcore, "int4_layer_norm_ffn_add.out", llmcore_kernels::int4_layer_norm_ffn_add_out);
