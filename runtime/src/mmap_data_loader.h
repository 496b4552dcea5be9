// An mmap-backed ExecuTorch DataLoader (the wheel ships the DataLoader interface but not
// the extension loaders, so the runner brings its own), in one of two residences:
//
//   huge_pages (the default): the file read into anonymous memory advised for transparent
//       huge pages (MADV_HUGEPAGE; 2 MiB pages where the kernel has them). A decode step
//       streams every weight once; with 4 KiB file pages that is a TLB miss every 4 KiB and
//       pages scattered in physical memory (docs/performance.md, "The program in huge
//       pages"). The whole file is resident, tables whose rows are never read included.
//   file_pages (--mmap): the file mapped read-only: pages come in from the page cache when
//       touched and can be shared with other processes; the smallest resident set.
//
// Giving memory back. The runtime frees buffers it no longer needs: a delegate's blob once
// XNNPACK has built its runtime, and the named weights XNNPACK has packed into its own
// copy. Their pages are given back (MADV_DONTNEED) so that a weight is not held twice, but
// only under two rules, because the runtime may load the same bytes again: a named weight
// is stored once and loaded by every delegate that uses it (RoPE's pair-swap matrix is one
// entry shared by every layer's q and k), and each load returns its own FreeableBuffer.
//   1. A page is given back only when no buffer handed out over it is still live: a page
//      counts the live buffers that overlap it, and only whole pages inside the freed
//      buffer whose count is zero are released.
//   2. A load (or load_into) over a released page reads it back from the file first. In
//      anonymous memory MADV_DONTNEED leaves zeros; without this a second delegate packed
//      zeros where the first had packed the matrix (llmcore_runner answered "\n" forever,
//      issue 58). A file mapping faults the page back in by itself; the bookkeeping is the
//      same for both residences.
// What no loader can see is a consumer that frees a buffer and keeps reading it. With
// LLMCORE_RUNNER_TRAP_RELEASED=1 released pages are made inaccessible (PROT_NONE) instead
// of dropped, so such a read stops the runner with one line naming the file offset
// (exit status 3); the tests run every shipped recipe that way.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <executorch/runtime/core/data_loader.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/result.h>

namespace llmcore {

class MmapDataLoader final : public executorch::runtime::DataLoader {
 public:
  enum class Residence { huge_pages, file_pages };

  // What the loader has given back, for --verbose and the tests.
  struct ReleaseCounts {
    uint64_t released_bytes = 0;  // pages given back, in bytes, over the whole run
    uint64_t restored_bytes = 0;  // pages read back because the runtime loaded them again
  };

  // Maps or reads the whole file. Returns nullptr and fills *err on failure.
  static std::unique_ptr<MmapDataLoader> open(const std::string& path, std::string* err,
                                              Residence residence = Residence::huge_pages);
  ~MmapDataLoader() override;

  MmapDataLoader(const MmapDataLoader&) = delete;
  MmapDataLoader& operator=(const MmapDataLoader&) = delete;

  executorch::runtime::Result<executorch::runtime::FreeableBuffer> load(
      size_t offset, size_t size, const SegmentInfo& segment_info) const override;
  executorch::runtime::Error load_into(size_t offset, size_t size, const SegmentInfo& segment_info,
                                       void* buffer) const override;
  executorch::runtime::Result<size_t> size() const override { return size_; }

  const uint8_t* data() const { return data_; }
  ReleaseCounts release_counts() const;

 private:
  MmapDataLoader(int fd, const uint8_t* data, size_t size, size_t mapped, Residence residence);

  static std::unique_ptr<MmapDataLoader> read_into_huge_pages(int fd, size_t size, const std::string& path,
                                                              std::string* err);
  // FreeableBuffer's free function; `context` is the loader.
  static void on_free(void* context, void* data, size_t size);
  void release(size_t offset, size_t size) const;
  // Reads back every released page of [offset, offset + size); with `pin`, counts a live
  // buffer on each page it overlaps. Called with mutex_ held. False if a read failed.
  bool restore(size_t offset, size_t size, bool pin) const;
  bool in_bounds(size_t offset, size_t size) const {
    // A truncated file shows up here: the program asks for bytes past the end.
    return offset <= size_ && size <= size_ - offset;
  }

  int fd_;  // kept open: released pages are read back from it
  const uint8_t* data_;
  size_t size_;
  size_t mapped_;  // the mapping's length (huge pages: size_ rounded up to 2 MiB)
  Residence residence_;
  size_t page_;
  bool trap_;  // LLMCORE_RUNNER_TRAP_RELEASED: released pages made inaccessible

  mutable std::mutex mutex_;            // FreeableBuffer's free function must be thread-safe
  mutable std::vector<uint32_t> live_;  // per page: live buffers that overlap it
  mutable std::vector<bool> released_;  // per page: given back, to be read again on load
  mutable ReleaseCounts counts_;
};

}  // namespace llmcore
