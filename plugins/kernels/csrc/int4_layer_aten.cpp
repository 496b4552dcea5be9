// PyTorch registration of llmcore::int4_norm_qkv_rope (and int4_norm_qkv_norm_rope), llmcore::int4_linear_add,
// llmcore::int4_norm_mlp_add, llmcore::int4_linear, llmcore::int4_linear_norm_add,
// llmcore::int4_norm_glu_add and GPT-2's three (int4_linear_bias_add, int4_layer_norm_linear,
// int4_layer_norm_ffn_add) (schemas, CPU kernels), so that eager
// PyTorch and torch.export see them. Each runs the function its ExecuTorch kernel runs
// (int4_layer.cpp) with ATen's parallel_for, as llmcore::int4_mlp does (int4_mlp_aten.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "int4_aten.h"
#include "int4_layer.h"

namespace {

using llmcore_kernels::aten::block_offsets;
using llmcore_kernels::aten::float_rows;
using llmcore_kernels::aten::projection;
using llmcore_kernels::aten::torch_parallel;

// A norm's weight: float32, `dim` values, contiguous.
at::Tensor norm_weight_of(const char* op, const at::Tensor& weight, int64_t dim) {
  TORCH_CHECK(weight.dim() == 1, op, ": the norm's weight must be 1-D, got ", weight.sizes());
  return float_rows(op, "the norm's weight", weight, dim);
}

// A projection's optional bias: float32, one value a row, contiguous; set as pw's bias (the
// returned tensor holds it).
at::Tensor bias_of(const char* op, const char* what, const std::optional<at::Tensor>& bias,
                   llmcore_kernels::int4::PackedWeight* pw) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1, op, ": ", what, " must be 1-D, got ", bias->sizes());
  at::Tensor held = float_rows(op, what, *bias, pw->n);
  pw->bias = held.const_data_ptr<float>();
  return held;
}

// A LayerNorm's weight and optional bias over `dim` values (the returned tensors hold them).
struct HeldLayerNorm {
  at::Tensor weight, bias;
  llmcore_kernels::LayerNorm norm{};
};

HeldLayerNorm layer_norm_of(const char* op, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            double eps, int64_t dim) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0");
  HeldLayerNorm held;
  held.weight = norm_weight_of(op, weight, dim);
  held.norm.weight = held.weight.const_data_ptr<float>();
  held.norm.eps = eps;
  if (bias.has_value()) {
    held.bias = norm_weight_of(op, *bias, dim);
    held.norm.bias = held.bias.const_data_ptr<float>();
  }
  return held;
}

// base's sizes, the last replaced by `last` (one size or more)
std::vector<int64_t> last_replaced(const at::Tensor& base, std::initializer_list<int64_t> last) {
  std::vector<int64_t> sizes(base.sizes().begin(), base.sizes().end() - 1);
  sizes.insert(sizes.end(), last);
  return sizes;
}

// v's own weight (int4_layer.h: Int4NormQkvRope::v): the operators' optional v tensors.
struct SeparateV {
  std::optional<at::Tensor> weight, scales, sums, offsets;  // no weight: qkv holds v's rows
};

