#include "tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <queue>
#include <sstream>
#include <stdexcept>

#include "json.h"
#include "regex.h"
#include "unicode.h"

namespace llmcore {

namespace {

// GPT-2's pre-tokenizer regex, used by the ByteLevel pre-tokenizer when use_regex.
const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("tokenizer: " + msg); }

void warn(const std::string& msg) { std::fprintf(stderr, "llmcore_runner: warning: tokenizer: %s\n", msg.c_str()); }

// A segment of a piece: [begin, end) byte offsets, and whether the pattern matched it.
struct Span {
  size_t begin, end;
  bool is_match;
};

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& s) {
  if (s == "Removed") return Behavior::Removed;
  if (s == "Isolated" || s.empty()) return Behavior::Isolated;
  if (s == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::MergedWithNext;
  if (s == "Contiguous") return Behavior::Contiguous;
  fail("unsupported Split behavior '" + s + "'");
}

// Applies a split behaviour (same rules as HF tokenizers' NormalizedString::split)
// and appends the non-empty resulting substrings of `piece` to `out`.
void apply_behavior(const std::string& piece, std::vector<Span> spans, Behavior behavior,
                    bool invert, std::vector<std::string>& out) {
  if (invert) {
    for (auto& s : spans) s.is_match = !s.is_match;
  }
  std::vector<Span> res;
  switch (behavior) {
    case Behavior::Isolated:
      res = std::move(spans);
      break;
    case Behavior::Removed:
      for (const auto& s : spans) {
        if (!s.is_match) res.push_back(s);
      }
      break;
    case Behavior::MergedWithPrevious: {
      bool prev_match = false;
      for (const auto& s : spans) {
        if (s.is_match && !prev_match) {
          if (!res.empty()) res.back().end = s.end;
          else res.push_back({s.begin, s.end, true});
        } else {
          res.push_back({s.begin, s.end, false});
        }
        prev_match = s.is_match;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !prev_match) {
          if (!res.empty()) res.back().begin = it->begin;
          else res.push_back({it->begin, it->end, true});
        } else {
          res.push_back({it->begin, it->end, false});
        }
        prev_match = it->is_match;
      }
      std::reverse(res.begin(), res.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev_match = false;
      for (const auto& s : spans) {
        if (s.is_match == prev_match && !res.empty()) {
          res.back().end = s.end;
        } else {
          res.push_back({s.begin, s.end, false});
        }
        prev_match = s.is_match;
      }
      break;
    }
  }
  for (const auto& s : res) {
    if (s.end > s.begin) out.push_back(piece.substr(s.begin, s.end - s.begin));
  }
}

// Turns a list of [begin,end) code point matches into byte spans covering the piece.
std::vector<Span> spans_from_matches(const unicode::Decoded& d,
                                     const std::vector<std::pair<size_t, size_t>>& matches) {
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& m : matches) {
    if (m.first > prev) spans.push_back({d.offsets[prev], d.offsets[m.first], false});
    spans.push_back({d.offsets[m.first], d.offsets[m.second], true});
    prev = m.second;
  }
  if (prev < d.cps.size()) spans.push_back({d.offsets[prev], d.offsets[d.cps.size()], false});
  return spans;
}

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_word_byte(unsigned char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c >= 0x80;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open '" + path + "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

// ---------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------
struct Tokenizer::PreTokenizer {
  virtual ~PreTokenizer() = default;
  // Replaces every piece by its sub-pieces. first_at_start: pieces[0] begins at
  // offset 0 of the original input (Metaspace's prepend_scheme "first").
  virtual void apply(std::vector<std::string>& pieces, bool first_at_start) const = 0;
  virtual bool is_byte_level() const { return false; }
  virtual std::string name() const = 0;
};

namespace {

using PreTok = Tokenizer::PreTokenizer;

class ByteLevelPreTok : public PreTok {
 public:
  ByteLevelPreTok(bool add_prefix_space, bool use_regex, const std::string* b2u)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex), b2u_(b2u) {
    if (use_regex_) re_.reset(new Regex(kGpt2Pattern));
  }
  void apply(std::vector<std::string>& pieces, bool /*first_at_start*/) const override {
    std::vector<std::string> out;
    for (auto& p : pieces) {
      if (add_prefix_space_ && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
      std::vector<std::string> subs;
      if (use_regex_) {
        unicode::Decoded d = unicode::decode_utf8(p);
        apply_behavior(p, spans_from_matches(d, re_->find_all(d.cps)), Behavior::Isolated, false, subs);
      } else if (!p.empty()) {
        subs.push_back(p);
      }
      for (const auto& s : subs) {
        std::string mapped;
        mapped.reserve(s.size() * 2);
        for (unsigned char c : s) mapped += b2u_[c];
        out.push_back(std::move(mapped));
      }
    }
    pieces.swap(out);
  }
  bool is_byte_level() const override { return true; }
  std::string name() const override {
    return std::string("ByteLevel(add_prefix_space=") + (add_prefix_space_ ? "true" : "false") +
           ", use_regex=" + (use_regex_ ? "true" : "false") + ")";
  }

 private:
  bool add_prefix_space_, use_regex_;
  const std::string* b2u_;
  std::unique_ptr<Regex> re_;
};

class SplitPreTok : public PreTok {
 public:
  SplitPreTok(std::unique_ptr<Regex> re, std::string literal, Behavior b, bool invert)
      : re_(std::move(re)), literal_(std::move(literal)), behavior_(b), invert_(invert) {}
  void apply(std::vector<std::string>& pieces, bool /*first_at_start*/) const override {
    std::vector<std::string> out;
    for (const auto& p : pieces) {
      std::vector<Span> spans;
      if (re_) {
        unicode::Decoded d = unicode::decode_utf8(p);
        spans = spans_from_matches(d, re_->find_all(d.cps));
      } else {
        size_t prev = 0;
        if (!literal_.empty()) {
          size_t at = 0;
          while ((at = p.find(literal_, prev)) != std::string::npos) {
            if (at > prev) spans.push_back({prev, at, false});
            spans.push_back({at, at + literal_.size(), true});
            prev = at + literal_.size();
          }
        }
        if (prev < p.size()) spans.push_back({prev, p.size(), false});
      }
      apply_behavior(p, std::move(spans), behavior_, invert_, out);
    }
    pieces.swap(out);
  }
  std::string name() const override {
    return "Split(" + (re_ ? "Regex " + re_->pattern() : "String '" + literal_ + "'") + ")";
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string literal_;
  Behavior behavior_;
  bool invert_;
};

class DigitsPreTok : public PreTok {
 public:
  // A digit is what Rust's char::is_numeric calls one (Unicode's N categories): \p{N}.
  explicit DigitsPreTok(bool individual) : individual_(individual), digit_("\\p{N}") {}
  void apply(std::vector<std::string>& pieces, bool /*first_at_start*/) const override {
    std::vector<std::string> out;
    for (const auto& p : pieces) {
      unicode::Decoded d = unicode::decode_utf8(p);
      apply_behavior(p, spans_from_matches(d, digit_.find_all(d.cps)),
                     individual_ ? Behavior::Isolated : Behavior::Contiguous, false, out);
    }
    pieces.swap(out);
  }
  std::string name() const override { return individual_ ? "Digits(individual)" : "Digits"; }

 private:
  bool individual_;
  Regex digit_;
};

enum class PrependScheme { Always, First, Never };

PrependScheme parse_prepend_scheme(const json::Value& v) {
  const json::Value* ps = v.find("prepend_scheme");
  if (ps && ps->is_string()) {
    const std::string& s = ps->as_string();
    if (s == "always") return PrependScheme::Always;
    if (s == "first") return PrependScheme::First;
    if (s == "never") return PrependScheme::Never;
    fail("unknown Metaspace prepend_scheme '" + s + "'");
  }
  return v.get_bool("add_prefix_space", true) ? PrependScheme::Always : PrependScheme::Never;
}

std::string metaspace_replacement(const json::Value& v) {
  std::string r = v.get_string("replacement", "\xE2\x96\x81");  // U+2581
  if (unicode::decode_utf8(r).cps.size() != 1) fail("Metaspace replacement must be one character");
  return r;
}

// Replaces every occurrence of `from` in s with `to`.
std::string replace_all(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0, at;
  while ((at = s.find(from, pos)) != std::string::npos) {
    out.append(s, pos, at - pos);
    out += to;
    pos = at + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// SentencePiece-style: spaces become the replacement char (U+2581), a leading
// one is prepended per prepend_scheme, and (split) each word keeps its marker.
class MetaspacePreTok : public PreTok {
 public:
  MetaspacePreTok(std::string rep, PrependScheme scheme, bool split)
      : rep_(std::move(rep)), scheme_(scheme), split_(split) {}
  void apply(std::vector<std::string>& pieces, bool first_at_start) const override {
    std::vector<std::string> out;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i].empty()) continue;
      std::string p = replace_all(pieces[i], " ", rep_);
      bool starts = p.compare(0, rep_.size(), rep_) == 0;
      if (!starts && (scheme_ == PrependScheme::Always || (scheme_ == PrependScheme::First && i == 0 && first_at_start))) {
        p.insert(0, rep_);
      }
      if (!split_) {
        out.push_back(std::move(p));
        continue;
      }
      std::vector<Span> spans;
      size_t prev = 0, at = 0;
      while ((at = p.find(rep_, prev)) != std::string::npos) {
        if (at > prev) spans.push_back({prev, at, false});
        spans.push_back({at, at + rep_.size(), true});
        prev = at + rep_.size();
      }
      if (prev < p.size()) spans.push_back({prev, p.size(), false});
      apply_behavior(p, std::move(spans), Behavior::MergedWithNext, false, out);
    }
    pieces.swap(out);
  }
  std::string name() const override { return "Metaspace"; }

 private:
  std::string rep_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTok : public PreTok {
 public:
  explicit SequencePreTok(std::vector<std::unique_ptr<PreTok>> items) : items_(std::move(items)) {}
  void apply(std::vector<std::string>& pieces, bool first_at_start) const override {
    for (const auto& it : items_) it->apply(pieces, first_at_start);
  }
  bool is_byte_level() const override {
    for (const auto& it : items_) {
      if (it->is_byte_level()) return true;
    }
    return false;
  }
  std::string name() const override {
    std::string s = "Sequence[";
    for (size_t i = 0; i < items_.size(); ++i) s += (i ? ", " : "") + items_[i]->name();
    return s + "]";
  }

 private:
  std::vector<std::unique_ptr<PreTok>> items_;
};

std::unique_ptr<PreTok> make_pretokenizer(const json::Value& v, const std::string* b2u) {
  std::string type = v.get_string("type");
  if (type == "ByteLevel") {
    return std::unique_ptr<PreTok>(
        new ByteLevelPreTok(v.get_bool("add_prefix_space", false), v.get_bool("use_regex", true), b2u));
  }
  if (type == "Split") {
    const json::Value* pat = v.find("pattern");
    if (!pat || !pat->is_object()) fail("Split pre-tokenizer without a pattern");
    std::unique_ptr<Regex> re;
    std::string literal;
    if (const json::Value* r = pat->find("Regex")) {
      re.reset(new Regex(r->as_string()));
    } else if (const json::Value* s = pat->find("String")) {
      literal = s->as_string();
    } else {
      fail("Split pattern must be Regex or String");
    }
    return std::unique_ptr<PreTok>(new SplitPreTok(std::move(re), literal,
                                                   parse_behavior(v.get_string("behavior", "Isolated")),
                                                   v.get_bool("invert", false)));
  }
  if (type == "Digits") {
    return std::unique_ptr<PreTok>(new DigitsPreTok(v.get_bool("individual_digits", false)));
  }
  if (type == "Metaspace") {
    return std::unique_ptr<PreTok>(
        new MetaspacePreTok(metaspace_replacement(v), parse_prepend_scheme(v), v.get_bool("split", true)));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTok>> items;
    const json::Value* list = v.find("pretokenizers");
    if (list && list->is_array()) {
      for (const auto& item : list->as_array()) items.push_back(make_pretokenizer(item, b2u));
    }
    return std::unique_ptr<PreTok>(new SequencePreTok(std::move(items)));
  }
  fail("unsupported pre_tokenizer type '" + type +
       "' (supported: ByteLevel, Split, Digits, Metaspace, Sequence)");
}

// Pattern of a Replace normalizer/decoder or Split: {"String": ..} or {"Regex": ..}.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> re;

  static Pattern from_json(const json::Value* v, const char* what) {
    Pattern p;
    if (!v || !v->is_object()) fail(std::string(what) + " without a pattern");
    if (const json::Value* r = v->find("Regex")) {
      p.re.reset(new Regex(r->as_string()));
    } else if (const json::Value* s = v->find("String")) {
      p.literal = s->as_string();
    } else {
      fail(std::string(what) + " pattern must be Regex or String");
    }
    return p;
  }

  std::string replace(const std::string& s, const std::string& content) const {
    if (!re) return replace_all(s, literal, content);
    unicode::Decoded d = unicode::decode_utf8(s);
    std::string out;
    size_t prev = 0;
    for (const auto& m : re->find_all(d.cps)) {
      out.append(s, d.offsets[prev], d.offsets[m.first] - d.offsets[prev]);
      out += content;
      prev = m.second;
    }
    out.append(s, d.offsets[prev], std::string::npos);
    return out;
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// Normalizers
// ---------------------------------------------------------------------------
struct Tokenizer::Normalizer {
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
  virtual std::string name() const = 0;
};

namespace {

using Norm = Tokenizer::Normalizer;

class PrependNorm : public Norm {
 public:
  explicit PrependNorm(std::string p) : p_(std::move(p)) {}
  void apply(std::string& s) const override {
    if (!s.empty()) s.insert(0, p_);
  }
  std::string name() const override { return "Prepend"; }

 private:
  std::string p_;
};

class ReplaceNorm : public Norm {
 public:
  ReplaceNorm(Pattern p, std::string content) : p_(std::move(p)), content_(std::move(content)) {}
  void apply(std::string& s) const override { s = p_.replace(s, content_); }
  std::string name() const override { return "Replace"; }

 private:
  Pattern p_;
  std::string content_;
};

class StripNorm : public Norm {
 public:
  StripNorm(bool left, bool right) : left_(left), right_(right) {}
  void apply(std::string& s) const override {
    unicode::Decoded d = unicode::decode_utf8(s);
    size_t b = 0, e = d.cps.size();
    if (left_) {
      while (b < e && unicode::is_whitespace(d.cps[b])) ++b;
    }
    if (right_) {
      while (e > b && unicode::is_whitespace(d.cps[e - 1])) --e;
    }
    s = s.substr(d.offsets[b], d.offsets[e] - d.offsets[b]);
  }
  std::string name() const override { return "Strip"; }

 private:
  bool left_, right_;
};

class IdentityNorm : public Norm {
 public:
  explicit IdentityNorm(std::string name) : name_(std::move(name)) {}
  void apply(std::string&) const override {}
  std::string name() const override { return name_ + "(as identity)"; }

 private:
  std::string name_;
};

class SequenceNorm : public Norm {
 public:
  explicit SequenceNorm(std::vector<std::unique_ptr<Norm>> items) : items_(std::move(items)) {}
  void apply(std::string& s) const override {
    for (const auto& n : items_) n->apply(s);
  }
  std::string name() const override {
    std::string s = "Sequence[";
    for (size_t i = 0; i < items_.size(); ++i) s += (i ? ", " : "") + items_[i]->name();
    return s + "]";
  }

 private:
  std::vector<std::unique_ptr<Norm>> items_;
};

std::unique_ptr<Norm> make_normalizer(const json::Value& v) {
  std::string type = v.get_string("type");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Norm>> items;
    const json::Value* list = v.find("normalizers");
    if (list && list->is_array()) {
      for (const auto& n : list->as_array()) items.push_back(make_normalizer(n));
    }
    return std::unique_ptr<Norm>(new SequenceNorm(std::move(items)));
  }
  if (type == "Prepend") return std::unique_ptr<Norm>(new PrependNorm(v.get_string("prepend")));
  if (type == "Replace") {
    return std::unique_ptr<Norm>(new ReplaceNorm(Pattern::from_json(v.find("pattern"), "Replace"), v.get_string("content")));
  }
  if (type == "Strip") {
    return std::unique_ptr<Norm>(new StripNorm(v.get_bool("strip_left", true), v.get_bool("strip_right", true)));
  }
  if (type == "NFC") {
    // Identity for text already in NFC: ASCII and almost all real text.
    return std::unique_ptr<Norm>(new IdentityNorm(type));
  }
  warn("normalizer '" + type + "' is not implemented and is skipped; non-ASCII text may tokenize differently");
  return std::unique_ptr<Norm>(new IdentityNorm(type));
}

}  // namespace

// ---------------------------------------------------------------------------
// Decoders: each step maps the list of token strings to a new list (HF decode_chain).
// ---------------------------------------------------------------------------
struct Tokenizer::Decoder {
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& toks) const = 0;
  virtual std::string name() const = 0;
};

namespace {

using Dec = Tokenizer::Decoder;

class ByteLevelDec : public Dec {
 public:
  explicit ByteLevelDec(const std::string* b2u) {
    for (int b = 0; b < 256; ++b) u2b_[unicode::decode_utf8(b2u[b]).cps[0]] = static_cast<uint8_t>(b);
  }
  void apply(std::vector<std::string>& toks) const override {
    // Every char maps back to a byte; a token with a char that does not is kept
    // as its own UTF-8. The whole chain becomes one (lossy UTF-8) string.
    std::string bytes;
    for (const auto& t : toks) {
      unicode::Decoded d = unicode::decode_utf8(t);
      std::string tb;
      bool ok = true;
      for (char32_t cp : d.cps) {
        auto it = u2b_.find(cp);
        if (it == u2b_.end()) {
          ok = false;
          break;
        }
        tb.push_back(static_cast<char>(it->second));
      }
      bytes += ok ? tb : t;
    }
    toks.assign(1, unicode::utf8_lossy(bytes));
  }
  std::string name() const override { return "ByteLevel"; }

 private:
  std::unordered_map<char32_t, uint8_t> u2b_;
};

class ReplaceDec : public Dec {
 public:
  ReplaceDec(Pattern p, std::string content) : p_(std::move(p)), content_(std::move(content)) {}
  void apply(std::vector<std::string>& toks) const override {
    for (auto& t : toks) t = p_.replace(t, content_);
  }
  std::string name() const override { return "Replace"; }

 private:
  Pattern p_;
  std::string content_;
};

// "<0xXX>" tokens become bytes; a run of them that is not valid UTF-8 becomes one
// U+FFFD per byte (as HF does).
class ByteFallbackDec : public Dec {
 public:
  void apply(std::vector<std::string>& toks) const override {
    std::vector<std::string> out;
    std::string run;
    size_t run_len = 0;
    auto flush = [&]() {
      if (run_len == 0) return;
      if (unicode::utf8_lossy(run) == run) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run_len; ++i) out.push_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_len = 0;
    };
    for (auto& t : toks) {
      int byte = parse_byte_token(t);
      if (byte >= 0) {
        run.push_back(static_cast<char>(byte));
        ++run_len;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    toks.swap(out);
  }
  std::string name() const override { return "ByteFallback"; }

  static int parse_byte_token(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; ++i) {
      char c = t[i];
      int h;
      if (c >= '0' && c <= '9') h = c - '0';
      else if (c >= 'A' && c <= 'F') h = c - 'A' + 10;
      else if (c >= 'a' && c <= 'f') h = c - 'a' + 10;
      else return -1;
      v = v * 16 + h;
    }
    return v;
  }
};

class FuseDec : public Dec {
 public:
  void apply(std::vector<std::string>& toks) const override {
    std::string all;
    for (const auto& t : toks) all += t;
    toks.assign(1, all);
  }
  std::string name() const override { return "Fuse"; }
};

class StripDec : public Dec {
 public:
  StripDec(char32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void apply(std::vector<std::string>& toks) const override {
    for (auto& t : toks) {
      unicode::Decoded d = unicode::decode_utf8(t);
      size_t n = d.cps.size();
      size_t b = 0;
      while (b < start_ && b < n && d.cps[b] == content_) ++b;
      size_t e = n;
      for (size_t i = 0; i < stop_ && e > b && d.cps[e - 1] == content_; ++i) --e;
      t = t.substr(d.offsets[b], d.offsets[e] - d.offsets[b]);
    }
  }
  std::string name() const override { return "Strip"; }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class MetaspaceDec : public Dec {
 public:
  MetaspaceDec(std::string rep, PrependScheme scheme) : rep_(std::move(rep)), scheme_(scheme) {}
  void apply(std::vector<std::string>& toks) const override {
    for (size_t i = 0; i < toks.size(); ++i) {
      // In the first token the marker is dropped (it was the prepended space).
      toks[i] = replace_all(toks[i], rep_, (i == 0 && scheme_ != PrependScheme::Never) ? "" : " ");
    }
  }
  std::string name() const override { return "Metaspace"; }

 private:
  std::string rep_;
  PrependScheme scheme_;
};

// No decoder at all: HF joins the tokens with spaces.
class JoinSpaceDec : public Dec {
 public:
  void apply(std::vector<std::string>& toks) const override {
    std::string all;
    for (size_t i = 0; i < toks.size(); ++i) all += (i ? " " : "") + toks[i];
    toks.assign(1, all);
  }
  std::string name() const override { return "none"; }
};

class SequenceDec : public Dec {
 public:
  explicit SequenceDec(std::vector<std::unique_ptr<Dec>> items) : items_(std::move(items)) {}
  void apply(std::vector<std::string>& toks) const override {
    for (const auto& d : items_) d->apply(toks);
  }
  std::string name() const override {
    std::string s = "Sequence[";
    for (size_t i = 0; i < items_.size(); ++i) s += (i ? ", " : "") + items_[i]->name();
    return s + "]";
  }

 private:
  std::vector<std::unique_ptr<Dec>> items_;
};

std::unique_ptr<Dec> make_decoder(const json::Value& v, const std::string* b2u) {
  std::string type = v.get_string("type");
  if (type == "ByteLevel") return std::unique_ptr<Dec>(new ByteLevelDec(b2u));
  if (type == "Replace") {
    return std::unique_ptr<Dec>(new ReplaceDec(Pattern::from_json(v.find("pattern"), "Replace"), v.get_string("content")));
  }
  if (type == "ByteFallback") return std::unique_ptr<Dec>(new ByteFallbackDec());
  if (type == "Fuse") return std::unique_ptr<Dec>(new FuseDec());
  if (type == "Strip") {
    std::string c = v.get_string("content", " ");
    unicode::Decoded d = unicode::decode_utf8(c);
    if (d.cps.size() != 1) fail("Strip decoder content must be one character");
    const json::Value* start = v.find("start");
    const json::Value* stop = v.find("stop");
    return std::unique_ptr<Dec>(new StripDec(d.cps[0], start ? static_cast<size_t>(start->as_int()) : 0,
                                             stop ? static_cast<size_t>(stop->as_int()) : 0));
  }
  if (type == "Metaspace") return std::unique_ptr<Dec>(new MetaspaceDec(metaspace_replacement(v), parse_prepend_scheme(v)));
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Dec>> items;
    const json::Value* list = v.find("decoders");
    if (list && list->is_array()) {
      for (const auto& d : list->as_array()) items.push_back(make_decoder(d, b2u));
    }
    return std::unique_ptr<Dec>(new SequenceDec(std::move(items)));
  }
  fail("unsupported decoder type '" + type + "' (supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)");
}

}  // namespace

// ---------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------
Tokenizer::Tokenizer() {
  // GPT-2 byte -> unicode mapping: printable Latin-1 bytes map to themselves,
  // the rest to U+0100 + n in byte order.
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    char32_t cp = keep ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
    unicode::append_utf8(byte_to_unicode_[b], cp);
    byte_fallback_ids_[b] = -1;
  }
}

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  std::string text = read_file(path);
  try {
    return from_json_text(text);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + " [in " + path + "]");
  }
}

