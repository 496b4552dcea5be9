#include "pte_module.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include <executorch/devtools/etdump/etdump_flatcc.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/core/memory_allocator.h>
#include <executorch/runtime/core/span.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/method_meta.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>

#include "executorch_threadpool.h"  // runtime/src/compat: the wheel has no threadpool.h
#include "mmap_data_loader.h"

namespace et = executorch::runtime;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;

namespace llmcore {

namespace {

std::string err_str(et::Error e) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), " (0x%x)", static_cast<unsigned>(e));
  return std::string(et::to_string(e)) + buf;
}

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

// IEEE half / bfloat16 -> float.
float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FFu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

bool g_verbose_logs = false;

void log_sink(et_timestamp_t /*timestamp*/, et_pal_log_level_t level, const char* filename,
              const char* /*function*/, size_t line, const char* message, size_t length) {
  if (!g_verbose_logs && (level == kInfo || level == kDebug)) return;
  const char* base = filename ? std::strrchr(filename, '/') : nullptr;
  base = base ? base + 1 : (filename ? filename : "?");
  std::fprintf(stderr, "[executorch %c %s:%zu] %.*s\n", static_cast<char>(level), base, line,
               static_cast<int>(length), message);
}

}  // namespace

void install_executorch_logging(bool verbose) {
  g_verbose_logs = verbose;
  et::register_pal(et::PalImpl::create(log_sink, __FILE__));
}

unsigned set_executorch_threads(unsigned n) {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool == nullptr) return 0;
  if (n != 0) pool->_unsafe_reset_threadpool(n);
  return static_cast<unsigned>(pool->get_thread_count());
}

struct PteModule::ProgramHolder {
  explicit ProgramHolder(et::Program&& p) : program(std::move(p)) {}
  et::Program program;
};

struct PteModule::Tracer {
  executorch::etdump::ETDumpGen etdump;  // grows its buffer on the heap
};

struct PteModule::LoadedMethod {
  std::string name;
  // Method and temp allocations come from the heap (sizes are not known up front).
  executorch::extension::MallocMemoryAllocator method_allocator;
  executorch::extension::MallocMemoryAllocator temp_allocator;
  std::vector<std::unique_ptr<uint8_t, AlignedFree>> planned;
  std::vector<et::Span<uint8_t>> planned_spans;
  std::unique_ptr<et::HierarchicalAllocator> planned_memory;
  std::unique_ptr<et::MemoryManager> memory_manager;
  std::optional<et::Method> method;  // declared last: destroyed first
};

PteModule::PteModule(const std::string& path, bool map_file) : path_(path) {
  std::string err;
  using Residence = MmapDataLoader::Residence;
  loader_ = MmapDataLoader::open(path, &err, map_file ? Residence::file_pages : Residence::huge_pages);
  if (!loader_) throw RuntimeError(err);

  size_t file_size = loader_->size().get();
  switch (et::Program::check_header(loader_->data(), file_size)) {
    case et::Program::HeaderStatus::CompatibleVersion:
      break;
    case et::Program::HeaderStatus::IncompatibleVersion:
      throw RuntimeError("'" + path + "' is an ExecuTorch program of an incompatible version");
    case et::Program::HeaderStatus::ShortData:
      throw RuntimeError("'" + path + "' is too short to be an ExecuTorch program (" +
                         std::to_string(file_size) + " bytes)");
    case et::Program::HeaderStatus::NotPresent:
    default:
      throw RuntimeError("'" + path + "' is not an ExecuTorch program (.pte): no program header found");
  }

  // Full flatbuffer verification: a truncated or corrupted file must fail here
  // with an error, not crash later.
  et::Result<et::Program> program =
      et::Program::load(loader_.get(), et::Program::Verification::InternalConsistency);
  if (!program.ok()) {
    throw RuntimeError("failed to load program '" + path + "': " + err_str(program.error()) +
                       "; the file may be truncated or corrupted");
  }
  program_.reset(new ProgramHolder(std::move(program.get())));
}

uint64_t PteModule::released_bytes() const { return loader_->release_counts().released_bytes; }
uint64_t PteModule::restored_bytes() const { return loader_->release_counts().restored_bytes; }

PteModule::~PteModule() {
  forward_.reset();
  program_.reset();
  loader_.reset();
}

std::vector<std::string> PteModule::method_names() const {
  std::vector<std::string> names;
  size_t n = program_->program.num_methods();
  for (size_t i = 0; i < n; ++i) {
    auto name = program_->program.get_method_name(i);
    if (name.ok()) names.emplace_back(*name);
  }
  return names;
}

bool PteModule::has_method(const std::string& name) const {
  for (const auto& n : method_names()) {
    if (n == name) return true;
  }
  return false;
}

