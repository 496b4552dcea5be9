// llmcore_llm_ops_check: runs the runner's llama:: kernels (llm_ops.cpp) through the
// ExecuTorch operator registry, on raw float32 buffers, so that tests can compare them
// with PyTorch. Not installed anywhere; the tests in tests/runtime/test_llm_ops.py use it.
//
//   llmcore_llm_ops_check registered
//       prints the names of llm_ops.cpp's kernels that are registered:
//       "llama::update_cache.out llama::update_cache_with_indices.out llama::custom_sdpa.out
//       llama::custom_quantized_sdpa.out llmcore::softcap_sdpa.out llmcore::quantize_rows.out"
//   llmcore_llm_ops_check sdpa DIR key=value...
//       keys: batch q_len heads head_dim kv_len kv_heads start causal (0/1) scale (a number
//       or "none") dtype (float/half/bfloat16: q, k, v and out; int8: q, k and v, each with
//       DIR/NAME_scales.bin (float32) and DIR/NAME_zero_points.bin (int8) [batch, rows, heads,
//       1], llama::custom_quantized_sdpa.out, out float32; double: refused) mask (0/1)
//       dropout (a number) repeat (N calls)
//       skew (bytes past a 64-byte boundary for q, k, v and out: 16 is where the Python
//       bindings put planned memory) cold (0/1: 64 MiB read before each call, so that k
//       and v come from memory as in a decode step) softcap (a number: calls
//       llmcore::softcap_sdpa.out instead, which takes no causal or dropout)
//       reads DIR/q.bin [batch,q_len,heads,head_dim], DIR/k.bin and DIR/v.bin
//       [batch,kv_len,kv_heads,head_dim] (of dtype), with mask=1 DIR/mask.bin [q_len,kv_len]
//       (float32: 0 or -inf; mask_dtype=half: refused), writes DIR/out.bin (of dtype);
//       prints "us_per_call=..." (the median of `repeat` calls); pool=1 runs the kernel on
//       the kernels' own threads (kernel_threads_use_own), woken by empty regions before
//       each call (else on ExecuTorch's pool; the line says "kernel_threads_awake=0|1",
//       as the last call found them, then "isa=AVX2|portable|...": the code that ran,
//       cpu_isa.h, which LLMCORE_KERNELS_MAX_ISA caps); threads=N (default: the
//       pool's, one per core) sizes ExecuTorch's thread pool first, which decides how the
//       kernel splits its work
//   llmcore_llm_ops_check update_cache DIR key=value...
//       keys: batch seq heads head_dim capacity start dtype indices (0/1) threads (as for sdpa)
//       reads DIR/value.bin and DIR/cache.bin, writes the updated cache to DIR/cache_out.bin;
//       with indices=1 runs update_cache_with_indices on DIR/indices.bin (int64 [batch,seq])
//   llmcore_llm_ops_check quantize_rows DIR key=value...
//       keys: rows n threads (as for sdpa); reads DIR/x.bin (float32 [rows, n]), runs
//       llmcore::quantize_rows.out, writes DIR/q.bin (int8 [rows, n]), DIR/scales.bin
//       (float32 [rows, 1]) and DIR/zero_points.bin (int8 [rows, 1])
//   llmcore_llm_ops_check parallel - key=value...
//       keys: begin end grain threads (as for sdpa; then_threads=M resizes the pool again
//       before a second round) calls (regions a round, default 3) work_us (each part's
//       busy time, default 200) nested (0/1: each part calls kernel_parallel_for again)
//       runs kernel_parallel_for (kernel_threads.h) on the kernels' own threads, on a body that counts each item and
//       notes the thread; prints per round "round=R items=N covered_once=0|1
//       parts_ok=0|1 threads_used=K region_threads_max=J nested_inline=0|1 awake_after=0|1
//       awake_later=0|1 since_region_us=T poll_us=P" (threads_used: the threads that took
//       a part in any of the round's regions; region_threads_max: the most in one region;
//       kernel_threads_awake right after the round's last region, T microseconds after
//       that region began, and 50 ms later; P: how long an idle worker polls);
//       rounds=N runs N rounds (default 1)
// Exit status: 0 when the kernel succeeded, 1 when it failed (ExecuTorch logs the reason
// on stderr), 2 on a usage error.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/runtime.h>

#include "executorch_threadpool.h"
#include "cpu_isa.h"
#include "kernel_threads.h"

namespace et = executorch::runtime;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;

namespace {

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr, "llmcore_llm_ops_check: %s\n", msg.c_str());
  std::exit(2);
}

