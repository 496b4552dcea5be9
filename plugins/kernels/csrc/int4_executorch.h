// llmcore-kernels: what the int4 operators' ExecuTorch kernels share (int4_mlp.cpp,
// int4_layer.cpp): reading a packed projection from its tensors, and the runtime's threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "int4_mlp.h"
#include "kernel_threads.h"

namespace llmcore_kernels {
namespace et {

inline bool dense(const executorch::aten::Tensor& t) {
  return executorch::runtime::tensor_is_default_dim_order(t) && executorch::runtime::tensor_is_contiguous(t);
}

// An int8 projection (int4_gemm.h): q int8 [rows, in], sums float32 [rows], and scales
// float32 [rows] (int8_rows) or float16 [rows, in/32] (int8_blocks).
inline const char* int8_projection(const executorch::aten::Tensor& q, const executorch::aten::Tensor& scales,
                                   const executorch::aten::Tensor& sums, int4::PackedWeight* out) {
  using executorch::aten::ScalarType;
  const int64_t n = q.size(0), k = q.size(1);
  if (!dense(q) || k % int4::kBlock != 0 || k >= int4::kInt8MaxK)
    return "int8 weights must be a contiguous [rows, in] tensor, in a multiple of 32 below 65536";
  if (sums.scalar_type() != ScalarType::Float || sums.dim() != 1 || sums.size(0) != n || !dense(sums))
    return "an int8 weight's row sums must be a contiguous float32 [rows] tensor";
  const bool blocks = scales.dim() == 2;
  if (scales.scalar_type() != (blocks ? ScalarType::Half : ScalarType::Float) || scales.size(0) != n ||
      !dense(scales) || (blocks ? scales.size(1) * int4::kBlock != k : scales.dim() != 1))
    return "an int8 weight's scales must be a contiguous float32 [rows] (one a row) or float16 [rows, in/32] tensor";
  *out = {static_cast<const uint8_t*>(q.const_data_ptr()), nullptr, sums.const_data_ptr<float>(), nullptr, n, k};
  if (blocks) {
    out->format = int4::Format::int8_blocks;
    out->block_scales = static_cast<const uint16_t*>(scales.const_data_ptr());
  } else {
    out->format = int4::Format::int8_rows;
    out->row_scales = scales.const_data_ptr<float>();
  }
  return nullptr;
}

// A Q6_K projection (int4_gemm.h): packed uint8 [rows, in/256, 210], the file's super-blocks
// (each holds its d: scales is an empty float16 tensor), sums float32 [rows].
inline const char* q6_k_projection(const executorch::aten::Tensor& packed, const executorch::aten::Tensor& scales,
                                   const executorch::aten::Tensor& sums, int4::PackedWeight* out) {
  using executorch::aten::ScalarType;
  const int64_t n = packed.size(0), k = int4::kQ6KValues * packed.size(1);
  if (!dense(packed)) return "Q6_K weights must be a contiguous [rows, in/256, 210] uint8 tensor";
  if (scales.scalar_type() != ScalarType::Half || scales.numel() != 0)
    return "a Q6_K weight's scales must be an empty float16 tensor (its super-blocks hold their d)";
  if (sums.scalar_type() != ScalarType::Float || sums.dim() != 1 || sums.size(0) != n || !dense(sums))
    return "a Q6_K weight's row sums must be a contiguous float32 [rows] tensor";
  *out = {packed.const_data_ptr<uint8_t>(), nullptr, sums.const_data_ptr<float>(), nullptr, n, k};
  out->format = int4::Format::q6_k;
  return nullptr;
}

// A projection from its three tensors (int4_gemm.h's layouts: int4 blocks packed, Q4_K, int8
// rows or blocks, Q6_K super-blocks), or why not.
inline const char* projection(const executorch::aten::Tensor& packed, const executorch::aten::Tensor& scales,
                              const executorch::aten::Tensor& sums, int4::PackedWeight* out) {
  using executorch::aten::ScalarType;
  if (packed.scalar_type() == ScalarType::Char && packed.dim() == 2) return int8_projection(packed, scales, sums, out);
  if (packed.scalar_type() == ScalarType::Byte && packed.dim() == 3 && packed.size(2) == int4::kQ6KBytes)
    return q6_k_projection(packed, scales, sums, out);
  if (packed.scalar_type() != ScalarType::Byte || packed.dim() != 3 || packed.size(2) != 16 || !dense(packed))
    return kPackedShapeError;
  const int64_t n = packed.size(0), k = int4::kBlock * packed.size(1);
  if (sums.scalar_type() != ScalarType::Float || sums.dim() != 1 || sums.size(0) != n || !dense(sums))
    return "row sums must be a contiguous float32 [rows] tensor";
  if (scales.scalar_type() == ScalarType::Byte) {  // a Q4_K weight: its super-blocks' headers
    if (k % int4::kQ4KValues != 0 || scales.dim() != 3 || scales.size(0) != n ||
        scales.size(1) * int4::kQ4KValues != k || scales.size(2) != int4::kQ4KHeaderBytes || !dense(scales))
      return "a Q4_K weight's headers must be a contiguous uint8 [rows, in/256, 16] tensor (in a multiple of 256)";
    *out = {packed.const_data_ptr<uint8_t>(), nullptr, sums.const_data_ptr<float>(), nullptr, n, k};
    out->format = int4::Format::q4_k;
    out->super_blocks = scales.const_data_ptr<uint8_t>();
    return nullptr;
  }
  if (scales.scalar_type() != ScalarType::BFloat16 || scales.dim() != 2 || scales.size(0) != n ||
      scales.size(1) * int4::kBlock != k || !dense(scales))
    return "scales must be a contiguous bfloat16 [rows, in/32] tensor (or a Q4_K weight's uint8 headers)";
  *out = {packed.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.const_data_ptr()),
          sums.const_data_ptr<float>(), nullptr, n, k};
  return nullptr;
}

// A projection's block offsets (int4_gemm.h, PackedWeight::offsets) into *w, or why not.
inline const char* block_offsets(const std::optional<executorch::aten::Tensor>& offsets, int4::PackedWeight* w) {
  if (!offsets.has_value()) return nullptr;
  const executorch::aten::Tensor& t = *offsets;
  if (w->format != int4::Format::int4_blocks)
    return "int8, Q6_K and Q4_K weights take no block offsets (Q4_K's are its headers' minima)";
  if (t.scalar_type() != executorch::aten::ScalarType::Half || t.dim() != 3 || t.size(0) != (w->n + 7) / 8 ||
      t.size(1) * int4::kBlock != w->k || t.size(2) != 8 || !dense(t))
    return "offsets must be a contiguous float16 [ceil(rows/8), in/32, 8] tensor";
  w->offsets = reinterpret_cast<const uint16_t*>(t.const_data_ptr());
  return nullptr;
}

// The MLP's two packed projections (int4_mlp.h), or why not; *part names the projection the
// reason is about ("gate_up: ", "down: "), or is "" for their shapes together.
inline const char* mlp_weights(const executorch::aten::Tensor& gate_up, const executorch::aten::Tensor& gate_up_scales,
                               const executorch::aten::Tensor& gate_up_sums, const executorch::aten::Tensor& down,
                               const executorch::aten::Tensor& down_scales, const executorch::aten::Tensor& down_sums,
                               Int4MlpWeights* w, const char** part) {
  *part = "gate_up: ";
  const char* why = projection(gate_up, gate_up_scales, gate_up_sums, &w->gate_up);
  if (why != nullptr) return why;
  *part = "down: ";
  why = projection(down, down_scales, down_sums, &w->down);
  if (why != nullptr) return why;
  *part = "";
  return int4_mlp_shape_error(*w);
}

// The kernels' threads (kernel_threads.h), one chunk per thread: as many as ExecuTorch's
// pool has, but awake between the regions of a forward call. One chunk a thread because
// each gemm_rows call has a set-up of its own (the rows' scales converted, scratch).
inline void runtime_parallel(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t threads = kernel_thread_count();
  kernel_parallel_for(begin, end, std::max<int64_t>(1, (end - begin + threads - 1) / threads), body);
}

}  // namespace et
}  // namespace llmcore_kernels
