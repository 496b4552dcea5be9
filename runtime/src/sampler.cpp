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

// Sampling never sorts the vocabulary: a full sort of SmolLM2's 49152 scores per token
// made a sampled decode far slower than a greedy one (docs/performance.md, "What was
// tried": sampling without sorting). The filters need only the best few scores in order,
// so only those are ranked (partial_sort: one comparison with the worst kept for most
// scores).
int32_t Sampler::sample(const float* logits, int32_t vocab) {
  if (vocab <= 0) return 0;
  if (!(cfg_.temperature > 0.0f)) return argmax(logits, vocab);
  const float inv_t = 1.0f / cfg_.temperature;
  const bool nucleus = cfg_.top_p > 0.0f && cfg_.top_p < 1.0f;
  if (cfg_.top_k <= 0 && !nucleus) {
    // No filter: draw in id order from exp((logit - max) / T), no candidates to rank.
    float max_raw = -std::numeric_limits<float>::infinity();
    for (int32_t i = 0; i < vocab; ++i) max_raw = std::max(max_raw, logits[i]);  // NaN never wins
    if (std::isfinite(max_raw)) {
      probs_.resize(static_cast<size_t>(vocab));
      double sum = 0.0;
      for (int32_t i = 0; i < vocab; ++i) {
        const float v = logits[i];
        probs_[i] = std::isnan(v) ? 0.0f : std::exp((v - max_raw) * inv_t);
        sum += probs_[i];
      }
      double r = uniform() * sum;
      double acc = 0.0;
      int32_t last = 0;
      for (int32_t i = 0; i < vocab; ++i) {
        if (probs_[i] == 0.0f) continue;
        acc += probs_[i];
        last = i;
        if (r < acc) return i;
      }
      return last;
    }  // every logit infinite or NaN: the general path below picks as argmax would
  }

  // (scaled logit, id), NaN treated as -inf, in id order.
  scratch_.clear();
  scratch_.reserve(static_cast<size_t>(vocab));
  float max_v = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < vocab; ++i) {
    float v = logits[i];
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();
    v *= inv_t;
    max_v = std::max(max_v, v);
    scratch_.emplace_back(v, i);
  }
  // Highest first; ties by lower id, so that every cut below keeps a well-defined set.
  auto by_score = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  auto best_first = [&](size_t m, size_t n) {  // the best m of the first n, sorted, ahead of the rest
    std::partial_sort(scratch_.begin(), scratch_.begin() + m, scratch_.begin() + n, by_score);
  };
  if (!std::isfinite(max_v)) {  // every score is -inf (or +inf): the best one, as argmax would pick
    best_first(1, scratch_.size());
    return scratch_[0].second;
  }
  size_t keep = scratch_.size();
  if (cfg_.top_k > 0 && static_cast<size_t>(cfg_.top_k) < keep) {
    keep = static_cast<size_t>(cfg_.top_k);
    best_first(keep, scratch_.size());
  }
  // Unnormalized probabilities of the candidates, in their current order.
  probs_.resize(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    probs_[i] = std::exp(scratch_[i].first - max_v);  // float exp: a third of double's time here
    sum += probs_[i];
  }
  // Nucleus: the smallest set of best candidates whose mass reaches top_p. It lies among the
  // best m for the first m (64, 512, ...) whose mass reaches it: only those are sorted, and
  // the cut is found while their mass is summed.
  if (nucleus) {
    const double target = static_cast<double>(cfg_.top_p) * sum;
    size_t m = std::min<size_t>(64, keep), cut = 0;
    while (cut == 0) {
      best_first(m, keep);
      double cum = 0.0;
      for (size_t i = 0; i < m && cut == 0; ++i) {
        probs_[i] = std::exp(scratch_[i].first - max_v);
        cum += probs_[i];
        if (cum >= target) cut = i + 1;
      }
      if (cut == 0 && m == keep) cut = keep;  // rounding left the whole set short of the target
      m = std::min(m * 8, keep);
    }
    keep = cut;
    sum = 0.0;
    for (size_t i = 0; i < keep; ++i) sum += probs_[i];
  }
  double r = uniform() * sum;
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += probs_[i];
    if (r < acc) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

}  // namespace llmcore
