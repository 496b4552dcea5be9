// llmcore_runner: run an llmcore `.pte` (see docs/pte-contract.md) on a prompt.
//
//   llmcore_runner PTE (--prompt TEXT | --prompt-file PATH) [--tokenizer PATH] [--max-new-tokens N]
//                  [--temperature T] [--top-k K] [--top-p P] [--seed S]
//                  [--print-ids] [--threads N] [--load-library PATH]... [--etdump FILE]
//                  [--mmap] [--verbose]
//
// stdout: the generated text, streamed token by token, then a newline; with
//         --print-ids one more line "ids: <generated token ids>".
// stderr: one "stats:" line (time to first token, prefill and decode speed,
//         peak RSS), plus warnings/errors.
// Exit status: 0 ok, 1 runtime error (bad file, failed method...), 2 usage error.
//
// Custom-operator libraries (docs/custom-kernels.md): a program that calls kernels
// of a plugin names them in its `get_runtime_libraries` constant method. Before
// loading `forward`, the runner loads every --load-library PATH and every file in
// LLMCORE_RUNTIME_LIBRARIES (':'-separated), then looks for lib<name>.so of each
// declared library in the folders of LLMCORE_RUNTIME_LIBRARIES and next to itself.
// KV-cache programs' llama::update_cache / llama::custom_sdpa kernels are linked in
// (runtime/kernels/llm_ops.cpp).
//
// --etdump FILE records every `forward` call with ExecuTorch's ETDump event tracer
// (operator and delegate timings) and writes it to FILE at the end, for
// `llmcore profile PTE --from-etdump FILE` or executorch.devtools.Inspector.
#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <executorch/runtime/platform/runtime.h>

#include "pte_module.h"
#include "sampler.h"
#include "tokenizer.h"
#include "xnnpack_reshape.h"
#include "kernel_threads.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string pte;
  std::string prompt;
  bool has_prompt = false;
  std::string tokenizer;
  long max_new_tokens = 128;
  llmcore::SamplerConfig sampler;
  bool has_seed = false;
  bool print_ids = false;
  unsigned threads = 0;
  bool verbose = false;
  std::vector<std::string> libraries;  // --load-library
  std::string etdump;                  // --etdump FILE ("" = off)
  bool map_file = false;               // --mmap
};

const char* kUsage =
    "usage: llmcore_runner PTE --prompt TEXT [options]\n"
    "\n"
    "Runs an llmcore .pte program (docs/pte-contract.md): tokenizes the prompt,\n"
    "prefills, decodes and streams the generated text to stdout.\n"
    "\n"
    "options:\n"
    "  --prompt TEXT          prompt text (this or --prompt-file is required)\n"
    "  --prompt-file PATH     read the prompt from a file, byte for byte\n"
    "  --tokenizer PATH       tokenizer.json (default: tokenizer.json next to PTE)\n"
    "  --max-new-tokens N     most tokens to generate (default 128)\n"
    "  --temperature T        0 = greedy argmax (default 0)\n"
    "  --top-k K              keep the K most likely tokens (0 = off)\n"
    "  --top-p P              nucleus sampling mass in (0, 1] (1 = off)\n"
    "  --seed S               sampling seed (default: random)\n"
    "  --print-ids            after the text print 'ids: <generated ids>'\n"
    "  --threads N            ExecuTorch CPU threads (default: 1 for a program under\n"
    "                         16 MiB, else one per core)\n"
    "  --load-library PATH    load a custom-operator kernel library first (repeatable;\n"
    "                         also LLMCORE_RUNTIME_LIBRARIES=path:folder:...)\n"
    "  --etdump FILE          record an ETDump of the forward calls (operator and\n"
    "                         delegate times) and write it to FILE at the end\n"
    "  --mmap                 map the program's file instead of reading it into huge\n"
    "                         pages: a smaller resident set, a slower decode\n"
    "  --verbose              print program metadata and ExecuTorch info logs\n"
    "  -h, --help             this help\n";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "llmcore_runner: error: %s\n\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

