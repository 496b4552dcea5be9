// Thin wrapper over the ExecuTorch runtime API shipped in the wheel (Program,
// Method, MemoryManager, HierarchicalAllocator): loads a .pte through our mmap
// loader, runs constant methods and `forward`.
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
  // Throws RuntimeError when the file is missing, truncated or not a program.
  explicit PteModule(const std::string& path);
  ~PteModule();

  const std::string& path() const { return path_; }
  bool has_method(const std::string& name) const;
  std::vector<std::string> method_names() const;

  // Runs a method that takes no inputs and returns its outputs as integers
  // (Int/Bool scalars, Double truncated, integer/bool tensors flattened).
  std::vector<int64_t> run_constant_method(const std::string& name);

  // Runs a method that takes no inputs and returns strings (e.g. get_runtime_libraries).
  std::vector<std::string> run_string_method(const std::string& name);

  // Loads `forward` (allocates its planned memory). Idempotent.
  void load_forward();
  size_t forward_num_inputs() const;
  // Largest token count the tokens input accepts (its declared upper bound).
  int64_t forward_max_tokens() const;

  // Runs forward on tokens[0..n) (and input_pos = {*pos} when pos != nullptr);
  // writes the logits of the last position to *logits.
  void forward(const int64_t* tokens, int64_t n, const int64_t* pos, std::vector<float>* logits);

 private:
  struct LoadedMethod;
  std::unique_ptr<LoadedMethod> load_method(const std::string& name) const;

  std::string path_;
  std::unique_ptr<MmapDataLoader> loader_;
  struct ProgramHolder;
  std::unique_ptr<ProgramHolder> program_;
  std::unique_ptr<LoadedMethod> forward_;
};

// Routes ExecuTorch's log messages through our filter (Info and below only with verbose).
void install_executorch_logging(bool verbose);

// Sets the ExecuTorch CPU thread pool size (0 = leave the default).
void set_executorch_threads(unsigned n);

// The wheel's KV-cache attention kernel (llama::custom_sdpa) does its matrix
// products with MKL from libtorch, which opens OpenMP teams from inside
// ExecuTorch's thread pool: nested, oversubscribed parallelism that made decode
// up to 10x slower in our measurements. Unless OMP_NUM_THREADS is set, limit
// OpenMP to one thread on every thread-pool thread (and the caller). Call after
// set_executorch_threads(). Returns the number of threads configured.
size_t limit_openmp_threads();

}  // namespace llmcore