// The work of int4_norm_qkv_rope (no q_norm) and int4_norm_qkv_norm_rope, its checks named after `op`.
std::tuple<at::Tensor&, at::Tensor&, at::Tensor&> norm_qkv_rope(
    const char* op, const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
    const at::Tensor& qkv_scales, const at::Tensor& qkv_sums, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& qkv_offsets, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, const at::Tensor& cos, const at::Tensor& sin,
    int64_t n_heads, int64_t n_kv_heads, const SeparateV& separate_v, at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  llmcore_kernels::Int4NormQkvRope a{};
  a.qkv = projection(op, "qkv", qkv, qkv_scales, qkv_sums);
  const at::Tensor offsets = block_offsets(op, "qkv", qkv_offsets, &a.qkv);
  llmcore_kernels::int4::PackedWeight v_weight{};
  at::Tensor v_offsets;
  if (separate_v.weight.has_value()) {
    TORCH_CHECK(separate_v.scales.has_value() && separate_v.sums.has_value(), op,
                ": v comes with v_scales and v_sums");
    v_weight = projection(op, "v", *separate_v.weight, *separate_v.scales, *separate_v.sums);
    v_offsets = block_offsets(op, "v", separate_v.offsets, &v_weight);
    a.v = &v_weight;
  }
  at::Tensor bias;
  if (qkv_bias.has_value()) {
    // q's, k's and v's biases one after another, v's apart or not
    TORCH_CHECK(qkv_bias->dim() == 1, op, ": qkv_bias must be 1-D, got ", qkv_bias->sizes());
    bias = float_rows(op, "qkv_bias", *qkv_bias, a.qkv.n + (a.v != nullptr ? a.v->n : 0));
    a.qkv.bias = bias.const_data_ptr<float>();
    if (a.v != nullptr) v_weight.bias = a.qkv.bias + a.qkv.n;
  }
  a.eps = eps;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  int64_t head_dim = 0;
  const char* why = llmcore_kernels::int4_norm_qkv_rope_shape_error(a, &head_dim);  // the q/k norms' apart
  TORCH_CHECK(why == nullptr, op, ": ", why ? why : "");
  at::Tensor held_q_norm, held_k_norm;  // the q/k norms over head_dim values, once it is known
  if (q_norm.has_value()) {
    TORCH_CHECK(std::isfinite(qk_eps) && qk_eps >= 0.0, op, ": qk_eps must be finite and >= 0");
    held_q_norm = norm_weight_of(op, *q_norm, head_dim);
    held_k_norm = norm_weight_of(op, *k_norm, head_dim);
    a.q_norm = held_q_norm.const_data_ptr<float>();
    a.k_norm = held_k_norm.const_data_ptr<float>();
    a.qk_eps = qk_eps;
  }
  const at::Tensor w = norm_weight_of(op, norm_weight, a.qkv.k);
  a.norm_weight = w.const_data_ptr<float>();
  const at::Tensor hc = float_rows(op, "h", h, a.qkv.k);
  const int64_t rows = hc.numel() / a.qkv.k;
  const at::Tensor c = float_rows(op, "cos", cos, head_dim), s = float_rows(op, "sin", sin, head_dim);
  TORCH_CHECK(c.numel() == rows * head_dim && s.numel() == rows * head_dim, op,
              ": cos and sin must hold one row per token of h, got ", cos.sizes(), " and ", sin.sizes(), " for ",
              h.sizes());
  q.resize_(last_replaced(hc, {n_heads, head_dim}));
  k.resize_(last_replaced(hc, {n_kv_heads, head_dim}));
  v.resize_(last_replaced(hc, {n_kv_heads, head_dim}));
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), op, ": q, k and v must be contiguous");
  if (rows > 0)
    llmcore_kernels::int4_norm_qkv_rope_forward(hc.const_data_ptr<float>(), rows, a, c.const_data_ptr<float>(),
                                                s.const_data_ptr<float>(), q.mutable_data_ptr<float>(),
                                                k.mutable_data_ptr<float>(), v.mutable_data_ptr<float>(),
                                                torch_parallel);
  return {q, k, v};
}

