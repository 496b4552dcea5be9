// Which instruction set llmcore's own kernels run: the best this CPU has, capped by
// LLMCORE_KERNELS_MAX_ISA ("portable", "avx2" or "avx_vnni"). One choice for every kernel that has
// per-ISA code (the runner's attention in llm_ops.cpp, the kernels plugin's int4/int8 GEMMs
// in plugins/kernels/csrc/int4_gemm.cpp), made once per process from the CPU's own answer
// (cpuid through __builtin_cpu_supports). Header only: a target gets it by linking the
// runtime's llmcore_cpu_isa (runtime/CMakeLists.txt).
//
// The cap is how a machine runs the code another CPU would take, so that every variant is
// tested wherever the tests run (tests/runtime/test_recipes_agree.py, through
// llmcore/testing/isa_view.py's views, which set it beside hiding features from XNNPACK):
//   avx512_vnni  AVX-512 VNNI CPUs (the int GEMMs' vpdpbusd; attention takes the avx2 code)
//   avx_vnni     AVX2 with the VEX-coded VNNI and no AVX-512 VNNI: Intel's laptop and
//                desktop cores since Alder Lake (the int GEMMs' vpdpbusd on 256-bit
//                registers; everything else the avx2 code)
//   avx2         x86-64-v3: AVX2 + FMA (+ F16C, BMI2), e.g. the AVX2-only EPYC
//   portable     anything else: plain C++ loops, which the compiler vectorises for the
//                baseline (SSE2 on x86-64)
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace llmcore_kernels {

enum class Isa { portable = 0, avx2 = 1, avx_vnni = 2, avx512_vnni = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512_vnni:
      return "AVX-512 VNNI";
    case Isa::avx_vnni:
      return "AVX-VNNI";
    case Isa::avx2:
      return "AVX2";
    default:
      return "portable";
  }
}

// The CPU's best, before the cap.
inline Isa cpu_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return Isa::portable;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return Isa::avx512_vnni;
  if (__builtin_cpu_supports("avxvnni")) return Isa::avx_vnni;
  return Isa::avx2;
#else
  return Isa::portable;
#endif
}

// The ISA the kernels run: cpu_isa() capped by LLMCORE_KERNELS_MAX_ISA; read once.
inline Isa kernels_isa() {
  static const Isa isa = [] {
    const Isa best = cpu_isa();
    const char* cap = std::getenv("LLMCORE_KERNELS_MAX_ISA");
    if (cap == nullptr || *cap == '\0') return best;
    if (std::strcmp(cap, "portable") == 0) return Isa::portable;
    if (std::strcmp(cap, "avx2") == 0) return best < Isa::avx2 ? best : Isa::avx2;
    // How a Xeon runs a laptop core's code. It needs the VEX-coded VNNI itself, which an
    // AVX-512 VNNI CPU may lack (Zen 4 has only the EVEX form): without it, AVX2.
    if (std::strcmp(cap, "avx_vnni") == 0) {
      if (best < Isa::avx_vnni) return best;
      return __builtin_cpu_supports("avxvnni") ? Isa::avx_vnni : Isa::avx2;
    }
    std::fprintf(stderr, "llmcore-kernels: LLMCORE_KERNELS_MAX_ISA=%s is not one of portable, avx2, avx_vnni; ignored\n",
                 cap);
    return best;
  }();
  return isa;
}

}  // namespace llmcore_kernels
