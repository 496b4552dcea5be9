// llmcore runtime: kernel_parallel_for's pool (kernel_threads.h says why it exists).
//
// A region: the caller publishes the body and its parts, bumps `generation_` and takes
// parts itself; each worker, polling or woken, sees the new generation, takes parts until
// none is left and counts itself done in `pending_`; the caller returns when all are.
#include "kernel_threads.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace llmcore_kernels {
namespace {

using Body = std::function<void(int64_t, int64_t)>;

// How long an idle worker keeps polling before it sleeps. It covers the gaps between
// the regions of one forward call (the attention between two layer operators, say) and
// between the calls of a decode loop, whose sampling and bookkeeping take a fraction of a
// millisecond (docs/performance.md, "Measurements behind the code").
constexpr std::chrono::microseconds kPollTime{2000};
// Polls between two yields of the CPU while polling.
constexpr int kPausesPerYield = 16;

inline void pause_briefly() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

class Pool {
 public:
  // Whether every worker is polling: none asleep, and as many as the runtime's pool wants.
  bool awake() {
    return !workers_.empty() && static_cast<int64_t>(workers_.size()) + 1 == kernel_thread_count() &&
           sleeping_.load(std::memory_order_relaxed) == 0 && owner_ == getpid();
  }

  void run(int64_t begin, int64_t end, int64_t grain, const Body& body) {
    const int64_t threads = kernel_thread_count();
    grain = std::max<int64_t>(1, grain);
    if (end <= begin) return;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || threads == 1 || end - begin <= grain) return body(begin, end);
    if (owner_ != getpid()) abandon_workers();  // a forked child has none of its parent's threads
    if (static_cast<int64_t>(workers_.size()) + 1 != threads) resize(threads);

    body_ = &body;
    begin_ = begin;
    end_ = end;
    grain_ = grain;
    parts_ = (end - begin + grain - 1) / grain;
    next_part_.store(0, std::memory_order_relaxed);
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the fields above
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    run_parts();
    for (int polls = 1; pending_.load(std::memory_order_acquire) != 0; ++polls) {
      pause_briefly();
      if (polls % 1024 == 0) sched_yield();  // a worker that lost its CPU needs one
    }
  }

 private:
  // The parts not yet taken, one after another, until none is left.
  void run_parts() {
    for (int64_t part; (part = next_part_.fetch_add(1, std::memory_order_relaxed)) < parts_;) {
      const int64_t b = begin_ + part * grain_;
      (*body_)(b, std::min(end_, b + grain_));
    }
  }

  // Waits for a generation other than `seen`: polling for kPollTime, then asleep.
  // Returns it, or `seen` when the worker is to stop.
  uint64_t next_generation(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 1;; ++polls) {
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if (g != seen) return g;
      if (stop_.load(std::memory_order_relaxed)) return seen;
      pause_briefly();
      if (polls % kPausesPerYield == 0) {
        sched_yield();
        if (std::chrono::steady_clock::now() - start > kPollTime) break;
      }
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleeping_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t g = seen;
    wake_.wait(lock, [&] {
      g = generation_.load(std::memory_order_seq_cst);
      return g != seen || stop_.load(std::memory_order_relaxed);
    });
    sleeping_.fetch_sub(1, std::memory_order_seq_cst);
    return g;
  }

  void work(uint64_t seen) {
    for (;;) {
      const uint64_t g = next_generation(seen);
      if (g == seen) return;
      seen = g;
      run_parts();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void resize(int64_t threads) {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_.store(true, std::memory_order_relaxed);
      wake_.notify_all();
    }
    for (std::thread& t : workers_) t.join();
    workers_.clear();
    stop_.store(false, std::memory_order_relaxed);
    const uint64_t now = generation_.load(std::memory_order_relaxed);
    for (int64_t part = 1; part < threads; ++part) workers_.emplace_back([this, now] { work(now); });
  }

  // After fork(): the threads are gone; their handles are left unjoined (joining or
  // destroying them would fail).
  void abandon_workers() {
    new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    owner_ = getpid();
  }

  std::mutex busy_;  // one region at a time
  std::vector<std::thread> workers_;
  pid_t owner_ = getpid();
  const Body* body_ = nullptr;
  int64_t begin_ = 0, end_ = 0, grain_ = 1, parts_ = 0;
  std::atomic<int64_t> next_part_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
};

}  // namespace

int64_t kernel_thread_count() { return std::max<int64_t>(1, executorch::extension::get_thread_count()); }

namespace {
Pool& pool() {
  // Never destroyed: workers still polling when the process exits must not find it gone.
  static Pool* const instance = new Pool;
  return *instance;
}
std::atomic<bool> use_own{false};
}  // namespace

void kernel_parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  if (use_own.load(std::memory_order_relaxed))
    pool().run(begin, end, grain, body);
  else
    executorch::extension::parallel_for(begin, end, grain, body);
}

void kernel_threads_use_own(bool own) { use_own.store(own, std::memory_order_relaxed); }
void kernel_threads_for_whole_layers() {
  if (!use_own.load(std::memory_order_relaxed)) use_own.store(true, std::memory_order_relaxed);
}
bool kernel_threads_own() { return use_own.load(std::memory_order_relaxed); }
bool kernel_threads_awake() { return pool().awake(); }
int64_t kernel_threads_poll_time_us() { return kPollTime.count(); }

}  // namespace llmcore_kernels

void llmcore_kernel_threads_use_own(int own) { llmcore_kernels::kernel_threads_use_own(own != 0); }
int llmcore_kernel_threads_own(void) { return llmcore_kernels::kernel_threads_own() ? 1 : 0; }
