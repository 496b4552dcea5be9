// PyTorch registration of llmcore::rms_norm, so that eager PyTorch and
// torch.export see the operator. Both variants run the ExecuTorch kernel of
// rms_norm.cpp (through its C entry point, llmcore_kernels_rms_norm): the
// numbers PyTorch computes before export are the numbers the runtime computes.
//
// Built into libllmcore_kernels_aot.so, which links libllmcore_kernels.so (the
// ExecuTorch kernel and its runtime registration) and libtorch. Python loads it
// with torch.ops.load_library; a runtime without PyTorch loads only
// libllmcore_kernels.so.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rms_norm.h"

namespace {

void check_args(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.dim() >= 1, "llmcore::rms_norm: input must have at least one dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1),
              "llmcore::rms_norm: weight must be 1-D with the input's last size (", input.size(-1), "), got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), "llmcore::rms_norm: input (", input.scalar_type(),
              ") and weight (", weight.scalar_type(), ") must have one dtype");
  const auto t = input.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
              "llmcore::rms_norm: unsupported dtype ", t, " (float32, float64, float16 or bfloat16)");
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "llmcore::rms_norm: CPU tensors only");
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), "llmcore::rms_norm: eps must be finite and >= 0");
}

at::Tensor& rms_norm_out(const at::Tensor& input, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_args(input, weight, eps);
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "llmcore::rms_norm: out must have the input's dtype");
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  out.resize_(x.sizes());
  TORCH_CHECK(out.is_contiguous(), "llmcore::rms_norm: out must be contiguous");
  if (x.numel() == 0) return out;
  const int err = llmcore_kernels_rms_norm(static_cast<int>(x.scalar_type()), x.dim(), x.sizes().data(),
                                           x.const_data_ptr(), w.const_data_ptr(), eps, out.mutable_data_ptr());
  TORCH_CHECK(err == 0, "llmcore::rms_norm: the ExecuTorch kernel failed with error ", err);
  return out;
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  return rms_norm_out(input, weight, eps, out);
}

}  // namespace

// The schema: a functional variant (what the model calls and torch.export
// records) and the .out variant (what to_executorch turns it into, and the name
// the ExecuTorch kernel is registered under).
TORCH_LIBRARY(llmcore, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm.out(Tensor input, Tensor weight, float eps, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(llmcore, CPU, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("rms_norm.out", TORCH_FN(rms_norm_out));
}
