// llmcore-kernels: what the int4 operators' PyTorch registrations share (int4_mlp_aten.cpp,
// int4_layer_aten.cpp): reading a packed projection from its tensors, and ATen's threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "int4_mlp.h"

namespace llmcore_kernels {
namespace aten {

// A projection (int4_gemm.h's layouts: int4 blocks packed, Q4_K, int8 rows or blocks, Q6_K) from its three
// tensors; `op` and `name` say whose, in the error.
inline int4::PackedWeight projection(const char* op, const char* name, const at::Tensor& packed,
                                     const at::Tensor& scales, const at::Tensor& sums) {
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu() && sums.device().is_cpu(), op,
              ": CPU tensors only");
  if (packed.scalar_type() == at::kChar && packed.dim() == 2) {  // int8 rows, or int8 blocks
    const int64_t n = packed.size(0), k = packed.size(1);
    TORCH_CHECK(packed.is_contiguous() && k % int4::kBlock == 0 && k < int4::kInt8MaxK, op, ": ", name,
                ": int8 weights must be a contiguous [rows, in] tensor, in a multiple of 32 below 65536, got ",
                packed.sizes());
    TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.dim() == 1 && sums.size(0) == n && sums.is_contiguous(), op,
                ": ", name, ": an int8 weight's row sums must be a contiguous float32 [", n, "] tensor, got ",
                sums.scalar_type(), " ", sums.sizes());
    const bool blocks = scales.dim() == 2;
    TORCH_CHECK(scales.scalar_type() == (blocks ? at::kHalf : at::kFloat) && scales.size(0) == n &&
                    scales.is_contiguous() && (blocks ? scales.size(1) * int4::kBlock == k : scales.dim() == 1),
                op, ": ", name, ": an int8 weight's scales must be a contiguous float32 [", n, "] (one a row) or "
                "float16 [", n, ", ", k / int4::kBlock, "] (one a block of 32) tensor, got ", scales.scalar_type(), " ",
                scales.sizes());
    int4::PackedWeight w{static_cast<const uint8_t*>(packed.const_data_ptr()), nullptr, sums.const_data_ptr<float>(),
                         nullptr, n, k};
    if (blocks) {
      w.format = int4::Format::int8_blocks;
      w.block_scales = static_cast<const uint16_t*>(scales.const_data_ptr());
    } else {
      w.format = int4::Format::int8_rows;
      w.row_scales = scales.const_data_ptr<float>();
    }
    return w;
  }
  if (packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == int4::kQ6KBytes) {  // Q6_K
    const int64_t n = packed.size(0), k = int4::kQ6KValues * packed.size(1);
    TORCH_CHECK(packed.is_contiguous(), op, ": ", name, ": Q6_K weights must be a contiguous [rows, in/256, 210] "
                "uint8 tensor");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == 0, op, ": ", name,
                ": a Q6_K weight's scales must be an empty float16 tensor (its super-blocks hold their d), got ",
                scales.scalar_type(), " ", scales.sizes());
    TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.dim() == 1 && sums.size(0) == n && sums.is_contiguous(), op,
                ": ", name, ": a Q6_K weight's row sums must be a contiguous float32 [", n, "] tensor");
    int4::PackedWeight w{packed.const_data_ptr<uint8_t>(), nullptr, sums.const_data_ptr<float>(), nullptr, n, k};
    w.format = int4::Format::q6_k;
    return w;
  }
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              op, ": ", name, ": ", kPackedShapeError, "; got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t n = packed.size(0), k = int4::kBlock * packed.size(1);
  TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.dim() == 1 && sums.size(0) == n && sums.is_contiguous(),
              op, ": ", name, "'s row sums must be a contiguous float32 [", n, "] tensor");
  if (scales.scalar_type() == at::kByte) {  // a Q4_K weight: its super-blocks' headers as the file holds them
    TORCH_CHECK(k % int4::kQ4KValues == 0 && scales.dim() == 3 && scales.size(0) == n &&
                    scales.size(1) * int4::kQ4KValues == k && scales.size(2) == int4::kQ4KHeaderBytes &&
                    scales.is_contiguous(),
                op, ": ", name, ": a Q4_K weight's headers must be a contiguous uint8 [", n, ", ", k / 256,
                ", 16] tensor (in a multiple of 256), got ", scales.sizes());
    int4::PackedWeight w{packed.const_data_ptr<uint8_t>(), nullptr, sums.const_data_ptr<float>(), nullptr, n, k};
    w.format = int4::Format::q4_k;
    w.super_blocks = scales.const_data_ptr<uint8_t>();
    return w;
  }
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) * int4::kBlock == k && scales.is_contiguous(),
              op, ": ", name, "'s scales must be a contiguous bfloat16 [", n, ", ", k / 32, "] tensor, got ",
              scales.scalar_type(), " ", scales.sizes());
  return {packed.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.const_data_ptr()),
          sums.const_data_ptr<float>(), nullptr, n, k};
}

// A projection's block offsets (int4_gemm.h) into w->offsets when given; returns the tensor
// holding them (kept alive by the caller for the call).
inline at::Tensor block_offsets(const char* op, const char* name, const std::optional<at::Tensor>& offsets,
                                int4::PackedWeight* w) {
  if (!offsets.has_value()) return at::Tensor();
  TORCH_CHECK(w->format == int4::Format::int4_blocks, op, ": ", name,
              ": int8, Q6_K and Q4_K weights take no block offsets (Q4_K's are its headers' minima)");
  TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->device().is_cpu() && offsets->dim() == 3 &&
                  offsets->size(0) == (w->n + 7) / 8 && offsets->size(1) * int4::kBlock == w->k &&
                  offsets->size(2) == 8,
              op, ": ", name, "'s offsets must be a float16 [", (w->n + 7) / 8, ", ", w->k / int4::kBlock,
              ", 8] CPU tensor (ceil(rows/8), in/32, 8), got ", offsets->scalar_type(), " ", offsets->sizes());
  at::Tensor contiguous = offsets->contiguous();
  w->offsets = reinterpret_cast<const uint16_t*>(contiguous.const_data_ptr());
  return contiguous;
}

// ATen's threads, one chunk each (as the runtime's: int4_executorch.h).
inline void torch_parallel(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(begin, end, std::max<int64_t>(1, (end - begin + threads - 1) / threads), body);
}

// A float32 CPU tensor whose last size is `width`, made contiguous; `what` names it.
inline at::Tensor float_rows(const char* op, const char* what, const at::Tensor& t, int64_t width) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), op, ": ", what, " must be a float32 CPU tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == width, op, ": ", what, "'s last size must be ", width, ", got ", t.sizes());
  return t.contiguous();
}

}  // namespace aten
}  // namespace llmcore_kernels
