// Thin wrapper over the ExecuTorch runtime API shipped in the wheel (Program,
// Method, MemoryManager, HierarchicalAllocator): loads a .pte through our mmap
// loader, runs constant methods and `forward`, optionally under an ETDump event
// tracer.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace llmcore {

class MmapDataLoader;

// Thrown for any runtime failure; the message is meant for the user.
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class PteModule {
 public:
  // Throws RuntimeError when the file is missing, truncated or not a program. `map_file`:
  // the program's file pages mapped, not read into huge pages (mmap_data_loader.h).
  explicit PteModule(const std::string& path, bool map_file = false);
  ~PteModule();

  const std::string& path() const { return path_; }
  bool has_method(const std::string& name) const;
  std::vector<std::string> method_names() const;

  // Runs a method that takes no inputs and returns its outputs as integers
  // (Int/Bool scalars, Double truncated, integer/bool tensors flattened).
  std::vector<int64_t> run_constant_method(const std::string& name);

  // Runs a method that takes no inputs and returns strings (e.g. get_runtime_libraries).
  std::vector<std::string> run_string_method(const std::string& name);

  // Records an ETDump of `forward` (profiling events of every execute); call before
  // load_forward(). write_etdump() writes it to `path` atomically (path.partial, then
  // rename) and returns false, with *err set, when there is nothing to write or the
  // write fails.
  void enable_etdump();
  bool write_etdump(const std::string& path, std::string* err);

  // Loads `forward` (allocates its planned memory). Idempotent.
  void load_forward();
  size_t forward_num_inputs() const;
  // Largest token count the tokens input accepts (its declared upper bound).
  int64_t forward_max_tokens() const;
  // How many backends forward's delegates use (0: no delegate).
  size_t forward_backends() const;

  // Bytes of the program the loader gave back after the runtime freed them, and bytes it
  // read back because the runtime loaded them again (mmap_data_loader.h).
  uint64_t released_bytes() const;
  uint64_t restored_bytes() const;

  // Runs forward on tokens[0..n) (and input_pos = {*pos} when pos != nullptr);
  // writes the logits of the last position to *logits.
  void forward(const int64_t* tokens, int64_t n, const int64_t* pos, std::vector<float>* logits);

 private:
  struct LoadedMethod;
  std::unique_ptr<LoadedMethod> load_method(const std::string& name, bool traced = false) const;

  std::string path_;
  std::unique_ptr<MmapDataLoader> loader_;
  struct ProgramHolder;
  std::unique_ptr<ProgramHolder> program_;
  struct Tracer;
  std::unique_ptr<Tracer> tracer_;  // outlives forward_
  std::unique_ptr<LoadedMethod> forward_;
};

// Routes ExecuTorch's log messages through our filter (Info and below only with verbose).
void install_executorch_logging(bool verbose);

// Sets the ExecuTorch CPU thread pool size (0 = leave the default); returns the pool's
// thread count after it (0 when the runtime has no pool).
unsigned set_executorch_threads(unsigned n);

}  // namespace llmcore
