// llmcore-kernels: a Llama layer's int4 work outside attention, in three operators.
//
//   llmcore::int4_norm_qkv_rope:  q, k, v = rope(qkv(rms_norm(h)))
//   llmcore::int4_linear_add:     out = residual + x W^T              (the output projection)
//   llmcore::int4_norm_mlp_add:   out = h + mlp(rms_norm(h))          (int4_mlp.h's MLP)
//
// and, for layers with norms on each sublayer's output (Gemma 2 and 3's "sandwich norms") or
// a GeGLU MLP (Gemma's), in place of the last two
//
//   llmcore::int4_linear_norm_add: out = residual + rms_norm(x W^T)
//   llmcore::int4_norm_glu_add:    out = h + post_norm(mlp(rms_norm(h)))   (post_norm optional,
//                                  the MLP's activation named: "silu" or "gelu_tanh")
//
// and, for a pre-LayerNorm layer with biases and a plain MLP (GPT-2's), whose q, k and v
// take no RoPE (its positions are learned, added to the embeddings)
//
//   llmcore::int4_layer_norm_linear:  out = layer_norm(h) W^T + bias     (q, k and v, one GEMM)
//   llmcore::int4_linear_bias_add:    out = residual + x W^T + bias      (the output projection)
//   llmcore::int4_layer_norm_ffn_add: out = h + down(act(up(layer_norm(h))))   (biases on both)
//
// and after the last layer
//
//   llmcore::int4_linear:         out = x W^T (+ bias)                (the output layer)
//
// With these and the KV-cache ops (llama::update_cache, llama::custom_sdpa) a layer is
// six operator calls and no XNNPACK delegate: recipe 8da4w-layers. Why: a delegate call
// costs its fixed set-up whatever it computes (SmolLM2's decode step makes 62 of them with
// 8da4w-mlp, where the MLP operator cuts each layer's partition in two), and the
// projections between the attention and the MLP were left to XNNPACK's AVX2 int4 GEMM,
// slower than int4_gemm.cpp's (docs/performance.md, "Whole layers on llmcore's kernels").
//
// q, k and v come from one GEMM over the three weights' rows stacked (q's, then k's, then
// v's): every row's blocks and every token's int8 rounding are those of the three separate
// linears, so the numbers are the same. A v of another kind than q's and k's (a Q4_K_M
// GGUF's: Q4_K q and k, and in half the layers a Q6_K v, int8 rows on the kernels) is a
// second GEMM over the same normed rows, rounded for its own layout, written straight into
// v. RoPE rotates Meta's interleaved channel pairs (2i, 2i + 1) of each q and k head:
//
//   out[2i] = y[2i] cos[2i] + (-y[2i + 1]) sin[2i],  out[2i + 1] = y[2i + 1] cos[2i + 1] + y[2i] sin[2i + 1]
//
// which is, operation for operation, what the Llama module computes (x * cos + swap(x) *
// sin, the swap a matmul with a +-1 permutation, exact).
//
// The ExecuTorch kernels (int4_layer.cpp) and the PyTorch registration (int4_layer_aten.cpp)
// both call the functions below: eager PyTorch computes what the program computes.
#pragma once

#include <cstdint>

#include "int4_mlp.h"

