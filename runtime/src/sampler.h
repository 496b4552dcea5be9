// Token sampler: greedy (temperature 0), temperature, top-k, top-p, seeded.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace llmcore {

struct SamplerConfig {
  float temperature = 0.0f;  // <= 0: greedy argmax (ties -> lowest id)
  int top_k = 0;             // <= 0: no top-k filter
  float top_p = 1.0f;        // >= 1 or <= 0: no nucleus filter
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerConfig& cfg);
  int32_t sample(const float* logits, int32_t vocab);
  static int32_t argmax(const float* logits, int32_t vocab);

 private:
  // Uniform double in [0, 1) from the 53 high bits of one mt19937_64 draw
  // (same on every standard library, unlike std::uniform_real_distribution).
  double uniform();

  SamplerConfig cfg_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;  // (scaled logit, id), reused every token
  std::vector<float> probs_;  // unnormalized probabilities of the kept candidates (sums in double)
};

}  // namespace llmcore