std::vector<char> read_file(const std::string& path, size_t bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) usage("cannot read " + path);
  std::vector<char> data(bytes);
  f.read(data.data(), static_cast<std::streamsize>(bytes));
  if (static_cast<size_t>(f.gcount()) != bytes) usage(path + " is shorter than " + std::to_string(bytes) + " bytes");
  return data;
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) usage("cannot write " + path);
}

// A contiguous tensor over caller-owned memory, its data `skew` bytes past a 64-byte
// boundary (the Python bindings' planned memory lies 16 past one).
struct Buffer {
  std::vector<TensorImpl::SizesType> sizes;
  std::vector<TensorImpl::DimOrderType> order;
  std::vector<TensorImpl::StridesType> strides;
  std::vector<char> storage;
  char* data = nullptr;
  std::unique_ptr<TensorImpl> impl;

  Buffer(ScalarType type, std::vector<int64_t> shape, std::vector<char> bytes = {}, size_t skew = 0) {
    size_t n = 1;
    for (int64_t s : shape) {
      sizes.push_back(static_cast<TensorImpl::SizesType>(s));
      n *= static_cast<size_t>(s);
    }
    strides.resize(shape.size());
    TensorImpl::StridesType stride = 1;
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = stride;
      stride *= std::max<TensorImpl::SizesType>(sizes[i], 1);
      order.insert(order.begin(), static_cast<TensorImpl::DimOrderType>(i));
    }
    const size_t bytes_needed = n * executorch::runtime::elementSize(type);
    storage.assign(bytes_needed + 64 + skew, 0);
    const uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63};
    data = reinterpret_cast<char*>(base) + skew;
    std::copy(bytes.begin(), bytes.begin() + std::min(bytes.size(), bytes_needed), data);
    impl.reset(new TensorImpl(type, static_cast<ssize_t>(shape.size()), sizes.data(), data, order.data(),
                              strides.data()));
  }
  size_t nbytes() const { return impl->nbytes(); }
  Tensor tensor() { return Tensor(impl.get()); }
};

struct Args {
  std::string dir;
  std::map<std::string, std::string> kv;
  std::string get(const std::string& k, const std::string& dflt) const {
    auto it = kv.find(k);
    return it == kv.end() ? dflt : it->second;
  }
  int64_t num(const std::string& k, int64_t dflt) const { return std::stoll(get(k, std::to_string(dflt))); }
};