long parse_long(const std::string& flag, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0) usage_error(flag + " expects an integer, got '" + v + "'");
  if (x < lo || x > hi) usage_error(flag + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

double parse_double(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0 || !(x == x)) usage_error(flag + " expects a number, got '" + v + "'");
  return x;
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0) {
      size_t eq = a.find('=');
      if (eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
        has_inline = true;
      }
    }
    auto next = [&]() -> std::string {
      if (has_inline) return value;
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--prompt") {
      if (o.has_prompt) usage_error("give the prompt once: --prompt or --prompt-file");
      o.prompt = next();
      o.has_prompt = true;
    } else if (a == "--prompt-file") {
      // The prompt byte for byte, trailing newline included: a chat template's prompt ends
      // in one, and a shell's $(...) would strip it.
      if (o.has_prompt) usage_error("give the prompt once: --prompt or --prompt-file");
      std::string path = next();
      std::FILE* f = std::fopen(path.c_str(), "rb");
      if (f == nullptr) usage_error("--prompt-file: cannot open '" + path + "': " + std::strerror(errno));
      char buf[65536];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) o.prompt.append(buf, n);
      bool failed = std::ferror(f) != 0;
      std::fclose(f);
      if (failed) usage_error("--prompt-file: cannot read '" + path + "'");
      o.has_prompt = true;
    } else if (a == "--tokenizer") {
      o.tokenizer = next();
    } else if (a == "--max-new-tokens") {
      o.max_new_tokens = parse_long(a, next(), 0, 100000000);
    } else if (a == "--temperature") {
      double t = parse_double(a, next());
      if (t < 0) usage_error("--temperature must be >= 0");
      o.sampler.temperature = static_cast<float>(t);
    } else if (a == "--top-k") {
      o.sampler.top_k = static_cast<int>(parse_long(a, next(), 0, 1L << 30));
    } else if (a == "--top-p") {
      double p = parse_double(a, next());
      if (!(p > 0.0 && p <= 1.0)) usage_error("--top-p must be in (0, 1]");
      o.sampler.top_p = static_cast<float>(p);
    } else if (a == "--seed") {
      std::string v = next();
      char* end = nullptr;
      errno = 0;
      unsigned long long s = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || errno != 0 || v[0] == '-') usage_error("--seed expects a non-negative integer");
      o.sampler.seed = s;
      o.has_seed = true;
    } else if (a == "--print-ids") {
      o.print_ids = true;
    } else if (a == "--threads") {
      o.threads = static_cast<unsigned>(parse_long(a, next(), 0, 1024));
    } else if (a == "--load-library") {
      o.libraries.push_back(next());
    } else if (a == "--mmap") {
      o.map_file = true;
    } else if (a == "--etdump") {
      o.etdump = next();
      if (o.etdump.empty()) usage_error("--etdump needs a file name");
    } else if (a == "--verbose" || a == "-v") {
      o.verbose = true;
    } else if (a.size() > 1 && a[0] == '-') {
      usage_error("unknown option '" + a + "'");
    } else {
      positional.push_back(a);
    }
  }
  if (positional.empty()) usage_error("missing PTE path");
  if (positional.size() > 1) usage_error("unexpected argument '" + positional[1] + "'");
  if (!o.has_prompt) usage_error("missing --prompt (or --prompt-file)");
  o.pte = positional[0];
  if (o.tokenizer.empty()) {
    size_t slash = o.pte.find_last_of('/');
    o.tokenizer = (slash == std::string::npos ? std::string() : o.pte.substr(0, slash + 1)) + "tokenizer.json";
  }
  if (!o.has_seed) o.sampler.seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  return o;
}

double ms_since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

double peak_rss_mib() {
  // VmHWM belongs to this process image; getrusage's ru_maxrss can carry the
  // parent's high-water mark over fork+exec, so it is only the fallback.
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long kib = -1;
    while (std::fgets(line, sizeof(line), f)) {
      if (std::strncmp(line, "VmHWM:", 6) == 0) {
        kib = std::strtol(line + 6, nullptr, 10);
        break;
      }
    }
    std::fclose(f);
    if (kib >= 0) return static_cast<double>(kib) / 1024.0;
  }
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // KiB on Linux
}