std::unique_ptr<PteModule::LoadedMethod> PteModule::load_method(const std::string& name, bool traced) const {
  const et::Program& program = program_->program;
  et::Result<et::MethodMeta> meta = program.method_meta(name.c_str());
  if (!meta.ok()) throw RuntimeError("method '" + name + "' not found in program: " + err_str(meta.error()));

  std::unique_ptr<LoadedMethod> lm(new LoadedMethod());
  lm->name = name;
  size_t nbuf = meta->num_memory_planned_buffers();
  for (size_t i = 0; i < nbuf; ++i) {
    et::Result<int64_t> sz = meta->memory_planned_buffer_size(i);
    if (!sz.ok() || *sz < 0) throw RuntimeError("method '" + name + "': bad planned buffer size");
    size_t bytes = static_cast<size_t>(*sz);
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes == 0 ? 64 : bytes) != 0) {
      throw RuntimeError("method '" + name + "': out of memory allocating " + std::to_string(bytes) + " bytes");
    }
    lm->planned.emplace_back(static_cast<uint8_t*>(p));
    lm->planned_spans.emplace_back(static_cast<uint8_t*>(p), bytes);
  }
  lm->planned_memory.reset(new et::HierarchicalAllocator(
      et::Span<et::Span<uint8_t>>(lm->planned_spans.data(), lm->planned_spans.size())));
  lm->memory_manager.reset(
      new et::MemoryManager(&lm->method_allocator, lm->planned_memory.get(), &lm->temp_allocator));

  et::EventTracer* tracer = traced && tracer_ ? &tracer_->etdump : nullptr;
  et::Result<et::Method> method = program.load_method(name.c_str(), lm->memory_manager.get(), tracer);
  if (!method.ok()) {
    std::string hint;
    if (method.error() == et::Error::OperatorMissing) {
      hint = " (an operator the program uses has no kernel linked in; see the log above)";
    }
    throw RuntimeError("failed to load method '" + name + "': " + err_str(method.error()) + hint);
  }
  lm->method.emplace(std::move(method.get()));
  return lm;
}

std::vector<int64_t> PteModule::run_constant_method(const std::string& name) {
  std::unique_ptr<LoadedMethod> lm = load_method(name);
  et::Method& m = *lm->method;
  if (m.inputs_size() != 0) throw RuntimeError("method '" + name + "' takes inputs; expected a constant method");
  et::Error e = m.execute();
  if (e != et::Error::Ok) throw RuntimeError("method '" + name + "' failed: " + err_str(e));
  std::vector<int64_t> out;
  for (size_t i = 0; i < m.outputs_size(); ++i) {
    const et::EValue& v = m.get_output(i);
    if (v.isInt()) {
      out.push_back(v.toInt());
    } else if (v.isBool()) {
      out.push_back(v.toBool() ? 1 : 0);
    } else if (v.isDouble()) {
      out.push_back(static_cast<int64_t>(v.toDouble()));
    } else if (v.isTensor()) {
      const Tensor& t = v.toTensor();
      for (ssize_t k = 0; k < t.numel(); ++k) {
        switch (t.scalar_type()) {
          case ScalarType::Long: out.push_back(t.const_data_ptr<int64_t>()[k]); break;
          case ScalarType::Int: out.push_back(t.const_data_ptr<int32_t>()[k]); break;
          case ScalarType::Bool: out.push_back(t.const_data_ptr<bool>()[k] ? 1 : 0); break;
          default: throw RuntimeError("method '" + name + "' returns a non-integer tensor");
        }
      }
    } else if (v.isNone()) {
      continue;
    } else {
      throw RuntimeError("method '" + name + "' returns an unsupported value type");
    }
  }
  return out;
}

std::vector<std::string> PteModule::run_string_method(const std::string& name) {
  std::unique_ptr<LoadedMethod> lm = load_method(name);
  et::Method& m = *lm->method;
  if (m.inputs_size() != 0) throw RuntimeError("method '" + name + "' takes inputs; expected a constant method");
  et::Error e = m.execute();
  if (e != et::Error::Ok) throw RuntimeError("method '" + name + "' failed: " + err_str(e));
  std::vector<std::string> out;
  for (size_t i = 0; i < m.outputs_size(); ++i) {
    const et::EValue& v = m.get_output(i);
    if (!v.isString()) throw RuntimeError("method '" + name + "' returns a value that is not a string");
    out.emplace_back(v.toString());
  }
  return out;
}

void PteModule::load_forward() {
  if (!forward_) forward_ = load_method("forward", /*traced=*/true);
}

void PteModule::enable_etdump() {
  if (forward_) throw RuntimeError("enable_etdump() must come before forward is loaded");
  if (!tracer_) tracer_.reset(new Tracer());
}

