// PyTorch registration of llmcore::int4_mlp (schemas, CPU kernels), so that eager PyTorch
// and torch.export see the operator. Both variants run int4_mlp_forward (int4_mlp.cpp)
// with ATen's parallel_for: the numbers PyTorch computes before export are the numbers the
// runtime computes (each output is summed by one thread, in one order, however the rows
// are split).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "int4_aten.h"
#include "int4_mlp.h"
#include "own_threads.h"

namespace {

using llmcore_kernels::aten::projection;
constexpr const char* kOp = "llmcore::int4_mlp";

at::Tensor& int4_mlp_out(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                         const at::Tensor& gate_up_sums, const at::Tensor& down, const at::Tensor& down_scales,
                         const at::Tensor& down_sums, at::Tensor& out) {
  llmcore_kernels::Int4MlpWeights w{projection(kOp, "gate_up", gate_up, gate_up_scales, gate_up_sums),
                                    projection(kOp, "down", down, down_scales, down_sums)};
  const char* why = llmcore_kernels::int4_mlp_shape_error(w);
  TORCH_CHECK(why == nullptr, "llmcore::int4_mlp: ", why ? why : "");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "llmcore::int4_mlp: x and out must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), "llmcore::int4_mlp: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.gate_up.k, "llmcore::int4_mlp: x's last size must be ", w.gate_up.k,
              ", got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  out.resize_(xc.sizes());
  TORCH_CHECK(out.is_contiguous(), "llmcore::int4_mlp: out must be contiguous");
  if (xc.numel() == 0) return out;
  llmcore_kernels::int4_mlp_forward(xc.const_data_ptr<float>(), xc.numel() / w.gate_up.k, w,
                                    out.mutable_data_ptr<float>(), llmcore_kernels::aten::torch_parallel);
  return out;
}

at::Tensor int4_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
                    const at::Tensor& gate_up_sums, const at::Tensor& down, const at::Tensor& down_scales,
                    const at::Tensor& down_sums) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  return int4_mlp_out(x, gate_up, gate_up_scales, gate_up_sums, down, down_scales, down_sums, out);
}

// q [rows, k] int8 in [-8, 7] (the weight's integers u - 8), or the same integers two to a
// byte, uint8 [rows, k/2] (u = q + 8 of column 2j in the low nibble, of 2j + 1 in the high:
// llmcore_xnnpack.qlinear.pack_nibbles, what a GGUF's 4-bit layers are held as until the
// kernels take them) -> [rows, k/32, 16] uint8 in the kernel's packed layout (int4_gemm.h):
// the export packs with the kernel's own code, so the layout is written down once. Rows are
// packed in parallel (each by one thread, so the bytes do not depend on the split).
at::Tensor int4_pack(const at::Tensor& q) {
  const bool nibbles = q.scalar_type() == at::kByte;
  TORCH_CHECK((q.scalar_type() == at::kChar || nibbles) && q.dim() == 2 && q.device().is_cpu(),
              "llmcore::int4_pack: q must be a 2-D int8 (or uint8 nibbles) CPU tensor, got ", q.scalar_type(), " ",
              q.sizes());
  const int64_t rows = q.size(0), k = nibbles ? 2 * q.size(1) : q.size(1);
  TORCH_CHECK(k > 0 && k % llmcore_kernels::int4::kBlock == 0, "llmcore::int4_pack: q's rows must be a positive "
              "multiple of 32 long, got ", k);
  const at::Tensor qc = q.contiguous();
  if (!nibbles) {  // nibbles hold [-8, 7] by construction
    const auto [lo, hi] = at::aminmax(qc);
    TORCH_CHECK(lo.item<int8_t>() >= -8 && hi.item<int8_t>() <= 7, "llmcore::int4_pack: q outside [-8, 7]");
  }
  at::Tensor packed = at::empty({rows, k / llmcore_kernels::int4::kBlock, 16}, q.options().dtype(at::kByte));
  uint8_t* out = packed.mutable_data_ptr<uint8_t>();
  // threads of its own (own_threads): ATen's parallel_for runs serially in this library
  llmcore_kernels::aten::own_threads(rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> row(nibbles ? k : 0);
    for (int64_t r = begin; r < end; ++r) {
      const int8_t* integers = nullptr;
      if (nibbles) {
        const uint8_t* bytes = qc.const_data_ptr<uint8_t>() + r * (k / 2);
        for (int64_t j = 0; j < k / 2; ++j) {
          row[2 * j] = static_cast<int8_t>((bytes[j] & 0x0F) - 8);
          row[2 * j + 1] = static_cast<int8_t>((bytes[j] >> 4) - 8);
        }
        integers = row.data();
      } else {
        integers = qc.const_data_ptr<int8_t>() + r * k;
      }
      llmcore_kernels::int4::pack_row(integers, k, out + r * (k / 2));
    }
  });
  return packed;
}

}  // namespace

// The rest of the llmcore namespace's schemas are in rms_norm_aten.cpp (TORCH_LIBRARY).
TORCH_LIBRARY_FRAGMENT(llmcore, m) {
  m.def(
      "int4_mlp(Tensor x, Tensor gate_up, Tensor gate_up_scales, Tensor gate_up_sums, Tensor down, "
      "Tensor down_scales, Tensor down_sums) -> Tensor");
  m.def(
      "int4_mlp.out(Tensor x, Tensor gate_up, Tensor gate_up_scales, Tensor gate_up_sums, Tensor down, "
      "Tensor down_scales, Tensor down_sums, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("int4_pack(Tensor q) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmcore, CPU, m) {
  m.impl("int4_mlp", TORCH_FN(int4_mlp));
  m.impl("int4_mlp.out", TORCH_FN(int4_mlp_out));
  m.impl("int4_pack", TORCH_FN(int4_pack));
}
