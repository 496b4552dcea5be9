// llmcore runtime: the threads llmcore's ExecuTorch kernels split their work over (the
// runner's llama::custom_sdpa and llama::update_cache, and the kernels plugin's int4 layer
// operators and llmcore::int4_mlp) in programs made of them, in place of ExecuTorch's thread
// pool. A library of its own, libllmcore_threads.so (target llmcore_threads, owned by
// runtime/CMakeLists.txt), so that every kernel library of a process shares one pool.
//
// Why a pool of our own: ExecuTorch's pool puts its workers to sleep as soon as a
// parallel_for ends, and waking one again costs more than much of the work it is woken
// for: after a pause the sleeping worker starts each region late, and a forward call opens
// hundreds of regions (activations rounded, then a GEMM, in each of four operators a
// layer, and the attention; docs/performance.md, "Measurements behind the code"). Here
// the workers keep polling for the next region for a while after each one (kPollTime in
// kernel_threads.cpp), so that the next region of the same forward call, or of the next
// decode step, finds them awake. Between polls they yield the CPU, so that a thread that
// wants it is not kept off it; then they sleep. Two pools in one process would poll against each other for the same cores:
// hence one library that all the kernels link. In a program whose delegates run on
// ExecuTorch's pool, a second pool is the wrong choice (kernel_threads_use_own), so which
// one runs is set for each program, and moved to the own threads by a whole-layer operator
// (kernel_threads_for_whole_layers).
//
// The pool has as many threads as ExecuTorch's (executorch::extension::get_thread_count,
// which `llmcore_runner --threads` and the Python runtime's thread setting change), the
// calling thread one of them, and follows that count when it changes.
#pragma once

#include <cstdint>
#include <functional>

#if defined(__GNUC__)
#define LLMCORE_THREADS_API __attribute__((visibility("default")))
#else
#define LLMCORE_THREADS_API
#endif

namespace llmcore_kernels {

// Calls body on disjoint subranges covering [begin, end), each of `grain` items (the last
// one fewer), and returns when all are done, as ExecuTorch's parallel_for does: on the
// kernels' own threads when kernel_threads_use_own(true) was called, else with ExecuTorch's
// parallel_for. On the own threads, they take the subranges in order, each the next one
// not yet taken, so that uneven ones even out; a call made while another is running (from
// a second thread of the process, or from within a body) runs body(begin, end) on the
// calling thread alone.
LLMCORE_THREADS_API void kernel_parallel_for(int64_t begin, int64_t end, int64_t grain,
                                             const std::function<void(int64_t, int64_t)>& body);

// The number of threads kernel_parallel_for spreads over: ExecuTorch's pool size.
LLMCORE_THREADS_API int64_t kernel_thread_count();

// Which threads kernel_parallel_for uses, set for the program about to run (the process's
// last setting holds). The own ones for a program with no delegate, whose heavy work is all
// llmcore's operators (8da4w-layers). ExecuTorch's pool for one with delegates: between
// them an operator of ours does better on the worker the delegates just used than on a
// second pool's for the same cores (8da4w-mlp decoded faster on ExecuTorch's pool than on
// the own threads; docs/performance.md, "Measurements behind the code"). The default is
// ExecuTorch's pool. llmcore_runner and llmcore's Program.load set it.
LLMCORE_THREADS_API void kernel_threads_use_own(bool own);
LLMCORE_THREADS_API bool kernel_threads_own();

// Called by the operators that run a whole layer's MLP (the kernels plugin's
// int4_norm_mlp_add and int4_norm_glu_add) each time they run: the own threads from then
// on, whatever kernel_threads_use_own said for the program. A program made of those layers
// spends its time in llmcore's operators even where XNNPACK delegates run pieces between
// them (Gemma 2's soft-capped attention; RoPE's elementwise ops of q/k-norm layers before
// int4_norm_qkv_norm_rope), and
// measured on a 2-core Xeon its decode was 45-55% faster on the own threads (Qwen3 and
// Gemma 3 at SmolLM2's shape; Gemma 2 within 3%), where a program of XNNPACK layers with
// llmcore::int4_mlp between them stays ~9% faster on ExecuTorch's pool. Neither runner can
// list a program's operators before it runs (the C++ one reads no flatbuffer), so the
// operators that mark such a program say so themselves.
LLMCORE_THREADS_API void kernel_threads_for_whole_layers();

// Whether the own threads are awake, polling after a recent region (tests).
LLMCORE_THREADS_API bool kernel_threads_awake();
// How long, in microseconds of wall time, an idle worker polls before it sleeps (tests: a
// worker's polling starts after the region it last took part in began, so all are awake
// when less than this has passed since then).
LLMCORE_THREADS_API int64_t kernel_threads_poll_time_us();

}  // namespace llmcore_kernels

// The same setting for callers without C++ linkage (Python's ctypes).
extern "C" {
LLMCORE_THREADS_API void llmcore_kernel_threads_use_own(int own);
LLMCORE_THREADS_API int llmcore_kernel_threads_own(void);
}