std::tuple<at::Tensor&, at::Tensor&, at::Tensor&> int4_norm_qkv_rope_out(
    const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
    const at::Tensor& qkv_scales, const at::Tensor& qkv_sums, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& qkv_offsets, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
    int64_t n_kv_heads, const std::optional<at::Tensor>& v_weight, const std::optional<at::Tensor>& v_scales,
    const std::optional<at::Tensor>& v_sums, const std::optional<at::Tensor>& v_offsets, at::Tensor& q,
    at::Tensor& k, at::Tensor& v) {
  return norm_qkv_rope("llmcore::int4_norm_qkv_rope", h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias,
                       qkv_offsets, std::nullopt, std::nullopt, 0.0, cos, sin, n_heads, n_kv_heads,
                       {v_weight, v_scales, v_sums, v_offsets}, q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_norm_qkv_rope(
    const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
    const at::Tensor& qkv_scales, const at::Tensor& qkv_sums, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& qkv_offsets, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
    int64_t n_kv_heads, const std::optional<at::Tensor>& v_weight, const std::optional<at::Tensor>& v_scales,
    const std::optional<at::Tensor>& v_sums, const std::optional<at::Tensor>& v_offsets) {
  at::Tensor q = at::empty({0}, h.options()), k = at::empty({0}, h.options()), v = at::empty({0}, h.options());
  int4_norm_qkv_rope_out(h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias, qkv_offsets, cos, sin, n_heads,
                         n_kv_heads, v_weight, v_scales, v_sums, v_offsets, q, k, v);
  return {q, k, v};
}

std::tuple<at::Tensor&, at::Tensor&, at::Tensor&> int4_norm_qkv_norm_rope_out(
    const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
    const at::Tensor& qkv_scales, const at::Tensor& qkv_sums, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& qkv_offsets, const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
    const std::optional<at::Tensor>& v_weight, const std::optional<at::Tensor>& v_scales,
    const std::optional<at::Tensor>& v_sums, const std::optional<at::Tensor>& v_offsets, at::Tensor& q, at::Tensor& k,
    at::Tensor& v) {
  return norm_qkv_rope("llmcore::int4_norm_qkv_norm_rope", h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias,
                       qkv_offsets, q_norm, k_norm, qk_eps, cos, sin, n_heads, n_kv_heads,
                       {v_weight, v_scales, v_sums, v_offsets}, q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_norm_qkv_norm_rope(
    const at::Tensor& h, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
    const at::Tensor& qkv_scales, const at::Tensor& qkv_sums, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& qkv_offsets, const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
    const std::optional<at::Tensor>& v_weight, const std::optional<at::Tensor>& v_scales,
    const std::optional<at::Tensor>& v_sums, const std::optional<at::Tensor>& v_offsets) {
  at::Tensor q = at::empty({0}, h.options()), k = at::empty({0}, h.options()), v = at::empty({0}, h.options());
  int4_norm_qkv_norm_rope_out(h, norm_weight, eps, qkv, qkv_scales, qkv_sums, qkv_bias, qkv_offsets, q_norm, k_norm,
                              qk_eps, cos, sin, n_heads, n_kv_heads, v_weight, v_scales, v_sums, v_offsets, q, k, v);
  return {q, k, v};
}

at::Tensor& int4_linear_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                            const at::Tensor& w_sums, const std::optional<at::Tensor>& w_bias,
                            const std::optional<at::Tensor>& w_offsets, at::Tensor& out) {
  constexpr const char* op = "llmcore::int4_linear";
  llmcore_kernels::int4::PackedWeight pw = projection(op, "w", w, w_scales, w_sums);
  const at::Tensor offsets = block_offsets(op, "w", w_offsets, &pw);
  at::Tensor bias;
  if (w_bias.has_value()) {
    TORCH_CHECK(w_bias->dim() == 1, op, ": w_bias must be 1-D, got ", w_bias->sizes());
    bias = float_rows(op, "w_bias", *w_bias, pw.n);
    pw.bias = bias.const_data_ptr<float>();
  }
  const at::Tensor xc = float_rows(op, "x", x, pw.k);
  const int64_t rows = xc.numel() / pw.k;
  out.resize_(last_replaced(xc, {pw.n}));
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  if (rows > 0)
    llmcore_kernels::int4_linear_forward(xc.const_data_ptr<float>(), rows, pw, out.mutable_data_ptr<float>(),
                                         torch_parallel);
  return out;
}

at::Tensor& q6_k_embedding_out(const at::Tensor& weight, const at::Tensor& indices, at::Tensor& out) {
  constexpr const char* op = "llmcore::q6_k_embedding";
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.size(2) == llmcore_kernels::int4::kQ6KBytes &&
                  weight.is_contiguous() && weight.device().is_cpu(),
              op, ": weight must be a contiguous [rows, in/256, 210] uint8 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.device().is_cpu(), op,
              ": indices must be an int64 CPU tensor, got ", indices.scalar_type());
  llmcore_kernels::int4::PackedWeight pw{};
  pw.format = llmcore_kernels::int4::Format::q6_k;
  pw.packed = weight.const_data_ptr<uint8_t>();
  pw.n = weight.size(0);
  pw.k = llmcore_kernels::int4::kQ6KValues * weight.size(1);
  const at::Tensor ids = indices.contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < pw.n, op, ": index ", id[i], " is outside the table's ", pw.n, " rows");
  std::vector<int64_t> sizes(ids.sizes().begin(), ids.sizes().end());
  sizes.push_back(pw.k);
  out.resize_(sizes);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), op, ": out must be contiguous float32");
  float* rows = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < ids.numel(); ++i) llmcore_kernels::int4::q6_k_row_values(pw, id[i], rows + i * pw.k);
  return out;
}

at::Tensor q6_k_embedding(const at::Tensor& weight, const at::Tensor& indices) {
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(at::kFloat));
  return q6_k_embedding_out(weight, indices, out);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                       const at::Tensor& w_sums, const std::optional<at::Tensor>& w_bias,
                       const std::optional<at::Tensor>& w_offsets) {
  at::Tensor out = at::empty({0}, x.options());
  return int4_linear_out(x, w, w_scales, w_sums, w_bias, w_offsets, out);
}

