// llmcore's own ExecuTorch kernels for the LLM custom ops that llmcore's `kv-cache`
// transform emits (llmcore/builtins/kv_cache.py):
//
//   llama::update_cache.out(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out) -> Tensor(b!)
//   llama::update_cache_with_indices.out(Tensor value, Tensor(a!) cache, SymInt start_pos, Tensor indices, *,
//                                        Tensor(b!) out) -> Tensor(b!)
//   llama::custom_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask=None,
//                          float drpout_p=0., bool is_causal=False, float? scale=None, *, Tensor(a!) out) -> Tensor(a!)
//
//   llama::custom_quantized_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos,
//                          Tensor? attn_mask=None, float drpout_p=0., bool is_causal=False, float? scale=None,
//                          Tensor? q_zero_points=None, Tensor? q_scales=None, Tensor? k_zero_points=None,
//                          Tensor? k_scales=None, Tensor? v_zero_points=None, Tensor? v_scales=None,
//                          bool is_seq_at_dim_2=False, *, Tensor(a!) out) -> Tensor(a!)
//
// ExecuTorch ships kernels for them only inside libcustom_ops_aot_lib.so, which needs
// libtorch and the Python extension. These are written from the schemas and from the
// behaviour of those ops in PyTorch, layout [B, S, H, D], for caches of float32, float16,
// bfloat16 and int8 (llmcore export --kv-cache-dtype):
//
// * update_cache writes value[b, s] into cache[b, start_pos + s] (in place); `out` is
//   a placeholder the program never reads, and is left untouched.
// * update_cache_with_indices writes value[b, s] into cache[b, indices[b, s]] (a sliding
//   layer's ring buffer: position p goes to row p % rows); start_pos is not read.
// * custom_sdpa attends each query row i of q[b, :, h] (absolute position start_pos + i)
//   to keys 0 .. start_pos + S - 1 of k/v[b, :, h / (H / H_kv)] (grouped-query attention),
//   only up to its own position when is_causal. scale defaults to 1/sqrt(D). With an
//   attn_mask (float32 [S, kv_len], 0 or -inf: sliding windows, ring buffers) each row
//   sees every key of the cache, the mask added to its scores, and start_pos and
//   is_causal play no part (both set is refused, as ExecuTorch's kernel refuses it).
//   Dropout is refused. Float16 and bfloat16 calls (query, key, value and out of one type)
//   compute in float32 and round the output to their type.
// * custom_quantized_sdpa is custom_sdpa over int8 query, key and value, each row of the
//   head size read back as (q - zero_point) * scale (float32 scales and int8 zero points,
//   [B, S, H, 1]); the output is float32. is_seq_at_dim_2 is refused.
// * update_cache and update_cache_with_indices copy rows of any of the four types (value
//   and cache alike): an int8 cache's scales and zero points are written by them as well.
//
// Registered with EXECUTORCH_LIBRARY into the runtime they are linked with. Built as an
// object library linked into llmcore_runner (runtime/CMakeLists.txt); a Python process
// has ExecuTorch's own registrations of these names, so libllmcore_llm_ops.so registers
// the attention kernel there under float32 kernel keys only (LLMCORE_LLM_OPS_KEYED).
#pragma once

#include <cstdint>
#include <optional>

#include <executorch/runtime/kernel/kernel_includes.h>

namespace llmcore_kernels {

executorch::aten::Tensor& update_cache_out(executorch::runtime::KernelRuntimeContext& ctx,
                                           const executorch::aten::Tensor& value, executorch::aten::Tensor& cache,
                                           int64_t start_pos, executorch::aten::Tensor& out);

executorch::aten::Tensor& update_cache_with_indices_out(executorch::runtime::KernelRuntimeContext& ctx,
                                                        const executorch::aten::Tensor& value,
                                                        executorch::aten::Tensor& cache, int64_t start_pos,
                                                        const executorch::aten::Tensor& indices,
                                                        executorch::aten::Tensor& out);

executorch::aten::Tensor& custom_sdpa_out(executorch::runtime::KernelRuntimeContext& ctx,
                                          const executorch::aten::Tensor& q, const executorch::aten::Tensor& k,
                                          const executorch::aten::Tensor& v, int64_t start_pos,
                                          const std::optional<executorch::aten::Tensor>& attn_mask, double dropout_p,
                                          bool is_causal, std::optional<double> scale, executorch::aten::Tensor& out);

// llmcore::softcap_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask,
//                           float? scale, float softcap, *, Tensor(a!) out) -> Tensor(a!)
// custom_sdpa (causal from start_pos without a mask, the mask alone with one) with each
// score s replaced by softcap * tanh(s / softcap) before the mask is added: Gemma 2's
// attention. Defined for PyTorch by llmcore/builtins/softcap_attention.py.
executorch::aten::Tensor& softcap_sdpa_out(executorch::runtime::KernelRuntimeContext& ctx,
                                           const executorch::aten::Tensor& q, const executorch::aten::Tensor& k,
                                           const executorch::aten::Tensor& v, int64_t start_pos,
                                           const std::optional<executorch::aten::Tensor>& attn_mask,
                                           std::optional<double> scale, double softcap,
                                           executorch::aten::Tensor& out);

executorch::aten::Tensor& custom_quantized_sdpa_out(
    executorch::runtime::KernelRuntimeContext& ctx, const executorch::aten::Tensor& q,
    const executorch::aten::Tensor& k, const executorch::aten::Tensor& v, int64_t start_pos,
    const std::optional<executorch::aten::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, const std::optional<executorch::aten::Tensor>& q_zero_points,
    const std::optional<executorch::aten::Tensor>& q_scales, const std::optional<executorch::aten::Tensor>& k_zero_points,
    const std::optional<executorch::aten::Tensor>& k_scales, const std::optional<executorch::aten::Tensor>& v_zero_points,
    const std::optional<executorch::aten::Tensor>& v_scales, bool is_seq_at_dim_2, executorch::aten::Tensor& out);

// llmcore::quantize_rows.out: each row of x's last dimension (float32) as int8 with a float32
// scale and an int8 zero point per row ([..., 1]), bit for bit PyTorch's
// quantized_decomposed.choose_qparams_per_token_asymmetric + quantize_per_token (an int8
// KV cache's keys, values and queries, --kv-cache-dtype int8).
void quantize_rows_out(executorch::runtime::KernelRuntimeContext& ctx, const executorch::aten::Tensor& x,
                       executorch::aten::Tensor& q, executorch::aten::Tensor& scales,
                       executorch::aten::Tensor& zero_points);

}  // namespace llmcore_kernels
