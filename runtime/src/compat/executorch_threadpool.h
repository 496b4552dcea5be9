// The part of ExecuTorch's thread pool API the runner calls. The executorch wheel
// ships the library (lib/libexecutorch_threadpool.so, linked as executorch::threadpool)
// but not its header, extension/threadpool/threadpool.h. These declarations match the
// symbols that library exports (`nm -DC libexecutorch_threadpool.so | grep ThreadPool`);
// the runner only calls member functions through the pointer get_threadpool() returns
// and never depends on the class layout.
#pragma once

#include <cstddef>
#include <cstdint>

namespace executorch {
namespace extension {
namespace threadpool {

class ThreadPool {
 public:
  size_t get_thread_count() const;
  // Replaces the pool's threads with num_threads new ones. Must not be called while
  // anything runs on the pool (the runner calls it before loading a program).
  bool _unsafe_reset_threadpool(uint32_t num_threads);

  ThreadPool() = delete;
};

// The process-wide pool that ExecuTorch's kernels and XNNPACK use.
ThreadPool* get_threadpool();

}  // namespace threadpool
}  // namespace extension
}  // namespace executorch