// The work of int4_linear_add (norm_weight null) and int4_linear_norm_add, its checks named
// after `op`: out = residual + x W^T, or residual + rms_norm(x W^T).
at::Tensor& linear_residual(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                            const at::Tensor& w_sums, const std::optional<at::Tensor>& w_offsets,
                            const at::Tensor* norm_weight, double eps, const at::Tensor& residual, at::Tensor& out,
                            const std::optional<at::Tensor>& w_bias = std::nullopt) {
  llmcore_kernels::int4::PackedWeight pw = projection(op, "w", w, w_scales, w_sums);
  const at::Tensor offsets = block_offsets(op, "w", w_offsets, &pw);
  const at::Tensor bias = bias_of(op, "w_bias", w_bias, &pw);
  at::Tensor nw;
  if (norm_weight != nullptr) {
    TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0");
    nw = norm_weight_of(op, *norm_weight, pw.n);
  }
  const at::Tensor xc = float_rows(op, "x", x, pw.k);
  const int64_t rows = xc.numel() / pw.k;
  const at::Tensor rc = float_rows(op, "residual", residual, pw.n);
  TORCH_CHECK(rc.numel() == rows * pw.n, op, ": residual must hold one row per row of x, got ", residual.sizes(),
              " for ", x.sizes());
  out.resize_(rc.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  if (rows == 0) return out;
  if (norm_weight == nullptr)
    llmcore_kernels::int4_linear_add_forward(xc.const_data_ptr<float>(), rows, pw, rc.const_data_ptr<float>(),
                                             out.mutable_data_ptr<float>(), torch_parallel);
  else
    llmcore_kernels::int4_linear_norm_add_forward(xc.const_data_ptr<float>(), rows, pw, nw.const_data_ptr<float>(),
                                                  eps, rc.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
                                                  torch_parallel);
  return out;
}

// The work of int4_norm_mlp_add (silu, no post-norm) and int4_norm_glu_add, its checks named
// after `op`: out = h + mlp(rms_norm(h)), or h + rms_norm(mlp(rms_norm(h))) with the post-norm.
at::Tensor& norm_mlp_residual(const char* op, const at::Tensor& h, const at::Tensor& norm_weight, double eps,
                              const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                              const at::Tensor& gate_up_sums, const std::optional<at::Tensor>& gate_up_offsets,
                              const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& down_sums,
                              const std::optional<at::Tensor>& down_offsets, std::string_view activation,
                              const std::optional<at::Tensor>& post_norm_weight, double post_eps, at::Tensor& out) {
  llmcore_kernels::Int4MlpWeights w{projection(op, "gate_up", gate_up, gate_up_scales, gate_up_sums),
                                    projection(op, "down", down, down_scales, down_sums)};
  const at::Tensor gate_up_held = block_offsets(op, "gate_up", gate_up_offsets, &w.gate_up);
  const at::Tensor down_held = block_offsets(op, "down", down_offsets, &w.down);
  const char* why = llmcore_kernels::int4_mlp_shape_error(w);
  if (why == nullptr) why = llmcore_kernels::glu_activation(activation, &w.activation);
  TORCH_CHECK(why == nullptr, op, ": ", why ? why : "");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0");
  TORCH_CHECK(std::isfinite(post_eps) && post_eps >= 0.0, op, ": post_eps must be finite and >= 0");
  const at::Tensor nw = norm_weight_of(op, norm_weight, w.gate_up.k);
  at::Tensor post;
  if (post_norm_weight.has_value()) post = norm_weight_of(op, *post_norm_weight, w.gate_up.k);
  const at::Tensor hc = float_rows(op, "h", h, w.gate_up.k);
  out.resize_(hc.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  if (hc.numel() > 0)
    llmcore_kernels::int4_norm_mlp_add_forward(hc.const_data_ptr<float>(), hc.numel() / w.gate_up.k,
                                               nw.const_data_ptr<float>(), eps, w, out.mutable_data_ptr<float>(),
                                               torch_parallel, post.defined() ? post.const_data_ptr<float>() : nullptr,
                                               post_eps);
  return out;
}

at::Tensor& int4_linear_add_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                                const at::Tensor& w_sums, const std::optional<at::Tensor>& w_offsets,
                                const at::Tensor& residual, at::Tensor& out) {
  return linear_residual("llmcore::int4_linear_add", x, w, w_scales, w_sums, w_offsets, nullptr, 0.0, residual, out);
}

at::Tensor int4_linear_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                           const at::Tensor& w_sums, const std::optional<at::Tensor>& w_offsets,
                           const at::Tensor& residual) {
  at::Tensor out = at::empty({0}, residual.options());
  return int4_linear_add_out(x, w, w_scales, w_sums, w_offsets, residual, out);
}

