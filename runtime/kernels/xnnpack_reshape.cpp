// Skipping XNNPACK's whole-runtime reshape when no input shape changed.
//
// ExecuTorch's XNNPACK delegate (XNNExecutor::prepare_args in the 1.5.1 wheel) calls
// xnn_reshape_external_value for each input and then xnn_reshape_runtime on every
// execution, whether or not a shape changed. xnn_reshape_runtime re-runs the reshape of
// every operator in the delegate (shapes, tiling, workspace sizes). On SmolLM2's decode
// step, 32 delegate calls a token, that was a share of the calling thread's time that
// perf showed, with the other thread idle meanwhile (docs/performance.md, "Decode:
// attention by kv head, and no reshape per call").
//
// A runtime whose inputs have the shapes of its last successful reshape needs none: its
// operators' shapes, and the memory plan derived from them, are what that reshape left.
// Its pointers into a workspace shared with other runtimes stay right too, because
// XNNPACK moves every sharing runtime's pointers (and sets up its operators again) when
// one of them grows the workspace (initialize_workspace_values in XNNPACK's runtime.c).
//
// The three entry points are interposed: ExecuTorch's XNNPACK library calls them through
// its PLT, and a definition found first in symbol lookup wins. llmcore_runner links this
// file, so the executable's definitions come first. A Python process loads it as
// libllmcore_xnnpack_reshape.so with RTLD_GLOBAL before it imports ExecuTorch's bindings
// (llmcore.runtime.libraries.load_preloaded_libraries); imported later, it changes nothing, as
// the bindings' libraries are bound when they load. Each definition forwards to
// XNNPACK's own, looked up in the loaded libexecutorch_backend_xnnpack.so.
//
// LLMCORE_XNNPACK_RESHAPE=always passes every call on, as without this file.
#include "xnnpack_reshape.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct xnn_runtime;  // opaque: only its address is used

struct KnownShapes {
  std::unordered_map<uint32_t, std::vector<size_t>> inputs;  // external value id -> dims
  bool changed = true;  // true until the first successful reshape, and after any input's change
};

struct State {
  std::mutex mutex;  // delegates may run from more than one thread
  std::unordered_map<const xnn_runtime*, KnownShapes> runtimes;
  llmcore::XnnpackReshapeCounts counts;
  State() {
    const char* env = std::getenv("LLMCORE_XNNPACK_RESHAPE");
    counts.always = env != nullptr && std::strcmp(env, "always") == 0;
  }
};

State& state() {
  static State s;
  return s;
}

// XNNPACK's definition of `name`: the one in ExecuTorch's XNNPACK library, which is loaded
// by the time the delegate calls anything (a handle's lookup starts at that library, not at
// these definitions).
template <typename Fn>
Fn xnnpack_function(const char* name) {
  void* library = dlopen("libexecutorch_backend_xnnpack.so", RTLD_LAZY | RTLD_NOLOAD);
  void* f = library != nullptr ? dlsym(library, name) : nullptr;
  if (f == nullptr) {
    std::fprintf(stderr, "llmcore: XNNPACK's %s is not loaded: %s\n", name, dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}

}  // namespace

// xnn_status is an enum whose success value is 0; ints here keep XNNPACK's header out.
extern "C" __attribute__((visibility("default"))) int xnn_reshape_external_value(xnn_runtime* runtime,
                                                                                uint32_t external_id,
                                                                                size_t num_dims, const size_t* dims) {
  using Fn = int (*)(xnn_runtime*, uint32_t, size_t, const size_t*);
  static const Fn xnnpack = xnnpack_function<Fn>("xnn_reshape_external_value");
  const int status = xnnpack(runtime, external_id, num_dims, dims);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  KnownShapes& known = s.runtimes[runtime];
  std::vector<size_t>& was = known.inputs[external_id];
  if (status != 0 || was.size() != num_dims || std::memcmp(was.data(), dims, num_dims * sizeof(size_t)) != 0) {
    was.assign(dims, dims + num_dims);
    known.changed = true;
  }
  return status;
}

extern "C" __attribute__((visibility("default"))) int xnn_reshape_runtime(xnn_runtime* runtime) {
  using Fn = int (*)(xnn_runtime*);
  static const Fn xnnpack = xnnpack_function<Fn>("xnn_reshape_runtime");
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.runtimes.find(runtime);
    if (!s.counts.always && it != s.runtimes.end() && !it->second.changed) {
      ++s.counts.skipped;
      return 0;
    }
  }
  const int status = xnnpack(runtime);
  std::lock_guard<std::mutex> lock(s.mutex);
  ++s.counts.done;
  if (status == 0) s.runtimes[runtime].changed = false;
  return status;
}

// A new runtime may be given a deleted one's address: forget what was known about it.
extern "C" __attribute__((visibility("default"))) int xnn_delete_runtime(xnn_runtime* runtime) {
  using Fn = int (*)(xnn_runtime*);
  static const Fn xnnpack = xnnpack_function<Fn>("xnn_delete_runtime");
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.runtimes.erase(runtime);
  }
  return xnnpack(runtime);
}

namespace llmcore {

XnnpackReshapeCounts xnnpack_reshape_counts() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.counts;
}

}  // namespace llmcore

// For a Python process (ctypes): the counts above; returns 1 with LLMCORE_XNNPACK_RESHAPE=always.
extern "C" __attribute__((visibility("default"))) int llmcore_xnnpack_reshape_counts(uint64_t* done,
                                                                                    uint64_t* skipped) {
  const llmcore::XnnpackReshapeCounts c = llmcore::xnnpack_reshape_counts();
  *done = c.done;
  *skipped = c.skipped;
  return c.always ? 1 : 0;
}
