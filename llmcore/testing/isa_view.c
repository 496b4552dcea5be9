/* A narrower CPU, as ExecuTorch's kernels see it: loaded with LD_PRELOAD by
 * benchmarks/isa_view.py, it clears CPU features from cpuinfo's answers before XNNPACK
 * (and ExecuTorch's optimized kernels) pick their kernels. An AVX-512 machine then runs the
 * code an AVX2-only x86 CPU would run: XNNPACK's AVX2 GEMMs, not its AVX-512 VNNI ones.
 *
 * Why this works: the wheel's cpuinfo lives in libexecutorch_threadpool.so and exports both
 * `cpuinfo_initialize` and the feature table `cpuinfo_isa`; XNNPACK calls the first through
 * the dynamic linker (so this definition, preloaded, is the one it reaches) and then reads
 * the table. The table is patched once, after the real initialization and before anything
 * reads it.
 *
 * Environment:
 *   ISA_VIEW_HIDE    comma-separated fnmatch patterns of the features to clear (required)
 *   ISA_VIEW_REPORT  a file to which the features seen and those cleared are written, once
 *                    per process: the caller's proof that the view took effect.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fnmatch.h>
#include <link.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The x86-64 layout of cpuinfo's `struct cpuinfo_x86_isa` (cpuinfo.h; the fields it keeps
 * under CPUINFO_ARCH_X86 alone are absent on x86-64): one bool per feature, in this order.
 * The symbol's size is checked against this list before anything is written. */
static const char *const FIELDS[] = {
    "rdtscp", "rdpid", "sysenter", "msr", "clzero", "clflush", "clflushopt", "mwait", "mwaitx",
    "fxsave", "xsave", "three_d_now", "three_d_now_plus", "prefetch", "prefetchw", "prefetchwt1",
    "sse3", "ssse3", "sse4_1", "sse4_2", "sse4a", "misaligned_sse", "avx", "avxvnni", "fma3",
    "fma4", "xop", "f16c", "avx2", "avx512f", "avx512pf", "avx512er", "avx512cd", "avx512dq",
    "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512vbmi2", "avx512bitalg",
    "avx512vpopcntdq", "avx512vnni", "avx512bf16", "avx512fp16", "avx512vp2intersect",
    "avx512_4vnniw", "avx512_4fmaps", "avx10_1", "avx10_2", "amx_bf16", "amx_tile", "amx_int8",
    "amx_fp16", "avx_vnni_int8", "avx_vnni_int16", "avx_ne_convert", "hle", "rtm", "xtest", "mpx",
    "cmpxchg16b", "clwb", "movbe", "lahf_sahf", "fs_gs_base", "lzcnt", "popcnt", "tbm", "bmi",
    "bmi2", "adx", "aes", "vaes", "pclmulqdq", "vpclmulqdq", "gfni", "rdrand", "rdseed", "sha",
    "rng", "ace", "ace2", "phe", "pmm", "lwp",
};
#define N_FIELDS (sizeof FIELDS / sizeof *FIELDS)
#define LIBRARY "libexecutorch_threadpool.so"

static bool (*real_initialize)(void);
static pthread_once_t patched = PTHREAD_ONCE_INIT;

static void die(const char *what) {
  fprintf(stderr, "isa_view: %s; the view cannot be applied\n", what);
  abort();
}

static bool hidden(const char *feature, const char *patterns) {
  char buffer[1024];
  if (strlen(patterns) >= sizeof buffer) die("ISA_VIEW_HIDE is too long");
  strcpy(buffer, patterns);
  for (char *save = NULL, *p = strtok_r(buffer, ",", &save); p; p = strtok_r(NULL, ",", &save))
    if (fnmatch(p, feature, 0) == 0) return true;
  return false;
}

static void initialize_and_patch(void) {
  void *library = dlopen(LIBRARY, RTLD_NOLOAD | RTLD_LAZY);
  if (!library) die(LIBRARY " is not loaded");
  real_initialize = (bool (*)(void))dlsym(library, "cpuinfo_initialize");
  bool *isa = (bool *)dlsym(library, "cpuinfo_isa");
  const char *patterns = getenv("ISA_VIEW_HIDE");
  if (!real_initialize || !isa) die(LIBRARY " exports no cpuinfo_initialize / cpuinfo_isa");
  if (!patterns) die("ISA_VIEW_HIDE is not set");
  Dl_info info;
  const ElfW(Sym) *symbol = NULL;
  if (!dladdr1(isa, &info, (void **)&symbol, RTLD_DL_SYMENT) || !symbol || symbol->st_size != N_FIELDS)
    die("cpuinfo_isa does not have the layout this file knows (its size differs)");
  real_initialize();
  const char *report_path = getenv("ISA_VIEW_REPORT");
  FILE *report = report_path ? fopen(report_path, "a") : NULL;
  if (report) fputs("seen:", report);
  for (size_t i = 0; i < N_FIELDS; i++)
    if (isa[i] && report) fprintf(report, " %s", FIELDS[i]);
  if (report) fputs("\nhidden:", report);
  for (size_t i = 0; i < N_FIELDS; i++) {
    if (isa[i] && hidden(FIELDS[i], patterns)) {
      isa[i] = false;
      if (report) fprintf(report, " %s", FIELDS[i]);
    }
  }
  if (report) {
    fputs("\n", report);
    fclose(report);
  }
}

bool cpuinfo_initialize(void) {
  pthread_once(&patched, initialize_and_patch);
  return real_initialize();
}
