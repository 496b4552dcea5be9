// A small backtracking regex engine over Unicode code points, written for the
// pre-tokenizer patterns found in Hugging Face tokenizer.json files (GPT-2,
// Llama 3, Qwen 2, GPT-4-style patterns).
//
// Supported: literals, '.', escapes (\s \S \d \D \w \W \p{..} \P{..} \pL \r \n \t
// \f \v \e \xHH \x{H..} \uHHHH, escaped punctuation), character classes with
// ranges, negation and the escapes above, groups ( ), (?: ), (?i: ), (?i) inline
// flag, lookahead (?= ) (?! ), alternation with leftmost-first priority
// (Perl/Oniguruma semantics), quantifiers * + ? {n} {n,} {n,m} with lazy (?)
// and possessive (+) forms, anchors ^ $ \A \z.
// Not supported (rejected with an error): backreferences, lookbehind, named
// groups, class set operations, script properties (\p{Han}).
// Case-insensitive matching folds ASCII letters only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace llmcore {

class Regex {
 public:
  // Throws std::runtime_error on syntax it does not support.
  explicit Regex(const std::string& pattern);

  // Leftmost match starting at or after `from` in cps; returns false if none.
  // [*match_begin, *match_end) are code point indices.
  bool search(const std::vector<char32_t>& cps, size_t from, size_t* match_begin,
              size_t* match_end) const;

  // All non-overlapping matches, left to right (empty matches are skipped).
  std::vector<std::pair<size_t, size_t>> find_all(const std::vector<char32_t>& cps) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct ClassItem {
    enum Kind : uint8_t { Range, CategoryMask, Space, NotSpace } kind;
    char32_t lo = 0, hi = 0;
    uint32_t mask = 0;
    bool negated = false;  // for CategoryMask
  };
  struct Node {
    enum Kind : uint8_t {
      Empty, Char, Class, Any, Seq, Alt, Repeat, Group, LookAhead, NegLookAhead,
      LineStart, LineEnd, TextStart, TextEnd
    } kind = Empty;
    char32_t ch = 0;
    bool icase = false;
    bool class_negated = false;
    std::vector<ClassItem> items;
    std::vector<int> kids;
    int min = 0, max = -1;  // Repeat; max -1 = unbounded
    bool greedy = true, possessive = false;
  };

  class Parser;
  class Matcher;

  bool single_char(int node) const;
  bool char_matches(const Node& n, char32_t c) const;
  bool class_matches(const Node& n, char32_t c) const;

  std::string pattern_;
  std::vector<Node> nodes_;
  int root_ = -1;
};

}  // namespace llmcore
