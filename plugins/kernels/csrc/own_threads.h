// llmcore-kernels: threads of the PyTorch library's own (llmcore_kernels_aot), for the export's
// operators that take milliseconds or more (int4_pack, block_round_least_error).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace llmcore_kernels {
namespace aten {

// body(begin, end) over [0, count) in as many parts as PyTorch has threads (at most one per
// `per_part` items), each part on a thread of its own, the first on the caller's. This
// library is built without OpenMP, so ATen's parallel_for, an OpenMP loop inlined from its
// header, runs serially here; ExecuTorch's pool (kernel_threads.h), as fast, writes
// cpuinfo's probing to an export's stderr when it first starts. For calls of milliseconds
// or more (an export's weight packing and scale search): starting threads is noise there.
inline void own_threads(int64_t count, int64_t per_part, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count / std::max<int64_t>(1, per_part)));
  std::vector<std::thread> helpers;
  for (int64_t p = 1; p < parts; ++p) helpers.emplace_back(body, count * p / parts, count * (p + 1) / parts);
  body(0, count / parts);
  for (std::thread& t : helpers) t.join();
}

}  // namespace aten
}  // namespace llmcore_kernels