std::unique_ptr<Tokenizer> Tokenizer::from_json_text(const std::string& text) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->build_from_json(text);
  return t;
}

void Tokenizer::build_from_json(const std::string& text) {
  json::Value root = json::Value::parse(text);
  if (!root.is_object()) fail("tokenizer.json is not a JSON object");
  const json::Value* model = root.find("model");
  if (!model || !model->is_object()) fail("missing 'model'");
  std::string mtype = model->get_string("type", "BPE");
  if (mtype != "BPE") fail("only BPE models are supported (model.type is '" + mtype + "')");
  const json::Value* vocab = model->find("vocab");
  if (!vocab || !vocab->is_object()) fail("missing model.vocab");
  if (!model->get_string("continuing_subword_prefix").empty() || !model->get_string("end_of_word_suffix").empty()) {
    fail("BPE continuing_subword_prefix / end_of_word_suffix are not supported");
  }
  ignore_merges_ = model->get_bool("ignore_merges", false);
  byte_fallback_ = model->get_bool("byte_fallback", false);
  fuse_unk_ = model->get_bool("fuse_unk", false);

  int32_t max_id = -1;
  vocab_.reserve(vocab->as_object().size() * 2);
  for (const auto& kv : vocab->as_object()) {
    int64_t id = kv.second.as_int();
    if (id < 0 || id > (1 << 30)) fail("bad token id for '" + kv.first + "'");
    vocab_.emplace(kv.first, static_cast<int32_t>(id));
    max_id = std::max<int32_t>(max_id, static_cast<int32_t>(id));
  }

  // Added tokens.
  if (const json::Value* added = root.find("added_tokens")) {
    if (added->is_array()) {
      for (const auto& a : added->as_array()) {
        AddedToken t;
        t.id = static_cast<int32_t>(a.find("id") ? a.find("id")->as_int() : -1);
        t.content = a.get_string("content");
        t.special = a.get_bool("special", false);
        t.lstrip = a.get_bool("lstrip", false);
        t.rstrip = a.get_bool("rstrip", false);
        t.single_word = a.get_bool("single_word", false);
        if (t.id < 0 || t.content.empty()) continue;
        max_id = std::max(max_id, t.id);
        added_.push_back(t);
      }
    }
  }
  std::stable_sort(added_.begin(), added_.end(), [](const AddedToken& a, const AddedToken& b) {
    return a.content.size() > b.content.size();
  });

  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  special_.assign(id_to_token_.size(), 0);
  for (const auto& kv : vocab_) id_to_token_[kv.second] = kv.first;
  for (const auto& a : added_) {
    id_to_token_[a.id] = a.content;
    special_[a.id] = a.special ? 1 : 0;
    vocab_.emplace(a.content, a.id);
  }

  std::string unk = model->get_string("unk_token");
  if (!unk.empty()) unk_id_ = token_to_id(unk);
  if (byte_fallback_) {
    static const char* hex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
      byte_fallback_ids_[b] = token_to_id(name);
    }
  }

  // Merges: "a b" strings or ["a", "b"] pairs, in priority order.
  if (const json::Value* merges = model->find("merges")) {
    const auto& list = merges->as_array();
    merges_.reserve(list.size() * 2);
    int32_t rank = 0;
    for (const auto& m : list) {
      std::string a, b;
      if (m.is_string()) {
        const std::string& s = m.as_string();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          fail("bad merge entry '" + s + "'");
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.as_array().size() == 2) {
        a = m.as_array()[0].as_string();
        b = m.as_array()[1].as_string();
      } else {
        fail("bad merge entry (expected \"a b\" or [\"a\", \"b\"])");
      }
      int32_t ia = token_to_id(a), ib = token_to_id(b), inew = token_to_id(a + b);
      if (ia < 0 || ib < 0 || inew < 0) fail("merge '" + a + " " + b + "' uses tokens missing from the vocab");
      uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia)) << 32) | static_cast<uint32_t>(ib);
      merges_.emplace(key, MergeInfo{rank, inew});  // first (best) rank wins
      ++rank;
    }
  }

  const json::Value* norm = root.find("normalizer");
  if (norm && !norm->is_null()) normalizer_ = make_normalizer(*norm);
  const json::Value* pre = root.find("pre_tokenizer");
  if (pre && !pre->is_null()) pre_ = make_pretokenizer(*pre, byte_to_unicode_);

  const json::Value* dec = root.find("decoder");
  if (dec && !dec->is_null()) {
    decoder_ = make_decoder(*dec, byte_to_unicode_);
  } else if (pre_ && pre_->is_byte_level()) {
    decoder_.reset(new ByteLevelDec(byte_to_unicode_));  // a byte-level vocab is unreadable otherwise
  } else {
    decoder_.reset(new JoinSpaceDec());
  }
}