// Program metadata from the constant methods (docs/pte-contract.md), with
// defaults for methods a program does not carry.
struct Meta {
  int64_t max_seq_len = 0;      // 0 = unknown
  int64_t max_context_len = 0;  // 0 = unknown
  int64_t vocab_size = 0;       // 0 = unknown
  int64_t bos_id = -1;
  int64_t n_bos = 0;
  std::vector<int64_t> eos_ids;
  bool use_kv_cache = false;
  bool enable_dynamic_shape = true;
};

Meta read_meta(llmcore::PteModule& m) {
  Meta meta;
  auto get_one = [&](const char* name, int64_t dflt) -> int64_t {
    if (!m.has_method(name)) return dflt;
    std::vector<int64_t> v = m.run_constant_method(name);
    return v.empty() ? dflt : v[0];
  };
  meta.max_seq_len = get_one("get_max_seq_len", 0);
  meta.max_context_len = get_one("get_max_context_len", 0);
  meta.vocab_size = get_one("get_vocab_size", 0);
  meta.bos_id = get_one("get_bos_id", -1);
  meta.n_bos = get_one("get_n_bos", 0);
  meta.use_kv_cache = get_one("use_kv_cache", 0) != 0;
  meta.enable_dynamic_shape = get_one("enable_dynamic_shape", 1) != 0;
  if (m.has_method("get_eos_ids")) meta.eos_ids = m.run_constant_method("get_eos_ids");
  return meta;
}

// Streams generated text to stdout. Decoding is not per-token (byte-level
// tokens can split a UTF-8 character, SentencePiece decoders strip the first
// space, byte-fallback runs combine), so each step decodes a short window of
// recent ids twice and prints what the new id added; text ending in U+FFFD
// (an incomplete character) is held back until the next id completes it.
class TextStreamer {
 public:
  explicit TextStreamer(const llmcore::Tokenizer& tok) : tok_(tok) {}

  void push(int32_t id) {
    ids_.push_back(id);
    std::string prefix = decode(prefix_offset_, read_offset_);
    std::string full = decode(prefix_offset_, ids_.size());
    if (full.size() > prefix.size() && full.compare(0, prefix.size(), prefix) == 0 && !ends_incomplete(full)) {
      emit(full.substr(prefix.size()));
      prefix_offset_ = read_offset_;
      read_offset_ = ids_.size();
    }
  }

  void finish() {
    std::string prefix = decode(prefix_offset_, read_offset_);
    std::string full = decode(prefix_offset_, ids_.size());
    if (full.size() > prefix.size() && full.compare(0, prefix.size(), prefix) == 0) emit(full.substr(prefix.size()));
    prefix_offset_ = read_offset_ = ids_.size();
  }

 private:
  std::string decode(size_t begin, size_t end) const {
    return tok_.decode(ids_.data() + begin, end - begin, /*skip_special=*/true);
  }
  static bool ends_incomplete(const std::string& s) {
    return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
  }
  static void emit(const std::string& s) {
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  }

  const llmcore::Tokenizer& tok_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0, read_offset_ = 0;
};

// ---- custom-operator libraries ----

