#include "mmap_data_loader.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace llmcore {

namespace et = executorch::runtime;

namespace {

// ---- LLMCORE_RUNNER_TRAP_RELEASED: a read of a released page ends the run in one line ----

std::atomic<uintptr_t> g_trap_begin{0};
std::atomic<uintptr_t> g_trap_end{0};

// Async-signal-safe: write(2) and hand-formatted digits only.
void write_str(const char* s) {
  ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)ignored;
}

void on_segv(int sig, siginfo_t* info, void* /*ucontext*/) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const uintptr_t begin = g_trap_begin.load(), end = g_trap_end.load();
  if (addr >= begin && addr < end) {
    char digits[32];
    int n = 0;
    uintptr_t offset = addr - begin;
    do {
      digits[n++] = static_cast<char>('0' + offset % 10);
      offset /= 10;
    } while (offset != 0 && n < 31);
    char line[160] = "llmcore_runner: error: the runtime read program bytes it had freed (file offset ";
    size_t len = std::strlen(line);
    while (n > 0) line[len++] = digits[--n];
    line[len] = '\0';
    write_str(line);
    write_str("): a use after free in a kernel or backend (LLMCORE_RUNNER_TRAP_RELEASED)\n");
    ::_exit(3);
  }
  // Not ours: the default action, as if no handler were installed.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void install_trap(const uint8_t* data, size_t mapped) {
  g_trap_begin = reinterpret_cast<uintptr_t>(data);
  g_trap_end = reinterpret_cast<uintptr_t>(data) + mapped;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGSEGV, &sa, nullptr);
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace

std::unique_ptr<MmapDataLoader> MmapDataLoader::open(const std::string& path, std::string* err, Residence residence) {
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
    if (!loader) ::close(fd);
    return loader;
  }
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (addr == MAP_FAILED) {
    *err = "cannot mmap '" + path + "': " + std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<MmapDataLoader>(
      new MmapDataLoader(fd, static_cast<const uint8_t*>(addr), size, size, Residence::file_pages));
}

MmapDataLoader::MmapDataLoader(int fd, const uint8_t* data, size_t size, size_t mapped, Residence residence)
    : fd_(fd),
      data_(data),
      size_(size),
      mapped_(mapped),
      residence_(residence),
      page_(static_cast<size_t>(::sysconf(_SC_PAGESIZE))),
      trap_(env_flag("LLMCORE_RUNNER_TRAP_RELEASED")) {
  const size_t pages = (size_ + page_ - 1) / page_;
  live_.assign(pages, 0);
  released_.assign(pages, false);
  if (trap_) install_trap(data_, mapped_);
}

MmapDataLoader::~MmapDataLoader() {
  if (trap_) g_trap_begin = g_trap_end = 0;
  if (data_) ::munmap(const_cast<uint8_t*>(data_), mapped_);
  if (fd_ >= 0) ::close(fd_);
}

// The file's bytes in a private anonymous mapping, rounded up to whole 2 MiB pages and
// advised for huge pages before the first write, so the kernel backs it with them as the
// read faults it in (without them, 4 KiB pages: the same bytes, the mapping's speed).
std::unique_ptr<MmapDataLoader> MmapDataLoader::read_into_huge_pages(int fd, size_t size, const std::string& path,
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
  return std::unique_ptr<MmapDataLoader>(new MmapDataLoader(fd, data, size, mapped, Residence::huge_pages));
}

et::Result<et::FreeableBuffer> MmapDataLoader::load(size_t offset, size_t size,
                                                    const SegmentInfo& /*segment_info*/) const {
  if (!in_bounds(offset, size)) return et::Error::InvalidArgument;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!restore(offset, size, /*pin=*/true)) return et::Error::AccessFailed;
  return et::FreeableBuffer(data_ + offset, size, &MmapDataLoader::on_free, const_cast<MmapDataLoader*>(this));
}

et::Error MmapDataLoader::load_into(size_t offset, size_t size, const SegmentInfo& /*segment_info*/,
                                    void* buffer) const {
  if (buffer == nullptr) return et::Error::InvalidArgument;
  if (!in_bounds(offset, size)) return et::Error::InvalidArgument;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!restore(offset, size, /*pin=*/false)) return et::Error::AccessFailed;
  std::memcpy(buffer, data_ + offset, size);
  return et::Error::Ok;
}

MmapDataLoader::ReleaseCounts MmapDataLoader::release_counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

void MmapDataLoader::on_free(void* context, void* data, size_t size) {
  auto* self = static_cast<MmapDataLoader*>(context);
  self->release(static_cast<size_t>(static_cast<const uint8_t*>(data) - self->data_), size);
}

bool MmapDataLoader::restore(size_t offset, size_t size, bool pin) const {
  if (size == 0) return true;
  const size_t first = offset / page_, last = (offset + size - 1) / page_;
  for (size_t p = first; p <= last; ++p) {
    if (pin) ++live_[p];
    if (!released_[p]) continue;
    uint8_t* at = const_cast<uint8_t*>(data_) + p * page_;
    if (trap_) ::mprotect(at, page_, residence_ == Residence::huge_pages ? PROT_READ | PROT_WRITE : PROT_READ);
    if (residence_ == Residence::huge_pages) {
      // MADV_DONTNEED left zeros: the file's bytes again (the last page may be short)
      const size_t want = std::min(page_, size_ - p * page_);
      for (size_t done = 0; done < want;) {
        const ssize_t n = ::pread(fd_, at + done, want - done, static_cast<off_t>(p * page_ + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        done += static_cast<size_t>(n);
      }
    }  // a file mapping faults the page back in from the file when it is read
    released_[p] = false;
    counts_.restored_bytes += page_;
  }
  return true;
}

void MmapDataLoader::release(size_t offset, size_t size) const {
  if (size == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t first = offset / page_, last = (offset + size - 1) / page_;
  for (size_t p = first; p <= last; ++p) {
    if (live_[p] > 0) --live_[p];
  }
  // Only whole pages inside the buffer: a neighbour sharing an edge page keeps it.
  const size_t begin = (offset + page_ - 1) / page_, end = (offset + size) / page_;
  for (size_t p = begin; p < end;) {
    if (live_[p] != 0 || released_[p]) {
      ++p;
      continue;
    }
    size_t q = p;  // a run of releasable pages, given back in one call
    while (q < end && live_[q] == 0 && !released_[q]) released_[q++] = true;
    void* at = const_cast<uint8_t*>(data_) + p * page_;
    if (trap_) {
      ::mprotect(at, (q - p) * page_, PROT_NONE);
    } else {
      ::madvise(at, (q - p) * page_, MADV_DONTNEED);
    }
    counts_.released_bytes += (q - p) * page_;
    p = q;
  }
}

}  // namespace llmcore
