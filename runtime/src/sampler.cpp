#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace llmcore {

Sampler::Sampler(const SamplerConfig& cfg) : cfg_(cfg), rng_(cfg.seed) {}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0); }

int32_t Sampler::argmax(const float* logits, int32_t vocab) {
  int32_t best = 0;
  float best_v = -std::numeric_limits<float>::infinity();
  bool found = false;
  for (int32_t i = 0; i < vocab; ++i) {
    float v = logits[i];
    if (std::isnan(v)) continue;
    if (!found || v > best_v) {  // strict '>' keeps the lowest id on ties
      best = i;
      best_v = v;
      found = true;
    }
  }
  return best;
}

int32_t Sampler::sample(const float* logits, int32_t vocab) {
  if (vocab <= 0) return 0;
  if (!(cfg_.temperature > 0.0f)) return argmax(logits, vocab);

  // (scaled logit, id), NaN treated as -inf.
  scratch_.clear();
  scratch_.reserve(static_cast<size_t>(vocab));
  const float inv_t = 1.0f / cfg_.temperature;
  for (int32_t i = 0; i < vocab; ++i) {
    float v = logits[i];
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();
    scratch_.emplace_back(v * inv_t, i);
  }
  // Highest first; ties by lower id so the order is deterministic.
  auto by_score = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = scratch_.size();
  if (cfg_.top_k > 0 && static_cast<size_t>(cfg_.top_k) < keep) {
    keep = static_cast<size_t>(cfg_.top_k);
    std::partial_sort(scratch_.begin(), scratch_.begin() + keep, scratch_.end(), by_score);
    scratch_.resize(keep);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), by_score);
  }
  const float max_v = scratch_[0].first;
  if (!std::isfinite(max_v)) return scratch_[0].second;

  std::vector<double> probs(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(static_cast<double>(scratch_[i].first - max_v));
    sum += probs[i];
  }
  // Nucleus: smallest prefix (by probability) whose mass reaches top_p.
  if (cfg_.top_p > 0.0f && cfg_.top_p < 1.0f) {
    double cum = 0.0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += probs[i] / sum;
      if (cum >= cfg_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = 0.0;
    for (size_t i = 0; i < keep; ++i) sum += probs[i];
  }
  double r = uniform() * sum;
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (r < acc) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

}  // namespace llmcore