bool is_dir(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string base_name(const std::string& p) {
  size_t slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string self_dir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  std::string p(buf);
  size_t slash = p.find_last_of('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

// Loads kernel libraries; their kernels register themselves with the runtime on load.
class KernelLibraries {
 public:
  KernelLibraries(const Options& opt) {
    std::vector<std::string> files = opt.libraries;
    if (const char* env = std::getenv("LLMCORE_RUNTIME_LIBRARIES")) {
      std::string list(env);
      size_t start = 0;
      while (start <= list.size()) {
        size_t end = list.find(':', start);
        if (end == std::string::npos) end = list.size();
        std::string entry = list.substr(start, end - start);
        if (!entry.empty()) (is_dir(entry) ? dirs_ : files).push_back(entry);
        start = end + 1;
      }
    }
    dirs_.push_back(self_dir());
    for (const std::string& f : files) load(f, opt.verbose);
  }

  // Loads lib<name>.so for each library the program declares and none loaded yet provides.
  void load_declared(const std::vector<std::string>& names, bool verbose) {
    for (const std::string& name : names) {
      const std::string file = "lib" + name + ".so";
      if (std::find(loaded_.begin(), loaded_.end(), file) != loaded_.end()) continue;
      bool found = false;
      for (const std::string& d : dirs_) {
        if (is_file(d + "/" + file)) {
          load(d + "/" + file, verbose);
          found = true;
          break;
        }
      }
      if (!found) {
        missing_ += (missing_.empty() ? "" : ", ") + name;
        std::fprintf(stderr, "llmcore_runner: warning: the program needs runtime library '%s' (%s), not found next to the "
                     "runner or in LLMCORE_RUNTIME_LIBRARIES; pass --load-library PATH\n", name.c_str(), file.c_str());
      }
    }
  }

  // For errors: the declared libraries that were not found ("" if none).
  const std::string& missing() const { return missing_; }

 private:
  void load(const std::string& path, bool verbose) {
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* why = dlerror();
      throw llmcore::RuntimeError("cannot load kernel library '" + path + "': " + (why ? why : "unknown error"));
    }
    loaded_.push_back(base_name(path));
    if (verbose) std::fprintf(stderr, "llmcore_runner: loaded kernel library %s\n", path.c_str());
  }

  std::vector<std::string> dirs_;
  std::vector<std::string> loaded_;
  std::string missing_;
};

// The thread count when --threads is not given: one for a program under 16 MiB, whose
// operators are too small for a second thread to pay for waking it; 0 (the runtime's
// choice, one per core) otherwise. The same rule as llmcore's Python commands
// (llmcore/runtime/program.py, default_threads), where the measurements behind it are cited.
unsigned default_threads(const std::string& pte) {
  struct stat st {};
  if (stat(pte.c_str(), &st) != 0) return 0;  // loading it reports the error
  return st.st_size < (16L << 20) ? 1u : 0u;
}

int run(const Options& opt) {
  executorch::runtime::runtime_init();
  llmcore::install_executorch_logging(opt.verbose);
  unsigned threads = llmcore::set_executorch_threads(opt.threads != 0 ? opt.threads : default_threads(opt.pte));
  if (opt.verbose) std::fprintf(stderr, "llmcore_runner: %u runtime threads\n", threads);

  if (!opt.etdump.empty()) {
    size_t slash = opt.etdump.find_last_of('/');
    std::string folder = slash == std::string::npos ? "." : (slash == 0 ? "/" : opt.etdump.substr(0, slash));
    if (!is_dir(folder)) throw llmcore::RuntimeError("--etdump: the folder '" + folder + "' does not exist");
  }
  auto t_load0 = Clock::now();
  KernelLibraries kernels(opt);
  llmcore::PteModule module(opt.pte, opt.map_file);
  if (!module.has_method("forward")) throw llmcore::RuntimeError("program '" + opt.pte + "' has no 'forward' method");
  if (module.has_method("get_runtime_libraries")) {
    kernels.load_declared(module.run_string_method("get_runtime_libraries"), opt.verbose);
  }
  Meta meta = read_meta(module);
  if (!opt.etdump.empty()) module.enable_etdump();
  try {
    module.load_forward();
  } catch (const llmcore::RuntimeError& e) {
    if (kernels.missing().empty()) throw;
    throw llmcore::RuntimeError(std::string(e.what()) + "; the program needs runtime libraries that were not found: " +
                                kernels.missing() + " (pass --load-library PATH)");
  }
  // llmcore's kernels on their own threads in a program with no delegate, on ExecuTorch's
  // pool beside delegates, until a whole-layer operator of llmcore's runs
  // (runtime/kernels/kernel_threads.h says why).
  const bool own_threads = module.forward_backends() == 0;
  llmcore_kernels::kernel_threads_use_own(own_threads);
  if (opt.verbose)
    std::fprintf(stderr, "llmcore_runner: llmcore's kernels on %s\n",
                 own_threads ? "their own threads (no delegate)"
                             : "ExecuTorch's thread pool (the program has delegates), their own threads once a "
                               "whole-layer operator runs");
  std::unique_ptr<llmcore::Tokenizer> tok = llmcore::Tokenizer::load(opt.tokenizer);
  auto t_load1 = Clock::now();

  // Calling convention: the method's input count is authoritative.
  size_t n_inputs = module.forward_num_inputs();
  bool kv = meta.use_kv_cache;
  if (n_inputs == 2 && !kv) {
    std::fprintf(stderr, "llmcore_runner: warning: forward takes (tokens, input_pos) but use_kv_cache is false; using the KV-cache convention\n");
    kv = true;
  } else if (n_inputs == 1 && kv) {
    std::fprintf(stderr, "llmcore_runner: warning: use_kv_cache is true but forward takes one input; using the no-cache convention\n");
    kv = false;
  } else if (n_inputs != 1 && n_inputs != 2) {
    throw llmcore::RuntimeError("forward takes " + std::to_string(n_inputs) + " inputs; expected 1 (tokens) or 2 (tokens, input_pos)");
  }
  // Tokens per call: the program's declared bound, capped by get_max_seq_len.
  int64_t chunk = module.forward_max_tokens();
  if (meta.max_seq_len > 0) chunk = chunk > 0 ? std::min(chunk, meta.max_seq_len) : meta.max_seq_len;
  if (chunk <= 0) chunk = 1;
  int64_t max_ctx = meta.max_context_len > 0 ? meta.max_context_len : (kv ? chunk : 0);  // 0 = unbounded

  if (opt.verbose) {
    std::string eos;
    for (int64_t e : meta.eos_ids) eos += (eos.empty() ? "" : ",") + std::to_string(e);
    std::fprintf(stderr,
                 "llmcore_runner: program %s: kv_cache=%d max_seq_len=%lld max_context_len=%lld vocab=%lld "
                 "bos_id=%lld n_bos=%lld eos=[%s] dynamic_shape=%d tokens_per_call=%lld\n",
                 opt.pte.c_str(), kv ? 1 : 0, (long long)meta.max_seq_len, (long long)meta.max_context_len,
                 (long long)meta.vocab_size, (long long)meta.bos_id, (long long)meta.n_bos, eos.c_str(),
                 meta.enable_dynamic_shape ? 1 : 0, (long long)chunk);
    std::fprintf(stderr, "llmcore_runner: tokenizer %s: %s\n", opt.tokenizer.c_str(), tok->describe().c_str());
    std::fprintf(stderr, "llmcore_runner: seed %llu\n", (unsigned long long)opt.sampler.seed);
  }

  // ---- tokenize ----
  auto t_start = Clock::now();
  std::vector<int64_t> tokens;
  if (meta.bos_id >= 0) {
    for (int64_t i = 0; i < meta.n_bos; ++i) tokens.push_back(meta.bos_id);
  }
  for (int32_t id : tok->encode(opt.prompt)) tokens.push_back(id);
  const size_t n_prompt = tokens.size();
  if (opt.verbose) {
    std::string line = "llmcore_runner: prompt ids:";
    for (int64_t t : tokens) line += " " + std::to_string(t);
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  if (n_prompt == 0) throw llmcore::RuntimeError("the prompt encodes to no tokens (and the program asks for no BOS)");
  if (meta.vocab_size > 0) {
    for (int64_t t : tokens) {
      if (t < 0 || t >= meta.vocab_size) {
        throw llmcore::RuntimeError("prompt token id " + std::to_string(t) + " is outside the program's vocabulary (" +
                                    std::to_string(meta.vocab_size) + "); wrong tokenizer.json?");
      }
    }
  }
  if (max_ctx > 0 && static_cast<int64_t>(n_prompt) >= max_ctx) {
    throw llmcore::RuntimeError("the prompt has " + std::to_string(n_prompt) + " tokens but the program's context holds " +
                                std::to_string(max_ctx) + " (get_max_context_len); shorten the prompt");
  }
  llmcore::Sampler sampler(opt.sampler);
  TextStreamer streamer(*tok);
  std::vector<int32_t> generated;
  std::vector<float> logits;
  std::string stop_reason = "max_new_tokens";

  auto is_eos = [&](int32_t id) {
    return std::find(meta.eos_ids.begin(), meta.eos_ids.end(), static_cast<int64_t>(id)) != meta.eos_ids.end();
  };
  // Feeds the model what it needs to produce the next-token logits.
  auto step_nocache = [&]() {
    int64_t n = static_cast<int64_t>(tokens.size());
    int64_t w = std::min<int64_t>(n, chunk);
    module.forward(tokens.data() + (n - w), w, nullptr, &logits);
  };

  double prefill_ms = 0.0, decode_ms = 0.0, ttft_ms = 0.0;
  size_t decode_steps = 0;

  if (opt.max_new_tokens > 0) {
    // ---- prefill ----
    auto t_p0 = Clock::now();
    if (kv) {
      // Prompt in chunks of at most `chunk` tokens (a static [1, 1] program gets
      // one token per call).
      for (int64_t start = 0; start < static_cast<int64_t>(n_prompt); start += chunk) {
        int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(n_prompt) - start);
        module.forward(tokens.data() + start, n, &start, &logits);
      }
    } else {
      step_nocache();
    }
    auto t_p1 = Clock::now();
    prefill_ms = ms_since(t_p0, t_p1);

    // ---- decode ----
    auto t_d0 = t_p1;
    while (true) {
      int32_t next = sampler.sample(logits.data(), static_cast<int32_t>(logits.size()));
      if (generated.empty()) ttft_ms = ms_since(t_start, Clock::now());
      generated.push_back(next);
      tokens.push_back(next);
      if (is_eos(next)) {
        stop_reason = "eos";
        break;
      }
      streamer.push(next);
      if (static_cast<long>(generated.size()) >= opt.max_new_tokens) {
        stop_reason = "max_new_tokens";
        break;
      }
      if (max_ctx > 0 && static_cast<int64_t>(tokens.size()) >= max_ctx) {
        stop_reason = "context_full";
        break;
      }
      if (kv) {
        int64_t pos = static_cast<int64_t>(tokens.size()) - 1;
        module.forward(&tokens.back(), 1, &pos, &logits);
      } else {
        step_nocache();
      }
      ++decode_steps;
    }
    decode_ms = ms_since(t_d0, Clock::now());
  }
  streamer.finish();
  std::fputs("\n", stdout);
  if (opt.print_ids) {
    std::string line = "ids:";
    for (int32_t id : generated) line += " " + std::to_string(id);
    line += "\n";
    std::fputs(line.c_str(), stdout);
  }
  std::fflush(stdout);

  // Decode speed: tokens produced after the first one, over the time spent
  // producing them (each needs one forward call).
  double decode_tok_s = 0.0;
  if (decode_steps > 0 && decode_ms > 0) {
    // decode_ms also covers the first sample; the forward calls dominate it.
    decode_tok_s = decode_steps / (decode_ms / 1000.0);
  }
  double prefill_tok_s = prefill_ms > 0 ? n_prompt / (prefill_ms / 1000.0) : 0.0;
  std::fprintf(stderr,
               "stats: ttft_ms=%.2f prefill_tok_s=%.1f decode_tok_s=%.1f peak_rss_mib=%.1f prompt_tokens=%zu "
               "generated_tokens=%zu load_ms=%.1f stop=%s\n",
               ttft_ms, prefill_tok_s, decode_tok_s, peak_rss_mib(), n_prompt, generated.size(),
               ms_since(t_load0, t_load1), stop_reason.c_str());
  if (opt.verbose) {
    std::fprintf(stderr, "llmcore_runner: program pages given back after the runtime freed them: %llu KiB (%llu KiB read "
                 "back when loaded again)\n", (unsigned long long)(module.released_bytes() >> 10),
                 (unsigned long long)(module.restored_bytes() >> 10));
    const llmcore::XnnpackReshapeCounts r = llmcore::xnnpack_reshape_counts();
    std::fprintf(stderr, "llmcore_runner: XNNPACK runtime reshapes: %llu run, %llu skipped (input shapes unchanged)%s\n",
                 (unsigned long long)r.done, (unsigned long long)r.skipped,
                 r.always ? "; LLMCORE_XNNPACK_RESHAPE=always" : "");
  }
  if (!opt.etdump.empty()) {
    std::string why;
    if (!module.write_etdump(opt.etdump, &why)) throw llmcore::RuntimeError("--etdump: " + why);
    if (opt.verbose) std::fprintf(stderr, "llmcore_runner: wrote ETDump %s\n", opt.etdump.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse_args(argc, argv);
  try {
    return run(opt);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "llmcore_runner: error: %s\n", e.what());
    return 1;
  }
}
