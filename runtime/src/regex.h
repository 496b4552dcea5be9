// Pre-tokenizer regexes (Split, the ByteLevel pre-tokenizer's GPT-2 pattern, Replace) on
// PCRE2, the regex library of ExecuTorch's own C++ tokenizers, in its 32-bit (UTF-32)
// form: the tokenizer works on code points, so a match's offsets are code point indices.
//
// Hugging Face tokenizers runs these patterns with Oniguruma (Ruby syntax). PCRE2 is
// compiled to agree with it on what tokenizer.json files use: Unicode classes for \s \d
// \w and \p{..} (PCRE2_UCP), ^ and $ at line boundaries (Ruby's anchors are per line:
// PCRE2_MULTILINE), lookahead, possessive and lazy quantifiers, inline (?i). Patterns are
// JIT-compiled when the platform allows.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace llmcore {

class Regex {
 public:
  // Throws std::runtime_error naming the pattern and PCRE2's message when it does not compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // All non-overlapping matches, left to right, as [begin, end) code point indices (empty
  // matches are skipped). Code points outside Unicode (the tokenizer's stand-ins for
  // invalid UTF-8 bytes) match as U+FFFD would: not a letter, digit or space.
  std::vector<std::pair<size_t, size_t>> find_all(const std::vector<char32_t>& cps) const;

  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;        // pcre2_code_32
  void* match_data_ = nullptr;  // pcre2_match_data_32 (so a Regex is used by one thread at a time)
};

}  // namespace llmcore
