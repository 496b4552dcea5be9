// llmcore-kernels: the C interface of the fused RMSNorm kernel.
//
// The kernel itself is written against ExecuTorch's types (rms_norm.cpp) and
// registered with the ExecuTorch runtime as `llmcore::rms_norm.out`. This entry
// point lets code that cannot include ExecuTorch's headers next to PyTorch's
// (their c10 headers collide) run that very kernel on plain buffers: the
// PyTorch registration in rms_norm_aten.cpp calls it, so eager PyTorch, export
// and the runtime all execute one implementation.
#pragma once

#include <cstdint>

#if defined(__GNUC__)
#define LLMCORE_KERNELS_API __attribute__((visibility("default")))
#else
#define LLMCORE_KERNELS_API
#endif

extern "C" {

// out = input * rsqrt(mean(input^2, -1) + eps) * weight over the last dimension.
//
// `scalar_type` is the ScalarType code shared by PyTorch and ExecuTorch
// (Float = 6, Half = 5, BFloat16 = 15, Double = 7). `input` and `out` are
// contiguous with `dim` sizes; `weight` is contiguous with sizes[dim - 1]
// elements, all of the same dtype. Returns 0 on success, else the
// ExecuTorch error code the kernel failed with (it also logs why).
LLMCORE_KERNELS_API int llmcore_kernels_rms_norm(
    int scalar_type,
    int64_t dim,
    const int64_t* sizes,
    const void* input,
    const void* weight,
    double eps,
    void* out);

}  // extern "C"