at::Tensor& int4_norm_mlp_add_out(const at::Tensor& h, const at::Tensor& norm_weight, double eps,
                                  const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                                  const at::Tensor& gate_up_sums, const std::optional<at::Tensor>& gate_up_offsets,
                                  const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& down_sums,
                                  const std::optional<at::Tensor>& down_offsets, at::Tensor& out) {
  return norm_mlp_residual("llmcore::int4_norm_mlp_add", h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums,
                           gate_up_offsets, down, down_scales, down_sums, down_offsets, "silu", std::nullopt, 0.0,
                           out);
}

at::Tensor int4_norm_mlp_add(const at::Tensor& h, const at::Tensor& norm_weight, double eps,
                             const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                             const at::Tensor& gate_up_sums, const std::optional<at::Tensor>& gate_up_offsets,
                             const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& down_sums,
                             const std::optional<at::Tensor>& down_offsets) {
  at::Tensor out = at::empty({0}, h.options());
  return int4_norm_mlp_add_out(h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums, gate_up_offsets, down,
                               down_scales, down_sums, down_offsets, out);
}

at::Tensor& int4_linear_norm_add_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                                     const at::Tensor& w_sums, const std::optional<at::Tensor>& w_offsets,
                                     const at::Tensor& norm_weight, double eps, const at::Tensor& residual,
                                     at::Tensor& out) {
  return linear_residual("llmcore::int4_linear_norm_add", x, w, w_scales, w_sums, w_offsets, &norm_weight, eps,
                         residual, out);
}

at::Tensor int4_linear_norm_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                                const at::Tensor& w_sums, const std::optional<at::Tensor>& w_offsets,
                                const at::Tensor& norm_weight, double eps, const at::Tensor& residual) {
  at::Tensor out = at::empty({0}, residual.options());
  return int4_linear_norm_add_out(x, w, w_scales, w_sums, w_offsets, norm_weight, eps, residual, out);
}

at::Tensor& int4_norm_glu_add_out(const at::Tensor& h, const at::Tensor& norm_weight, double eps,
                                  const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                                  const at::Tensor& gate_up_sums, const std::optional<at::Tensor>& gate_up_offsets,
                                  const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& down_sums,
                                  const std::optional<at::Tensor>& down_offsets, c10::string_view activation,
                                  const std::optional<at::Tensor>& post_norm_weight, double post_eps,
                                  at::Tensor& out) {
  return norm_mlp_residual("llmcore::int4_norm_glu_add", h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums,
                           gate_up_offsets, down, down_scales, down_sums, down_offsets,
                           std::string_view(activation.data(), activation.size()), post_norm_weight, post_eps, out);
}

at::Tensor int4_norm_glu_add(const at::Tensor& h, const at::Tensor& norm_weight, double eps,
                             const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                             const at::Tensor& gate_up_sums, const std::optional<at::Tensor>& gate_up_offsets,
                             const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& down_sums,
                             const std::optional<at::Tensor>& down_offsets, c10::string_view activation,
                             const std::optional<at::Tensor>& post_norm_weight, double post_eps) {
  at::Tensor out = at::empty({0}, h.options());
  return int4_norm_glu_add_out(h, norm_weight, eps, gate_up, gate_up_scales, gate_up_sums, gate_up_offsets, down,
                               down_scales, down_sums, down_offsets, activation, post_norm_weight, post_eps, out);
}

at::Tensor& int4_linear_bias_add_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                                     const at::Tensor& w_sums, const std::optional<at::Tensor>& w_bias,
                                     const std::optional<at::Tensor>& w_offsets, const at::Tensor& residual,
                                     at::Tensor& out) {
  return linear_residual("llmcore::int4_linear_bias_add", x, w, w_scales, w_sums, w_offsets, nullptr, 0.0, residual,
                         out, w_bias);
}

at::Tensor int4_linear_bias_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                                const at::Tensor& w_sums, const std::optional<at::Tensor>& w_bias,
                                const std::optional<at::Tensor>& w_offsets, const at::Tensor& residual) {
  at::Tensor out = at::empty({0}, residual.options());
  return int4_linear_bias_add_out(x, w, w_scales, w_sums, w_bias, w_offsets, residual, out);
}