Args parse(int argc, char** argv) {
  if (argc < 3) usage("expected: sdpa|update_cache DIR key=value..., or parallel - key=value...");
  Args a;
  a.dir = argv[2];
  for (int i = 3; i < argc; ++i) {
    std::string s = argv[i];
    size_t eq = s.find('=');
    if (eq == std::string::npos) usage("expected key=value, got " + s);
    a.kv[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return a;
}

ScalarType dtype_of(const std::string& name) {
  if (name == "float") return ScalarType::Float;
  if (name == "double") return ScalarType::Double;
  if (name == "half") return ScalarType::Half;
  if (name == "bfloat16") return ScalarType::BFloat16;
  if (name == "int8") return ScalarType::Char;
  usage("unknown dtype " + name);
}

et::OpFunction lookup(const char* name) {
  et::Result<et::OpFunction> op = et::get_op_function_from_registry(name);
  if (!op.ok()) {
    std::fprintf(stderr, "llmcore_llm_ops_check: %s is not registered\n", name);
    std::exit(1);
  }
  return *op;
}

// ExecuTorch's thread pool resized to the count `key` gives, when it gives one.
void size_pool(const Args& a, const char* key = "threads") {
  if (a.num(key, 0) > 0)
    executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(static_cast<uint32_t>(a.num(key, 0)));
}

int run_sdpa(const Args& a) {
  const int64_t batch = a.num("batch", 1), q_len = a.num("q_len", 1), heads = a.num("heads", 1);
  const int64_t head_dim = a.num("head_dim", 8), kv_len = a.num("kv_len", 8), kv_heads = a.num("kv_heads", heads);
  const ScalarType type = dtype_of(a.get("dtype", "float"));
  const bool from_files = type != ScalarType::Double;  // double: only to be refused
  const size_t skew = static_cast<size_t>(a.num("skew", 0));
  auto load_as = [&](ScalarType as, const std::string& name, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    const size_t bytes = n * executorch::runtime::elementSize(as);
    return Buffer(as, shape, from_files ? read_file(a.dir + "/" + name, bytes) : std::vector<char>(), skew);
  };
  auto load = [&](const char* name, std::vector<int64_t> shape) { return load_as(type, name, shape); };
  Buffer q = load("q.bin", {batch, q_len, heads, head_dim});
  Buffer k = load("k.bin", {batch, kv_len, kv_heads, head_dim});
  Buffer v = load("v.bin", {batch, kv_len, kv_heads, head_dim});
  // int8: llama::custom_quantized_sdpa, with a float32 scale and an int8 zero point per row of
  // q, k and v (DIR/q_scales.bin, DIR/q_zero_points.bin, ... [batch, rows, heads, 1]); out float32
  const bool quantized = type == ScalarType::Char;
  Buffer out(quantized ? ScalarType::Float : type, {batch, q_len, heads, head_dim}, {}, skew);
  std::vector<Buffer> row_params;  // q, k, v: scales then zero points
  if (quantized) {
    for (const char* name : {"q", "k", "v"}) {
      const bool query = name[0] == 'q';
      const std::vector<int64_t> shape = {batch, query ? q_len : kv_len, query ? heads : kv_heads, 1};
      row_params.push_back(load_as(ScalarType::Float, std::string(name) + "_scales.bin", shape));
      row_params.push_back(load_as(ScalarType::Char, std::string(name) + "_zero_points.bin", shape));
    }
  }
  const bool masked = a.num("mask", 0) != 0;
  const ScalarType mask_type = dtype_of(a.get("mask_dtype", "float"));  // not float: only to be refused
  Buffer mask(mask_type, {q_len, kv_len},
              masked ? read_file(a.dir + "/mask.bin", q_len * kv_len * executorch::runtime::elementSize(mask_type))
                     : std::vector<char>());
  const std::string scale = a.get("scale", "none");

  et::EValue ev_q(q.tensor()), ev_k(k.tensor()), ev_v(v.tensor()), ev_start(a.num("start", 0));
  et::EValue ev_mask = masked ? et::EValue(mask.tensor()) : et::EValue();
  et::EValue ev_dropout(std::stod(a.get("dropout", "0")));
  et::EValue ev_causal(a.num("causal", 1) != 0);
  et::EValue ev_scale = scale == "none" ? et::EValue() : et::EValue(std::stod(scale));
  et::EValue ev_out(out.tensor());
  et::EValue* stack[] = {&ev_q, &ev_k, &ev_v, &ev_start, &ev_mask, &ev_dropout, &ev_causal, &ev_scale, &ev_out};
  // softcap=X: llmcore::softcap_sdpa.out (no dropout or is_causal: causal unless masked)
  const std::string softcap = a.get("softcap", "none");
  et::EValue ev_softcap(softcap == "none" ? 0.0 : std::stod(softcap));
  et::EValue* capped_stack[] = {&ev_q, &ev_k, &ev_v, &ev_start, &ev_mask, &ev_scale, &ev_softcap, &ev_out};
  const bool capped = softcap != "none";
  std::vector<et::EValue> ev_params;
  for (Buffer& b : row_params) ev_params.emplace_back(b.tensor());
  et::EValue ev_seq_at_dim_2(false);
  std::vector<et::EValue*> quantized_stack = {&ev_q, &ev_k, &ev_v, &ev_start, &ev_mask, &ev_dropout, &ev_causal,
                                              &ev_scale};
  for (size_t i = 0; quantized && i < 3; ++i) {  // the op takes zero points before scales
    quantized_stack.push_back(&ev_params[2 * i + 1]);
    quantized_stack.push_back(&ev_params[2 * i]);
  }
  quantized_stack.push_back(&ev_seq_at_dim_2);
  quantized_stack.push_back(&ev_out);
  et::EValue** args = quantized ? quantized_stack.data() : capped ? capped_stack : stack;
  const size_t n_args = quantized ? quantized_stack.size() : capped ? 8 : 9;

  size_pool(a);
  et::OpFunction op = lookup(quantized ? "llama::custom_quantized_sdpa.out"
                             : capped  ? "llmcore::softcap_sdpa.out"
                                       : "llama::custom_sdpa.out");
  const int64_t repeat = std::max<int64_t>(1, a.num("repeat", 1));
  std::vector<double> us;
  const bool own = a.num("pool", 0) != 0;
  llmcore_kernels::kernel_threads_use_own(own);
  bool awake = false;  // whether the last call found the kernels' threads awake
  // cold=1: read 64 MiB before each call, so that k and v come from memory, as in a decode
  // step, whose weights pass through the caches between two attention calls.
  std::vector<unsigned char> evict(a.num("cold", 0) != 0 ? size_t{64} << 20 : 0, 1);
  volatile unsigned evicted = 0;  // volatile: the reads are kept though nothing uses their sum
  for (int64_t r = 0; r < repeat; ++r) {
    et::KernelRuntimeContext ctx;
    for (size_t i = 0; i < evict.size(); i += 64) evicted = evicted + evict[i];
    // Wakes them with an empty region. On a busy host (or more threads than cores) one
    // may get its core only after another's poll time ran out: again, up to 100 times.
    for (int tries = 0; own && tries < 100 && !llmcore_kernels::kernel_threads_awake(); ++tries) {
      llmcore_kernels::kernel_parallel_for(0, 64, 1, [](int64_t, int64_t) {});
    }
    awake = llmcore_kernels::kernel_threads_awake();
    auto t0 = std::chrono::steady_clock::now();
    op(ctx, et::Span<et::EValue*>(args, n_args));
    auto t1 = std::chrono::steady_clock::now();
    if (ctx.failure_state() != et::Error::Ok) return 1;
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  write_file(a.dir + "/out.bin", out.data, out.nbytes());
  std::printf("us_per_call=%.3f kernel_threads_awake=%d isa=%s\n", us[us.size() / 2], awake ? 1 : 0,
              llmcore_kernels::isa_name(llmcore_kernels::kernels_isa()));
  return 0;
}

int run_update_cache(const Args& a) {
  const int64_t batch = a.num("batch", 1), seq = a.num("seq", 1), heads = a.num("heads", 1);
  const int64_t head_dim = a.num("head_dim", 8), capacity = a.num("capacity", 8);
  const ScalarType type = dtype_of(a.get("dtype", "float"));
  const bool from_files = type == ScalarType::Float;
  const size_t value_bytes = static_cast<size_t>(batch * seq * heads * head_dim) * sizeof(float);
  const size_t cache_bytes = static_cast<size_t>(batch * capacity * heads * head_dim) * sizeof(float);
  Buffer value(type, {batch, seq, heads, head_dim}, from_files ? read_file(a.dir + "/value.bin", value_bytes) : std::vector<char>());
  Buffer cache(type, {batch, capacity, heads, head_dim},
               from_files ? read_file(a.dir + "/cache.bin", cache_bytes) : std::vector<char>());
  Buffer out(type, {1});
  const bool indexed = a.num("indices", 0) != 0;
  Buffer indices(ScalarType::Long, {batch, seq},
                 indexed ? read_file(a.dir + "/indices.bin", batch * seq * sizeof(int64_t)) : std::vector<char>());
  et::EValue ev_value(value.tensor()), ev_cache(cache.tensor()), ev_start(a.num("start", 0)), ev_out(out.tensor());
  et::EValue ev_indices(indices.tensor());
  size_pool(a);
  et::KernelRuntimeContext ctx;
  if (indexed) {
    et::EValue* stack[] = {&ev_value, &ev_cache, &ev_start, &ev_indices, &ev_out};
    lookup("llama::update_cache_with_indices.out")(ctx, et::Span<et::EValue*>(stack, 5));
  } else {
    et::EValue* stack[] = {&ev_value, &ev_cache, &ev_start, &ev_out};
    lookup("llama::update_cache.out")(ctx, et::Span<et::EValue*>(stack, 4));
  }
  if (ctx.failure_state() != et::Error::Ok) return 1;
  write_file(a.dir + "/cache_out.bin", cache.data, cache.nbytes());
  return 0;
}

int run_quantize_rows(const Args& a) {
  const int64_t rows = a.num("rows", 1), n = a.num("n", 8);
  Buffer x(ScalarType::Float, {rows, n}, read_file(a.dir + "/x.bin", static_cast<size_t>(rows * n) * sizeof(float)));
  Buffer q(ScalarType::Char, {rows, n}), scales(ScalarType::Float, {rows, 1}), zero_points(ScalarType::Char, {rows, 1});
  et::EValue ev_x(x.tensor()), ev_q(q.tensor()), ev_scales(scales.tensor()), ev_zero_points(zero_points.tensor());
  et::EValue* stack[] = {&ev_x, &ev_q, &ev_scales, &ev_zero_points, &ev_q, &ev_scales, &ev_zero_points};
  size_pool(a);
  et::KernelRuntimeContext ctx;
  lookup("llmcore::quantize_rows.out")(ctx, et::Span<et::EValue*>(stack, 7));
  if (ctx.failure_state() != et::Error::Ok) return 1;
  write_file(a.dir + "/q.bin", q.data, q.nbytes());
  write_file(a.dir + "/scales.bin", scales.data, scales.nbytes());
  write_file(a.dir + "/zero_points.bin", zero_points.data, zero_points.nbytes());
  return 0;
}

// One round of `calls` regions over [begin, end) with kernel_parallel_for.
void parallel_round(const Args& a, int round) {
  const int64_t begin = a.num("begin", 0), end = a.num("end", 16), grain = a.num("grain", 1);
  const int64_t calls = a.num("calls", 3), work_us = a.num("work_us", 200);
  const bool nested = a.num("nested", 0) != 0;
  std::vector<int> seen(static_cast<size_t>(std::max<int64_t>(0, end - begin)), 0);
  std::set<std::thread::id> threads, region_threads;
  size_t region_threads_max = 0;
  std::mutex mutex;
  bool parts_ok = true, nested_inline = true;
  std::chrono::steady_clock::time_point region_start;
  for (int64_t call = 0; call < calls; ++call) {
    region_threads.clear();
    region_start = std::chrono::steady_clock::now();
    llmcore_kernels::kernel_parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - start < std::chrono::microseconds(work_us)) {
      }
      bool inline_only = true;
      if (nested) {  // a call from inside a region runs on this thread, whole
        const std::thread::id here = std::this_thread::get_id();
        int64_t inner_calls = 0;
        llmcore_kernels::kernel_parallel_for(0, 8, 1, [&](int64_t ib, int64_t ie) {
          ++inner_calls;
          inline_only = inline_only && std::this_thread::get_id() == here && ib == 0 && ie == 8;
        });
        inline_only = inline_only && inner_calls == 1;
      }
      std::lock_guard<std::mutex> lock(mutex);
      threads.insert(std::this_thread::get_id());
      region_threads.insert(std::this_thread::get_id());
      parts_ok = parts_ok && (b - begin) % grain == 0 && e > b && (e - b == grain || e == end);
      nested_inline = nested_inline && inline_only;
      for (int64_t i = b; i < e; ++i) ++seen[static_cast<size_t>(i - begin)];
    });
    region_threads_max = std::max(region_threads_max, region_threads.size());
  }
  const bool awake_after = llmcore_kernels::kernel_threads_awake();
  const auto since_region = std::chrono::steady_clock::now() - region_start;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const bool awake_later = llmcore_kernels::kernel_threads_awake();
  const bool covered_once = std::all_of(seen.begin(), seen.end(), [&](int n) { return n == calls; });
  std::printf("round=%d items=%lld covered_once=%d parts_ok=%d threads_used=%zu region_threads_max=%zu "
              "nested_inline=%d awake_after=%d awake_later=%d since_region_us=%lld poll_us=%lld\n",
              round, static_cast<long long>(seen.size()), covered_once ? 1 : 0, parts_ok ? 1 : 0, threads.size(),
              region_threads_max, nested_inline ? 1 : 0, awake_after ? 1 : 0, awake_later ? 1 : 0,
              static_cast<long long>(std::chrono::duration_cast<std::chrono::microseconds>(since_region).count()),
              static_cast<long long>(llmcore_kernels::kernel_threads_poll_time_us()));
}

