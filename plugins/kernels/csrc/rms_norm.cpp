// llmcore::rms_norm.out: RMSNorm over the last dimension in one pass per row.
//
//   out = (x * rsqrt(mean(x^2, -1) + eps)) * weight
//
// The Llama family's RMSNorm lowers to pow, mean, add, rsqrt and two muls; with
// XNNPACK the mean stays a portable op, so every norm also splits the delegated
// graph in two. This kernel reads each row twice (sum of squares, then scale)
// and writes it once, and is one operator call.
//
// Written against the ExecuTorch runtime headers that ship in the executorch
// wheel, and registered with EXECUTORCH_LIBRARY: the registration runs when this
// library is loaded, into the operator registry of the runtime it links
// (the wheel's libexecutorch.so, the same one the Python bindings `_C` link).
#include "rms_norm.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

namespace llmcore_kernels {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

namespace {

// float for float and the 16-bit types, double for double.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t cols, double eps) {
  using Acc = acc_t<T>;
  const Acc acc_eps = static_cast<Acc>(eps);
  const Acc inv_cols = Acc(1) / static_cast<Acc>(cols);
  constexpr int kLanes = 8;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    // Sum of squares in kLanes independent partial sums: no loop-carried
    // dependence on one accumulator, so the compiler vectorises it without
    // -ffast-math.
    Acc part[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const Acc v = static_cast<Acc>(xr[c + k]);
        part[k] += v * v;
      }
    }
    Acc sum = 0;
    for (int k = 0; k < kLanes; ++k) sum += part[k];
    for (; c < cols; ++c) {
      const Acc v = static_cast<Acc>(xr[c]);
      sum += v * v;
    }
    const Acc scale = Acc(1) / std::sqrt(sum * inv_cols + acc_eps);
    // The module computes in float, rounds to the input's dtype, then multiplies
    // by the weight: the same two roundings here for 16-bit types.
    for (c = 0; c < cols; ++c) {
      const T normed = static_cast<T>(static_cast<Acc>(xr[c]) * scale);
      yr[c] = static_cast<T>(static_cast<Acc>(normed) * static_cast<Acc>(w[c]));
    }
  }
}

}  // namespace

// The kernel: llmcore::rms_norm.out(Tensor input, Tensor weight, float eps, *, Tensor(a!) out) -> Tensor(a!)
Tensor& rms_norm_out(KernelRuntimeContext& ctx, const Tensor& input, const Tensor& weight, double eps, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, input.dim() >= 1, InvalidArgument, out, "llmcore::rms_norm: input must have at least one dimension");
  const int64_t cols = input.size(input.dim() - 1);
  ET_KERNEL_CHECK_MSG(ctx, weight.dim() == 1 && weight.size(0) == cols, InvalidArgument, out,
                      "llmcore::rms_norm: weight must be 1-D with the input's last size (%lld)", (long long)cols);
  ET_KERNEL_CHECK_MSG(ctx, weight.scalar_type() == input.scalar_type() && out.scalar_type() == input.scalar_type(),
                      InvalidArgument, out, "llmcore::rms_norm: input, weight and out must have one dtype");
  ET_KERNEL_CHECK_MSG(ctx, eps >= 0.0 && std::isfinite(eps), InvalidArgument, out,
                      "llmcore::rms_norm: eps must be finite and >= 0");
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, input.sizes()) == Error::Ok, InvalidArgument, out);
  ET_KERNEL_CHECK_MSG(ctx,
                      executorch::runtime::tensor_is_default_dim_order(input) &&
                          executorch::runtime::tensor_is_default_dim_order(out) &&
                          executorch::runtime::tensor_is_contiguous(input) && executorch::runtime::tensor_is_contiguous(out),
                      InvalidArgument, out, "llmcore::rms_norm: input and out must be contiguous");
  if (input.numel() == 0) return out;
  const int64_t rows = input.numel() / cols;

  static constexpr const char kName[] = "llmcore::rms_norm.out";
  ET_SWITCH_FLOAT_TYPES_AND2(Half, BFloat16, input.scalar_type(), ctx, kName, CTYPE, [&] {
    rms_norm_rows<CTYPE>(input.const_data_ptr<CTYPE>(), weight.const_data_ptr<CTYPE>(), out.mutable_data_ptr<CTYPE>(),
                         rows, cols, eps);
  });
  return out;
}

}  // namespace llmcore_kernels

// Runs at load time: registers the kernel under its operator name.
EXECUTORCH_LIBRARY(llmcore, "rms_norm.out", llmcore_kernels::rms_norm_out);

// ---- the same kernel on plain buffers (for the PyTorch registration) ----------

extern "C" int llmcore_kernels_rms_norm(int scalar_type, int64_t dim, const int64_t* sizes, const void* input,
                                        const void* weight, double eps, void* out) {
  using executorch::aten::DimOrderType;
  using executorch::aten::ScalarType;
  using executorch::aten::SizesType;
  using executorch::aten::StridesType;
  using executorch::aten::Tensor;
  using executorch::aten::TensorImpl;
  using executorch::runtime::Error;
  using executorch::runtime::KernelRuntimeContext;
  constexpr int64_t kMaxDim = 16;
  if (dim < 1 || dim > kMaxDim) return static_cast<int>(Error::InvalidArgument);
  SizesType in_sizes[kMaxDim];
  DimOrderType dim_order[kMaxDim];
  StridesType strides[kMaxDim];
  for (int64_t i = 0; i < dim; ++i) {
    if (sizes[i] < 0 || sizes[i] > std::numeric_limits<SizesType>::max()) return static_cast<int>(Error::InvalidArgument);
    in_sizes[i] = static_cast<SizesType>(sizes[i]);
    dim_order[i] = static_cast<DimOrderType>(i);
  }
  StridesType stride = 1;
  for (int64_t i = dim - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= in_sizes[i] > 0 ? in_sizes[i] : 1;
  }
  SizesType w_size[1] = {in_sizes[dim - 1]};
  DimOrderType w_order[1] = {0};
  StridesType w_strides[1] = {1};
  const auto type = static_cast<ScalarType>(scalar_type);
  TensorImpl in_impl(type, dim, in_sizes, const_cast<void*>(input), dim_order, strides);
  TensorImpl w_impl(type, 1, w_size, const_cast<void*>(weight), w_order, w_strides);
  TensorImpl out_impl(type, dim, in_sizes, out, dim_order, strides);
  Tensor in_t(&in_impl), w_t(&w_impl), out_t(&out_impl);
  KernelRuntimeContext ctx;
  llmcore_kernels::rms_norm_out(ctx, in_t, w_t, eps, out_t);
  return static_cast<int>(ctx.failure_state());
}