namespace llmcore_kernels {

struct Int4NormQkvRope {
  const float* norm_weight;  // [dim]
  double eps;
  int4::PackedWeight qkv;  // [(n_heads + 2 n_kv_heads) head_dim, dim], or q's and k's rows alone with `v`
  int64_t n_heads;
  int64_t n_kv_heads;
  // Qwen3's and Gemma 3's per-head norms of q and k between the GEMM and RoPE
  // (llmcore::int4_norm_qkv_norm_rope), [head_dim] each; null for none.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  double qk_eps = 0.0;
  // v's own weight, [n_kv_heads head_dim, dim], when it is of another kind than q's and k's;
  // null when qkv holds v's rows too. With it, qkv.bias covers q's and k's rows and v's bias
  // (when qkv has one) is v->bias.
  const int4::PackedWeight* v = nullptr;
};

// Why the shapes cannot be run, or nullptr; *head_dim is set when they can.
LLMCORE_KERNELS_CXX_API const char* int4_norm_qkv_rope_shape_error(const Int4NormQkvRope& a, int64_t* head_dim);

// h [rows, dim], cos and sin [rows, head_dim] (each row its token's position) ->
// q [rows, n_heads, head_dim], k and v [rows, n_kv_heads, head_dim]. With q_norm and k_norm,
// each q and k head is normed (llmcore::rms_norm's kernel) before it is rotated.
LLMCORE_KERNELS_CXX_API void int4_norm_qkv_rope_forward(const float* h, int64_t rows, const Int4NormQkvRope& a,
                                                        const float* cos, const float* sin, float* q, float* k,
                                                        float* v, const ParallelFor& parallel);

// out [rows, w.n] = x [rows, w.k] W^T (+ w.bias).
LLMCORE_KERNELS_CXX_API void int4_linear_forward(const float* x, int64_t rows, const int4::PackedWeight& w, float* out,
                                                 const ParallelFor& parallel);

// out [rows, w.n] = residual [rows, w.n] + (x [rows, w.k] W^T (+ w.bias)). out may be residual.
LLMCORE_KERNELS_CXX_API void int4_linear_add_forward(const float* x, int64_t rows, const int4::PackedWeight& w,
                                                     const float* residual, float* out, const ParallelFor& parallel);

// out [rows, w.n] = residual + rms_norm(x [rows, w.k] W^T) with norm_weight [w.n]. out may be residual.
LLMCORE_KERNELS_CXX_API void int4_linear_norm_add_forward(const float* x, int64_t rows, const int4::PackedWeight& w,
                                                          const float* norm_weight, double eps, const float* residual,
                                                          float* out, const ParallelFor& parallel);

// out [rows, dim] = h + mlp(rms_norm(h)), or h + rms_norm(mlp(rms_norm(h))) with the second
// norm's weight when post_norm_weight is given; w must pass int4_mlp_shape_error.
LLMCORE_KERNELS_CXX_API void int4_norm_mlp_add_forward(const float* h, int64_t rows, const float* norm_weight,
                                                       double eps, const Int4MlpWeights& w, float* out,
                                                       const ParallelFor& parallel,
                                                       const float* post_norm_weight = nullptr, double post_eps = 0.0);

// A LayerNorm over each row: (x - mean) / sqrt(var + eps) * weight (+ bias), var the mean
// square deviation (PyTorch's, not the unbiased one).
struct LayerNorm {
  const float* weight;  // [dim]
  const float* bias;    // [dim] or null
  double eps;
};

// A plain MLP: down(act(up(x))), biases (w.bias) on either.
struct Int4FfnWeights {
  int4::PackedWeight up;    // [hidden, dim]
  int4::PackedWeight down;  // [dim, hidden]
  GluActivation activation = GluActivation::gelu_tanh;
};

// Why the shapes cannot be run, or nullptr: dim and hidden multiples of 32, down back to dim.
LLMCORE_KERNELS_CXX_API const char* int4_ffn_shape_error(const Int4FfnWeights& w);

// out [rows, w.n] = layer_norm(h [rows, w.k]) W^T (+ w.bias).
LLMCORE_KERNELS_CXX_API void int4_layer_norm_linear_forward(const float* h, int64_t rows, const LayerNorm& norm,
                                                            const int4::PackedWeight& w, float* out,
                                                            const ParallelFor& parallel);

// out [rows, dim] = h + down(act(up(layer_norm(h)))), the biases w.up.bias and w.down.bias
// (when given) added by the GEMMs; w must pass int4_ffn_shape_error. out may be h.
LLMCORE_KERNELS_CXX_API void int4_layer_norm_ffn_add_forward(const float* h, int64_t rows, const LayerNorm& norm,
                                                             const Int4FfnWeights& w, float* out,
                                                             const ParallelFor& parallel);

}  // namespace llmcore_kernels
