// A read-only mmap-backed ExecuTorch DataLoader (the wheel ships the DataLoader
// interface but not the extension loaders, so the runner brings its own).
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
  // Maps the whole file read-only. Returns nullptr and fills *err on failure.
  static std::unique_ptr<MmapDataLoader> open(const std::string& path, std::string* err) {
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
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      *err = "cannot mmap '" + path + "': " + std::strerror(errno);
      ::close(fd);
      return nullptr;
    }
    return std::unique_ptr<MmapDataLoader>(new MmapDataLoader(fd, static_cast<const uint8_t*>(addr), size));
  }

  ~MmapDataLoader() override {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }

  MmapDataLoader(const MmapDataLoader&) = delete;
  MmapDataLoader& operator=(const MmapDataLoader&) = delete;

  executorch::runtime::Result<executorch::runtime::FreeableBuffer> load(
      size_t offset, size_t size, const SegmentInfo& /*segment_info*/) const override {
    if (!in_bounds(offset, size)) return executorch::runtime::Error::InvalidArgument;
    // The mapping lives as long as the loader. When the runtime frees a buffer
    // (e.g. a delegate blob after XNNPACK has packed the weights), drop its pages
    // from the process: they are clean file pages and fault back in if touched.
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
  MmapDataLoader(int fd, const uint8_t* data, size_t size) : fd_(fd), data_(data), size_(size) {}

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

  int fd_;
  const uint8_t* data_;
  size_t size_;
};

}  // namespace llmcore