bool PteModule::write_etdump(const std::string& path, std::string* err) {
  if (!tracer_) {
    *err = "no ETDump was recorded";
    return false;
  }
  executorch::etdump::ETDumpResult result = tracer_->etdump.get_etdump_data();
  if (result.buf == nullptr || result.size == 0) {
    *err = "the event tracer recorded nothing";
    return false;
  }
  const std::string partial = path + ".partial";
  bool ok = false;
  if (FILE* f = std::fopen(partial.c_str(), "wb")) {
    ok = std::fwrite(result.buf, 1, result.size, f) == result.size;
    ok = (std::fclose(f) == 0) && ok;
  }
  std::free(result.buf);  // the caller owns the finished buffer
  if (!ok || std::rename(partial.c_str(), path.c_str()) != 0) {
    *err = "cannot write '" + path + "': " + std::strerror(errno);
    std::remove(partial.c_str());
    return false;
  }
  return true;
}

size_t PteModule::forward_num_inputs() const { return forward_ ? forward_->method->inputs_size() : 0; }

int64_t PteModule::forward_max_tokens() const {
  if (!forward_) return 0;
  et::MethodMeta meta = forward_->method->method_meta();
  et::Result<et::TensorInfo> info = meta.input_tensor_meta(0);
  if (!info.ok() || info->sizes().size() < 2) return 0;
  return info->sizes()[1];
}

size_t PteModule::forward_backends() const {
  return forward_ ? forward_->method->method_meta().num_backends() : 0;
}

void PteModule::forward(const int64_t* tokens, int64_t n, const int64_t* pos, std::vector<float>* logits) {
  load_forward();
  et::Method& m = *forward_->method;
  size_t want_inputs = pos ? 2 : 1;
  if (m.inputs_size() != want_inputs) {
    throw RuntimeError("forward takes " + std::to_string(m.inputs_size()) + " inputs, runner passed " +
                       std::to_string(want_inputs));
  }

  TensorImpl::SizesType tok_sizes[2] = {1, static_cast<TensorImpl::SizesType>(n)};
  TensorImpl::DimOrderType tok_order[2] = {0, 1};
  TensorImpl::StridesType tok_strides[2] = {static_cast<TensorImpl::StridesType>(n), 1};
  TensorImpl tok_impl(ScalarType::Long, 2, tok_sizes, const_cast<int64_t*>(tokens), tok_order, tok_strides);
  et::Error e = m.set_input(et::EValue(Tensor(&tok_impl)), 0);
  if (e != et::Error::Ok) {
    throw RuntimeError("forward: setting tokens input of shape [1, " + std::to_string(n) + "] failed: " + err_str(e));
  }

  int64_t pos_value = pos ? *pos : 0;
  TensorImpl::SizesType pos_sizes[1] = {1};
  TensorImpl::DimOrderType pos_order[1] = {0};
  TensorImpl::StridesType pos_strides[1] = {1};
  TensorImpl pos_impl(ScalarType::Long, 1, pos_sizes, &pos_value, pos_order, pos_strides);
  if (pos) {
    e = m.set_input(et::EValue(Tensor(&pos_impl)), 1);
    if (e != et::Error::Ok) throw RuntimeError("forward: setting input_pos failed: " + err_str(e));
  }

  e = m.execute();
  if (e != et::Error::Ok) throw RuntimeError("forward failed: " + err_str(e));

  if (m.outputs_size() < 1) throw RuntimeError("forward returned no outputs");
  const et::EValue& out = m.get_output(0);
  if (!out.isTensor()) throw RuntimeError("forward output 0 is not a tensor");
  const Tensor& t = out.toTensor();
  if (t.dim() < 1 || t.numel() == 0) throw RuntimeError("forward returned an empty logits tensor");
  // [1, V], [1, T, V] (last row), or [V].
  ssize_t vocab = t.size(t.dim() - 1);
  ssize_t offset = t.numel() - vocab;
  logits->resize(static_cast<size_t>(vocab));
  switch (t.scalar_type()) {
    case ScalarType::Float:
      std::memcpy(logits->data(), t.const_data_ptr<float>() + offset, sizeof(float) * vocab);
      break;
    case ScalarType::Half: {
      const uint16_t* p = static_cast<const uint16_t*>(t.const_data_ptr()) + offset;
      for (ssize_t i = 0; i < vocab; ++i) (*logits)[i] = half_to_float(p[i]);
      break;
    }
    case ScalarType::BFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.const_data_ptr()) + offset;
      for (ssize_t i = 0; i < vocab; ++i) (*logits)[i] = bf16_to_float(p[i]);
      break;
    }
    default:
      throw RuntimeError("forward logits have unsupported dtype (code " +
                         std::to_string(static_cast<int>(t.scalar_type())) + "); expected float32");
  }
}

}  // namespace llmcore