int run_parallel(const Args& a) {
  size_pool(a);
  llmcore_kernels::kernel_threads_use_own(true);
  const int64_t rounds = std::max<int64_t>(1, a.num("rounds", 1));
  for (int64_t round = 1; round <= rounds; ++round) parallel_round(a, static_cast<int>(round));
  if (a.num("then_threads", 0) > 0) {
    size_pool(a, "then_threads");
    parallel_round(a, static_cast<int>(rounds + 1));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  et::runtime_init();
  if (argc < 2) usage("expected a command: registered, sdpa, update_cache, quantize_rows, parallel");
  const std::string cmd = argv[1];
  if (cmd == "registered") {
    for (const char* name :
         {"llama::update_cache.out", "llama::update_cache_with_indices.out", "llama::custom_sdpa.out",
          "llama::custom_quantized_sdpa.out", "llmcore::softcap_sdpa.out", "llmcore::quantize_rows.out"}) {
      if (et::registry_has_op_function(name)) std::printf("%s ", name);
    }
    std::printf("\n");
    return 0;
  }
  if (cmd == "sdpa") return run_sdpa(parse(argc, argv));
  if (cmd == "update_cache") return run_update_cache(parse(argc, argv));
  if (cmd == "parallel") return run_parallel(parse(argc, argv));
  if (cmd == "quantize_rows") return run_quantize_rows(parse(argc, argv));
  usage("unknown command " + cmd);
}