at::Tensor& int4_layer_norm_linear_out(const at::Tensor& h, const at::Tensor& norm_weight,
                                       const std::optional<at::Tensor>& norm_bias, double eps, const at::Tensor& w,
                                       const at::Tensor& w_scales, const at::Tensor& w_sums,
                                       const std::optional<at::Tensor>& w_bias,
                                       const std::optional<at::Tensor>& w_offsets, at::Tensor& out) {
  constexpr const char* op = "llmcore::int4_layer_norm_linear";
  llmcore_kernels::int4::PackedWeight pw = projection(op, "w", w, w_scales, w_sums);
  const at::Tensor offsets = block_offsets(op, "w", w_offsets, &pw);
  const at::Tensor bias = bias_of(op, "w_bias", w_bias, &pw);
  const HeldLayerNorm norm = layer_norm_of(op, norm_weight, norm_bias, eps, pw.k);
  const at::Tensor hc = float_rows(op, "h", h, pw.k);
  const int64_t rows = hc.numel() / pw.k;
  out.resize_(last_replaced(hc, {pw.n}));
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  if (rows > 0)
    llmcore_kernels::int4_layer_norm_linear_forward(hc.const_data_ptr<float>(), rows, norm.norm, pw,
                                                    out.mutable_data_ptr<float>(), torch_parallel);
  return out;
}

at::Tensor int4_layer_norm_linear(const at::Tensor& h, const at::Tensor& norm_weight,
                                  const std::optional<at::Tensor>& norm_bias, double eps, const at::Tensor& w,
                                  const at::Tensor& w_scales, const at::Tensor& w_sums,
                                  const std::optional<at::Tensor>& w_bias, const std::optional<at::Tensor>& w_offsets) {
  at::Tensor out = at::empty({0}, h.options());
  return int4_layer_norm_linear_out(h, norm_weight, norm_bias, eps, w, w_scales, w_sums, w_bias, w_offsets, out);
}

at::Tensor& int4_layer_norm_ffn_add_out(const at::Tensor& h, const at::Tensor& norm_weight,
                                        const std::optional<at::Tensor>& norm_bias, double eps, const at::Tensor& up,
                                        const at::Tensor& up_scales, const at::Tensor& up_sums,
                                        const std::optional<at::Tensor>& up_bias,
                                        const std::optional<at::Tensor>& up_offsets, const at::Tensor& down,
                                        const at::Tensor& down_scales, const at::Tensor& down_sums,
                                        const std::optional<at::Tensor>& down_bias,
                                        const std::optional<at::Tensor>& down_offsets, c10::string_view activation,
                                        at::Tensor& out) {
  constexpr const char* op = "llmcore::int4_layer_norm_ffn_add";
  llmcore_kernels::Int4FfnWeights w{projection(op, "up", up, up_scales, up_sums),
                                    projection(op, "down", down, down_scales, down_sums)};
  const at::Tensor up_held = block_offsets(op, "up", up_offsets, &w.up);
  const at::Tensor down_held = block_offsets(op, "down", down_offsets, &w.down);
  const at::Tensor up_bias_held = bias_of(op, "up_bias", up_bias, &w.up);
  const at::Tensor down_bias_held = bias_of(op, "down_bias", down_bias, &w.down);
  const char* why = llmcore_kernels::glu_activation(std::string_view(activation.data(), activation.size()),
                                                    &w.activation);
  if (why == nullptr) why = llmcore_kernels::int4_ffn_shape_error(w);
  TORCH_CHECK(why == nullptr, op, ": ", why ? why : "");
  const HeldLayerNorm norm = layer_norm_of(op, norm_weight, norm_bias, eps, w.up.k);
  const at::Tensor hc = float_rows(op, "h", h, w.up.k);
  out.resize_(hc.sizes());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  if (hc.numel() > 0)
    llmcore_kernels::int4_layer_norm_ffn_add_forward(hc.const_data_ptr<float>(), hc.numel() / w.up.k, norm.norm, w,
                                                     out.mutable_data_ptr<float>(), torch_parallel);
  return out;
}

at::Tensor int4_layer_norm_ffn_add(const at::Tensor& h, const at::Tensor& norm_weight,
                                   const std::optional<at::Tensor>& norm_bias, double eps, const at::Tensor& up,
                                   const at::Tensor& up_scales, const at::Tensor& up_sums,
                                   const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& up_offsets,
                                   const at::Tensor& down, const at::Tensor& down_scales, const at::Tensor& down_sums,
                                   const std::optional<at::Tensor>& down_bias,
                                   const std::optional<at::Tensor>& down_offsets, c10::string_view activation) {
  at::Tensor out = at::empty({0}, h.options());
  return int4_layer_norm_ffn_add_out(h, norm_weight, norm_bias, eps, up, up_scales, up_sums, up_bias, up_offsets,
                                     down, down_scales, down_sums, down_bias, down_offsets, activation, out);
}

}  // namespace