int32_t Tokenizer::token_to_id(const std::string& token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  static const std::string empty;
  if (id < 0 || id >= vocab_size()) return empty;
  return id_to_token_[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && special_[id];
}

std::string Tokenizer::describe() const {
  std::string s = "BPE vocab=" + std::to_string(vocab_size()) + " merges=" + std::to_string(merges_.size()) +
                  " added=" + std::to_string(added_.size());
  if (byte_fallback_) s += " byte_fallback";
  s += " normalizer=" + (normalizer_ ? normalizer_->name() : std::string("none"));
  s += " pre_tokenizer=" + (pre_ ? pre_->name() : std::string("none"));
  s += " decoder=" + decoder_->name();
  return s;
}

void Tokenizer::bpe(const std::string& piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    int32_t id = token_to_id(piece);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  // Initial symbols: one per character (or its UTF-8 bytes with byte_fallback).
  struct Sym {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Sym> syms;
  syms.reserve(piece.size());
  auto add = [&](int32_t id) {
    syms.push_back({id, static_cast<int>(syms.size()) - 1, static_cast<int>(syms.size()) + 1, true});
  };
  bool pending_unk = false;
  unicode::Decoded d = unicode::decode_utf8(piece);
  for (size_t i = 0; i < d.cps.size(); ++i) {
    std::string ch = piece.substr(d.offsets[i], d.offsets[i + 1] - d.offsets[i]);
    int32_t id = token_to_id(ch);
    if (id >= 0) {
      if (pending_unk) add(unk_id_);
      pending_unk = false;
      add(id);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char c : ch) all = all && byte_fallback_ids_[c] >= 0;
      if (all) {
        if (pending_unk) add(unk_id_);
        pending_unk = false;
        for (unsigned char c : ch) add(byte_fallback_ids_[c]);
        continue;
      }
    }
    if (unk_id_ >= 0) {
      if (pending_unk && !fuse_unk_) add(unk_id_);
      pending_unk = true;
    }
    // No unk token: the character is dropped (as HF does).
  }
  if (pending_unk) add(unk_id_);
  if (syms.empty()) return;
  syms.back().next = -1;

  struct Cand {
    int32_t rank;
    int pos;
    int32_t new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
  auto lookup = [&](int32_t a, int32_t b) -> const MergeInfo* {
    uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
    auto it = merges_.find(key);
    return it == merges_.end() ? nullptr : &it->second;
  };
  auto push_pair = [&](int pos) {
    int nx = syms[pos].next;
    if (nx < 0) return;
    if (const MergeInfo* m = lookup(syms[pos].id, syms[nx].id)) q.push({m->rank, pos, m->new_id});
  };
  for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) push_pair(i);

  // Lowest rank first, leftmost among equal ranks (HF's order).
  while (!q.empty()) {
    Cand c = q.top();
    q.pop();
    Sym& left = syms[c.pos];
    if (!left.alive || left.next < 0) continue;
    Sym& right = syms[left.next];
    const MergeInfo* m = lookup(left.id, right.id);
    if (!m || m->new_id != c.new_id || m->rank != c.rank) continue;  // stale entry
    left.id = c.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(c.pos);
  }
  for (int i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

void Tokenizer::encode_segment(const std::string& segment, bool at_start, std::vector<int32_t>& out) const {
  if (segment.empty()) return;
  std::string text = segment;
  if (normalizer_) normalizer_->apply(text);
  if (text.empty()) return;
  std::vector<std::string> pieces{text};
  if (pre_) pre_->apply(pieces, at_start);
  for (const auto& p : pieces) bpe(p, out);
}

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int32_t> out;
  size_t seg_start = 0;  // start of the pending plain-text segment
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    const AddedToken* hit = nullptr;
    for (const auto& a : added_) {  // longest first
      if (a.content.size() > n - i || text.compare(i, a.content.size(), a.content) != 0) continue;
      if (a.single_word) {
        size_t e = i + a.content.size();
        bool left_ok = (i == 0) || !is_word_byte(static_cast<unsigned char>(text[i - 1]));
        bool right_ok = (e == n) || !is_word_byte(static_cast<unsigned char>(text[e]));
        if (!left_ok || !right_ok) continue;
      }
      hit = &a;
      break;
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    if (hit->lstrip) {
      while (b > seg_start && is_ascii_space(text[b - 1])) --b;
    }
    if (hit->rstrip) {
      while (e < n && is_ascii_space(text[e])) ++e;
    }
    encode_segment(text.substr(seg_start, b - seg_start), seg_start == 0, out);
    out.push_back(hit->id);
    seg_start = e;
    i = e;
  }
  encode_segment(text.substr(seg_start), seg_start == 0, out);
  return out;
}

std::string Tokenizer::decode(const int32_t* ids, size_t n, bool skip_special) const {
  std::vector<std::string> toks;
  toks.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    int32_t id = ids[i];
    if (id < 0 || id >= vocab_size() || id_to_token_[id].empty()) continue;  // unknown id
    if (skip_special && special_[id]) continue;
    toks.push_back(id_to_token_[id]);
  }
  decoder_->apply(toks);
  std::string out;
  for (const auto& t : toks) out += t;
  return unicode::utf8_lossy(out);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  return decode(ids.data(), ids.size(), skip_special);
}

}  // namespace llmcore
