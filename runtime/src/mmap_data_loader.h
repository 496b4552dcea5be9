// An mmap-backed ExecuTorch DataLoader (the wheel ships the DataLoader interface but not
// the extension loaders, so the runner brings its own), in one of two residences:
//
//   huge_pages (the default): the file read into anonymous memory advised for transparent
//       huge pages (MADV_HUGEPAGE; 2 MiB pages where the kernel has them). A decode step
//       streams every weight once; with 4 KiB file pages that is a TLB miss every 4 KiB and
//       pages scattered in physical memory, and the first call faults every page in. On
//       SmolLM2 (2-core EPYC, AVX2 view) 8da4w-layers decoded 307 against 283 tok/s (medians
//       of four alternating rounds); programs whose weights XNNPACK copies gained nothing
//       (docs/performance.md, "The program in huge pages"). The whole file is resident,
//       tables whose rows are never read included.
//   file_pages (--mmap): the file mapped read-only: pages come in from the page cache when
//       touched and can be shared with other processes; the smallest resident set.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <executorch/runtime/core/data_loader.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/result.h>

namespace llmcore {

class MmapDataLoader final : public executorch::runtime::DataLoader {
 public:
  enum class Residence { huge_pages, file_pages };

  // Maps or reads the whole file. Returns nullptr and fills *err on failure.
  static std::unique_ptr<MmapDataLoader> open(const std::string& path, std::string* err,
                                              Residence residence = Residence::huge_pages) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      *err = "cannot open '" + path + "': " + std::strerror(errno);
      return nullptr;
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      *err = "cannot stat '" + path + "': " + std::strerror(errno);
      ::close(fd);
      return nullptr;
    }
    if (!S_ISREG(st.st_mode)) {
      *err = "'" + path + "' is not a regular file";
      ::close(fd);
      return nullptr;
    }
    size_t size = static_cast<size_t>(st.st_size);
    if (size == 0) {
      *err = "'" + path + "' is empty";
      ::close(fd);
      return nullptr;
    }
    if (residence == Residence::huge_pages) {
      std::unique_ptr<MmapDataLoader> loader = read_into_huge_pages(fd, size, path, err);
      ::close(fd);
      return loader;
    }
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      *err = "cannot mmap '" + path + "': " + std::strerror(errno);
      ::close(fd);
      return nullptr;
    }
    return std::unique_ptr<MmapDataLoader>(new MmapDataLoader(fd, static_cast<const uint8_t*>(addr), size, size));
  }

  ~MmapDataLoader() override {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), mapped_);
    if (fd_ >= 0) ::close(fd_);
  }

  MmapDataLoader(const MmapDataLoader&) = delete;
  MmapDataLoader& operator=(const MmapDataLoader&) = delete;

  executorch::runtime::Result<executorch::runtime::FreeableBuffer> load(
      size_t offset, size_t size, const SegmentInfo& /*segment_info*/) const override {
    if (!in_bounds(offset, size)) return executorch::runtime::Error::InvalidArgument;
    // The mapping lives as long as the loader. When the runtime frees a buffer
    // (e.g. a delegate blob after XNNPACK has packed the weights), drop its pages
    // from the process: clean file pages fault back in if touched; anonymous ones are
    // given back (the runtime does not read a buffer it has freed).
    return executorch::runtime::FreeableBuffer(data_ + offset, size, &MmapDataLoader::release_pages);
  }

  executorch::runtime::Error load_into(size_t offset, size_t size, const SegmentInfo& /*segment_info*/,
                                       void* buffer) const override {
    if (buffer == nullptr) return executorch::runtime::Error::InvalidArgument;
    if (!in_bounds(offset, size)) return executorch::runtime::Error::InvalidArgument;
    std::memcpy(buffer, data_ + offset, size);
    return executorch::runtime::Error::Ok;
  }

  executorch::runtime::Result<size_t> size() const override { return size_; }

  const uint8_t* data() const { return data_; }

 private:
  MmapDataLoader(int fd, const uint8_t* data, size_t size, size_t mapped)
      : fd_(fd), data_(data), size_(size), mapped_(mapped) {}

  // The file's bytes in a private anonymous mapping, rounded up to whole 2 MiB pages and
  // advised for huge pages before the first write, so the kernel backs it with them as the
  // read faults it in (without them, 4 KiB pages: the same bytes, the mapping's speed).
  static std::unique_ptr<MmapDataLoader> read_into_huge_pages(int fd, size_t size, const std::string& path,
                                                              std::string* err) {
    constexpr size_t kHugePage = size_t{2} << 20;
    const size_t mapped = (size + kHugePage - 1) / kHugePage * kHugePage;
    // one huge page more than needed, then the ends trimmed: a start on a 2 MiB boundary
    void* raw = ::mmap(nullptr, mapped + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      *err = "cannot allocate " + std::to_string(mapped >> 20) + " MiB for '" + path + "': " + std::strerror(errno) +
             " (llmcore_runner --mmap maps the file instead)";
      return nullptr;
    }
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
    if (aligned > start) ::munmap(raw, aligned - start);
    if (aligned + mapped < start + mapped + kHugePage)
      ::munmap(reinterpret_cast<void*>(aligned + mapped), start + mapped + kHugePage - (aligned + mapped));
    void* addr = reinterpret_cast<void*>(aligned);
    ::madvise(addr, mapped, MADV_HUGEPAGE);  // advice only: refused where the kernel has no THP
    uint8_t* data = static_cast<uint8_t*>(addr);
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::pread(fd, data + done, size - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        *err = "cannot read '" + path + "': " + (n < 0 ? std::strerror(errno) : "the file shrank while read");
        ::munmap(addr, mapped);
        return nullptr;
      }
      done += static_cast<size_t>(n);
    }
    return std::unique_ptr<MmapDataLoader>(new MmapDataLoader(-1, data, size, mapped));
  }

  static void release_pages(void* /*context*/, void* data, size_t size) {
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
    uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) & ~(page - 1);
    // Only whole pages inside the buffer; neighbours sharing an edge page keep it.
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

  bool in_bounds(size_t offset, size_t size) const {
    // A truncated file shows up here: the program asks for bytes past the end.
    return offset <= size_ && size <= size_ - offset;
  }

  int fd_;  // -1 once read into memory
  const uint8_t* data_;
  size_t size_;
  size_t mapped_;  // the mapping's length (huge pages: size_ rounded up to 2 MiB)
};

}  // namespace llmcore