// int4_norm_qkv_rope's and int4_norm_qkv_norm_rope's last arguments: v's own weight, when it
// is of another kind than q's and k's (int4_layer.h); programs before them call the ExecuTorch
// kernels without (int4_layer.cpp).
#define V_ARGUMENTS "Tensor? v_weight=None, Tensor? v_scales=None, Tensor? v_sums=None, Tensor? v_offsets=None"

TORCH_LIBRARY_FRAGMENT(llmcore, m) {
  m.def(
      "int4_norm_qkv_rope(Tensor h, Tensor norm_weight, float eps, Tensor qkv, Tensor qkv_scales, "
      "Tensor qkv_sums, Tensor? qkv_bias, Tensor? qkv_offsets, Tensor cos, Tensor sin, int n_heads, "
      "int n_kv_heads, " V_ARGUMENTS ") -> (Tensor, Tensor, Tensor)");
  m.def(
      "int4_norm_qkv_rope.out(Tensor h, Tensor norm_weight, float eps, Tensor qkv, Tensor qkv_scales, "
      "Tensor qkv_sums, Tensor? qkv_bias, Tensor? qkv_offsets, Tensor cos, Tensor sin, int n_heads, "
      "int n_kv_heads, " V_ARGUMENTS ", *, Tensor(a!) q, Tensor(b!) k, Tensor(c!) v) "
      "-> (Tensor(a!), Tensor(b!), Tensor(c!))");
  m.def(
      "int4_norm_qkv_norm_rope(Tensor h, Tensor norm_weight, float eps, Tensor qkv, Tensor qkv_scales, "
      "Tensor qkv_sums, Tensor? qkv_bias, Tensor? qkv_offsets, Tensor q_norm, Tensor k_norm, float qk_eps, "
      "Tensor cos, Tensor sin, int n_heads, int n_kv_heads, " V_ARGUMENTS ") -> (Tensor, Tensor, Tensor)");
  m.def(
      "int4_norm_qkv_norm_rope.out(Tensor h, Tensor norm_weight, float eps, Tensor qkv, Tensor qkv_scales, "
      "Tensor qkv_sums, Tensor? qkv_bias, Tensor? qkv_offsets, Tensor q_norm, Tensor k_norm, float qk_eps, "
      "Tensor cos, Tensor sin, int n_heads, int n_kv_heads, " V_ARGUMENTS ", *, Tensor(a!) q, Tensor(b!) k, "
      "Tensor(c!) v) -> (Tensor(a!), Tensor(b!), Tensor(c!))");
  m.def(
      "int4_linear_add(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_offsets, Tensor residual) "
      "-> Tensor");
  m.def(
      "int4_linear_add.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_offsets, "
      "Tensor residual, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("q6_k_embedding(Tensor weight, Tensor indices) -> Tensor");
  m.def("q6_k_embedding.out(Tensor weight, Tensor indices, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("int4_linear(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_bias, Tensor? w_offsets) -> Tensor");
  m.def(
      "int4_linear.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_bias, Tensor? w_offsets, *, "
      "Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "int4_norm_mlp_add(Tensor h, Tensor norm_weight, float eps, Tensor gate_up, Tensor gate_up_scales, "
      "Tensor gate_up_sums, Tensor? gate_up_offsets, Tensor down, Tensor down_scales, Tensor down_sums, "
      "Tensor? down_offsets) -> Tensor");
  m.def(
      "int4_norm_mlp_add.out(Tensor h, Tensor norm_weight, float eps, Tensor gate_up, Tensor gate_up_scales, "
      "Tensor gate_up_sums, Tensor? gate_up_offsets, Tensor down, Tensor down_scales, Tensor down_sums, "
      "Tensor? down_offsets, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "int4_linear_norm_add(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_offsets, "
      "Tensor norm_weight, float eps, Tensor residual) -> Tensor");
  m.def(
      "int4_linear_norm_add.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_offsets, "
      "Tensor norm_weight, float eps, Tensor residual, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "int4_norm_glu_add(Tensor h, Tensor norm_weight, float eps, Tensor gate_up, Tensor gate_up_scales, "
      "Tensor gate_up_sums, Tensor? gate_up_offsets, Tensor down, Tensor down_scales, Tensor down_sums, "
      "Tensor? down_offsets, str activation, Tensor? post_norm_weight, float post_eps) -> Tensor");
  m.def(
      "int4_norm_glu_add.out(Tensor h, Tensor norm_weight, float eps, Tensor gate_up, Tensor gate_up_scales, "
      "Tensor gate_up_sums, Tensor? gate_up_offsets, Tensor down, Tensor down_scales, Tensor down_sums, "
      "Tensor? down_offsets, str activation, Tensor? post_norm_weight, float post_eps, *, Tensor(a!) out) "
      "-> Tensor(a!)");
}

TORCH_LIBRARY_FRAGMENT(llmcore, m) {
  // a pre-LayerNorm layer with biases and a plain MLP (GPT-2's)
  m.def(
      "int4_linear_bias_add(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_bias, Tensor? w_offsets, "
      "Tensor residual) -> Tensor");
  m.def(
      "int4_linear_bias_add.out(Tensor x, Tensor w, Tensor w_scales, Tensor w_sums, Tensor? w_bias, "
      "Tensor? w_offsets, Tensor residual, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "int4_layer_norm_linear(Tensor h, Tensor norm_weight, Tensor? norm_bias, float eps, Tensor w, "
      "Tensor w_scales, Tensor w_sums, Tensor? w_bias, Tensor? w_offsets) -> Tensor");
  m.def(
      "int4_layer_norm_linear.out(Tensor h, Tensor norm_weight, Tensor? norm_bias, float eps, Tensor w, "
      "Tensor w_scales, Tensor w_sums, Tensor? w_bias, Tensor? w_offsets, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "int4_layer_norm_ffn_add(Tensor h, Tensor norm_weight, Tensor? norm_bias, float eps, Tensor up, "
      "Tensor up_scales, Tensor up_sums, Tensor? up_bias, Tensor? up_offsets, Tensor down, Tensor down_scales, "
      "Tensor down_sums, Tensor? down_bias, Tensor? down_offsets, str activation) -> Tensor");
  m.def(
      "int4_layer_norm_ffn_add.out(Tensor h, Tensor norm_weight, Tensor? norm_bias, float eps, Tensor up, "
      "Tensor up_scales, Tensor up_sums, Tensor? up_bias, Tensor? up_offsets, Tensor down, Tensor down_scales, "
      "Tensor down_sums, Tensor? down_bias, Tensor? down_offsets, str activation, *, Tensor(a!) out) "
      "-> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(llmcore, CPU, m) {
  m.impl("int4_linear_bias_add", TORCH_FN(int4_linear_bias_add));
  m.impl("int4_linear_bias_add.out", TORCH_FN(int4_linear_bias_add_out));
  m.impl("int4_layer_norm_linear", TORCH_FN(int4_layer_norm_linear));
  m.impl("int4_layer_norm_linear.out", TORCH_FN(int4_layer_norm_linear_out));
  m.impl("int4_layer_norm_ffn_add", TORCH_FN(int4_layer_norm_ffn_add));
  m.impl("int4_layer_norm_ffn_add.out", TORCH_FN(int4_layer_norm_ffn_add_out));
  m.impl("int4_norm_qkv_rope", TORCH_FN(int4_norm_qkv_rope));
  m.impl("int4_norm_qkv_rope.out", TORCH_FN(int4_norm_qkv_rope_out));
  m.impl("int4_norm_qkv_norm_rope", TORCH_FN(int4_norm_qkv_norm_rope));
  m.impl("int4_norm_qkv_norm_rope.out", TORCH_FN(int4_norm_qkv_norm_rope_out));
  m.impl("int4_linear_add", TORCH_FN(int4_linear_add));
  m.impl("int4_linear_add.out", TORCH_FN(int4_linear_add_out));
  m.impl("q6_k_embedding", TORCH_FN(q6_k_embedding));
  m.impl("q6_k_embedding.out", TORCH_FN(q6_k_embedding_out));
  m.impl("int4_linear", TORCH_FN(int4_linear));
  m.impl("int4_linear.out", TORCH_FN(int4_linear_out));
  m.impl("int4_norm_mlp_add", TORCH_FN(int4_norm_mlp_add));
  m.impl("int4_norm_mlp_add.out", TORCH_FN(int4_norm_mlp_add_out));
  m.impl("int4_linear_norm_add", TORCH_FN(int4_linear_norm_add));
  m.impl("int4_linear_norm_add.out", TORCH_FN(int4_linear_norm_add_out));
  m.impl("int4_norm_glu_add", TORCH_FN(int4_norm_glu_add));
  m.impl("int4_norm_glu_add.out", TORCH_FN(int4_norm_glu_add_out));
}
