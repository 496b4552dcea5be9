// llmcore_sample: draw tokens with the runner's sampler from fixed logits (tests).
//
//   llmcore_sample LOGITS.f32 N [--temperature T] [--top-k K] [--top-p P] [--seed S]
//
// LOGITS.f32 holds the vocabulary's logits as raw little-endian float32. Prints the N ids
// drawn, space-separated, each from the same logits (one Sampler, so one random stream).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "sampler.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: llmcore_sample LOGITS.f32 N [--temperature T] [--top-k K] [--top-p P] [--seed S]\n");
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) {
    std::fprintf(stderr, "llmcore_sample: cannot read %s\n", argv[1]);
    return 1;
  }
  std::vector<float> logits(bytes.size() / sizeof(float));
  std::memcpy(logits.data(), bytes.data(), logits.size() * sizeof(float));
  long n = std::atol(argv[2]);
  llmcore::SamplerConfig cfg;
  cfg.temperature = 1.0f;
  for (int i = 3; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--temperature") cfg.temperature = std::strtof(argv[i + 1], nullptr);
    else if (flag == "--top-k") cfg.top_k = std::atoi(argv[i + 1]);
    else if (flag == "--top-p") cfg.top_p = std::strtof(argv[i + 1], nullptr);
    else if (flag == "--seed") cfg.seed = std::strtoull(argv[i + 1], nullptr, 10);
    else {
      std::fprintf(stderr, "llmcore_sample: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  llmcore::Sampler sampler(cfg);
  for (long i = 0; i < n; ++i) {
    std::printf(i ? " %d" : "%d", sampler.sample(logits.data(), static_cast<int32_t>(logits.size())));
  }
  std::printf("\n");
  return 0;
}
