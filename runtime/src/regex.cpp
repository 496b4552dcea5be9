#include "regex.h"

#include <stdexcept>
#include <type_traits>

#include "unicode.h"

namespace llmcore {

namespace {

// Non-owning reference to a callable (no allocation, unlike std::function).
template <typename Sig>
class FnRef;
template <typename R, typename... A>
class FnRef<R(A...)> {
 public:
  template <typename C,
            typename = std::enable_if_t<!std::is_same<std::decay_t<C>, FnRef>::value>>
  FnRef(C&& c)  // NOLINT(google-explicit-constructor)
      : obj_(const_cast<void*>(static_cast<const void*>(&c))),
        cb_([](void* o, A... a) -> R {
          return (*static_cast<std::remove_reference_t<C>*>(o))(a...);
        }) {}
  R operator()(A... a) const { return cb_(obj_, a...); }

 private:
  void* obj_;
  R (*cb_)(void*, A...);
};

using Cont = FnRef<bool(size_t)>;

char32_t ascii_fold(char32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }
char32_t ascii_other_case(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c >= 'a' && c <= 'z') return c - 32;
  return c;
}

uint32_t mask_for_property(std::string name, bool* ok) {
  using namespace unicode;
  *ok = true;
  auto bit = [](Category c) { return 1u << c; };
  // Normalize: drop spaces/underscores, case-insensitive.
  std::string n;
  for (char c : name) {
    if (c == ' ' || c == '_' || c == '-') continue;
    n.push_back(static_cast<char>((c >= 'A' && c <= 'Z') ? c + 32 : c));
  }
  if (n == "l" || n == "letter") return kLetterMask;
  if (n == "lu" || n == "uppercaseletter") return bit(Lu);
  if (n == "ll" || n == "lowercaseletter") return bit(Ll);
  if (n == "lt" || n == "titlecaseletter") return bit(Lt);
  if (n == "lm" || n == "modifierletter") return bit(Lm);
  if (n == "lo" || n == "otherletter") return bit(Lo);
  if (n == "l&" || n == "lc" || n == "casedletter") return bit(Lu) | bit(Ll) | bit(Lt);
  if (n == "m" || n == "mark" || n == "combiningmark") return kMarkMask;
  if (n == "mn" || n == "nonspacingmark") return bit(Mn);
  if (n == "mc" || n == "spacingmark") return bit(Mc);
  if (n == "me" || n == "enclosingmark") return bit(Me);
  if (n == "n" || n == "number") return kNumberMask;
  if (n == "nd" || n == "decimalnumber" || n == "digit") return bit(Nd);
  if (n == "nl" || n == "letternumber") return bit(Nl);
  if (n == "no" || n == "othernumber") return bit(No);
  if (n == "p" || n == "punctuation" || n == "punct") return kPunctMask;
  if (n == "pc" || n == "connectorpunctuation") return bit(Pc);
  if (n == "pd" || n == "dashpunctuation") return bit(Pd);
  if (n == "ps" || n == "openpunctuation") return bit(Ps);
  if (n == "pe" || n == "closepunctuation") return bit(Pe);
  if (n == "pi" || n == "initialpunctuation") return bit(Pi);
  if (n == "pf" || n == "finalpunctuation") return bit(Pf);
  if (n == "po" || n == "otherpunctuation") return bit(Po);
  if (n == "s" || n == "symbol") return kSymbolMask;
  if (n == "sm" || n == "mathsymbol") return bit(Sm);
  if (n == "sc" || n == "currencysymbol") return bit(Sc);
  if (n == "sk" || n == "modifiersymbol") return bit(Sk);
  if (n == "so" || n == "othersymbol") return bit(So);
  if (n == "z" || n == "separator") return kSeparatorMask;
  if (n == "zs" || n == "spaceseparator") return bit(Zs);
  if (n == "zl" || n == "lineseparator") return bit(Zl);
  if (n == "zp" || n == "paragraphseparator") return bit(Zp);
  if (n == "c" || n == "other") return kOtherMask;
  if (n == "cc" || n == "control" || n == "cntrl") return bit(Cc);
  if (n == "cf" || n == "format") return bit(Cf);
  if (n == "cs" || n == "surrogate") return bit(Cs);
  if (n == "co" || n == "privateuse") return bit(Co);
  if (n == "cn" || n == "unassigned") return bit(Cn);
  if (n == "any") return 0xFFFFFFFFu;
  *ok = false;
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------
class Regex::Parser {
 public:
  Parser(Regex& re, const std::string& pattern) : re_(re) {
    unicode::Decoded d = unicode::decode_utf8(pattern);
    p_ = std::move(d.cps);
  }

  int parse() {
    bool icase = false;
    int root = parse_alt(icase);
    if (pos_ != p_.size()) fail("unbalanced ')'");
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    throw std::runtime_error("regex: " + msg + " (at offset " + std::to_string(pos_) +
                             " in pattern '" + re_.pattern_ + "')");
  }
  bool at_end() const { return pos_ >= p_.size(); }
  char32_t peek() const { return p_[pos_]; }

  int add(Node n) {
    re_.nodes_.push_back(std::move(n));
    return static_cast<int>(re_.nodes_.size()) - 1;
  }

  int parse_alt(bool& icase) {
    std::vector<int> alts;
    alts.push_back(parse_seq(icase));
    while (!at_end() && peek() == '|') {
      ++pos_;
      alts.push_back(parse_seq(icase));
    }
    if (alts.size() == 1) return alts[0];
    Node n;
    n.kind = Node::Alt;
    n.kids = std::move(alts);
    return add(std::move(n));
  }

  int parse_seq(bool& icase) {
    std::vector<int> items;
    while (!at_end() && peek() != '|' && peek() != ')') {
      int atom = parse_atom(icase);
      if (atom < 0) continue;  // e.g. an inline flag group
      items.push_back(parse_quantifiers(atom));
    }
    if (items.size() == 1) return items[0];
    Node n;
    n.kind = items.empty() ? Node::Empty : Node::Seq;
    n.kids = std::move(items);
    return add(std::move(n));
  }

  bool parse_int(int* out) {
    size_t start = pos_;
    long v = 0;
    while (!at_end() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > 100000) fail("repeat count too large");
      ++pos_;
    }
    *out = static_cast<int>(v);
    return pos_ > start;
  }

  int parse_quantifiers(int atom) {
    while (!at_end()) {
      char32_t c = peek();
      int mn, mx;
      if (c == '*') { mn = 0; mx = -1; ++pos_; }
      else if (c == '+') { mn = 1; mx = -1; ++pos_; }
      else if (c == '?') { mn = 0; mx = 1; ++pos_; }
      else if (c == '{') {
        size_t save = pos_;
        ++pos_;
        int a = 0, b = 0;
        bool has_a = parse_int(&a);
        if (!at_end() && peek() == ',') {
          ++pos_;
          bool has_b = parse_int(&b);
          if (!has_a) a = 0;
          mn = a;
          mx = has_b ? b : -1;
        } else {
          mn = mx = a;
          if (!has_a) { pos_ = save; return atom; }
        }
        if (at_end() || peek() != '}') {
          // Not a quantifier: treat '{' as a literal (Oniguruma does the same).
          pos_ = save;
          return atom;
        }
        ++pos_;
        if (mx >= 0 && mx < mn) fail("bad repeat range");
      } else {
        return atom;
      }
      Node n;
      n.kind = Node::Repeat;
      n.min = mn;
      n.max = mx;
      n.kids = {atom};
      if (!at_end() && peek() == '?') { n.greedy = false; ++pos_; }
      else if (!at_end() && peek() == '+') { n.possessive = true; ++pos_; }
      atom = add(std::move(n));
    }
    return atom;
  }

  // Parses flags like "i", "-i", "i-x" up to ':' or ')'. Returns the new icase.
  bool parse_flags(bool icase) {
    bool on = true;
    while (!at_end() && peek() != ':' && peek() != ')') {
      char32_t c = peek();
      if (c == '-') on = false;
      else if (c == 'i') icase = on;
      else if (c == 'x' || c == 'm' || c == 's' || c == 'u') { /* ignored */ }
      else fail("unsupported group flag");
      ++pos_;
    }
    return icase;
  }

  int parse_atom(bool& icase) {
    char32_t c = peek();
    if (c == '(') {
      ++pos_;
      Node g;
      g.kind = Node::Group;
      bool inner_icase = icase;
      if (!at_end() && peek() == '?') {
        ++pos_;
        if (at_end()) fail("truncated group");
        char32_t k = peek();
        if (k == ':') { ++pos_; }
        else if (k == '=') { ++pos_; g.kind = Node::LookAhead; }
        else if (k == '!') { ++pos_; g.kind = Node::NegLookAhead; }
        else if (k == '<' || k == 'P' || k == '\'') { fail("lookbehind/named groups are not supported"); }
        else if (k == '>') { ++pos_; /* atomic group: treated as plain group */ }
        else {
          bool f = parse_flags(icase);
          if (at_end()) fail("truncated group");
          if (peek() == ')') {  // inline flags: apply to the rest of the enclosing group
            ++pos_;
            icase = f;
            return -1;
          }
          ++pos_;  // ':'
          inner_icase = f;
        }
      }
      int inner = parse_alt(inner_icase);
      if (at_end() || peek() != ')') fail("missing ')'");
      ++pos_;
      g.kids = {inner};
      return add(std::move(g));
    }
    if (c == '[') return parse_class(icase);
    if (c == '.') {
      ++pos_;
      Node n;
      n.kind = Node::Any;
      return add(std::move(n));
    }
    if (c == '^') { ++pos_; Node n; n.kind = Node::LineStart; return add(std::move(n)); }
    if (c == '$') { ++pos_; Node n; n.kind = Node::LineEnd; return add(std::move(n)); }
    if (c == '*' || c == '+' || c == '?') fail("nothing to repeat");
    if (c == '\\') {
      ++pos_;
      if (at_end()) fail("trailing backslash");
      char32_t e = peek();
      if (e == 'A') { ++pos_; Node n; n.kind = Node::TextStart; return add(std::move(n)); }
      if (e == 'z' || e == 'Z') { ++pos_; Node n; n.kind = Node::TextEnd; return add(std::move(n)); }
      if (e >= '1' && e <= '9') fail("backreferences are not supported");
      Node n;
      ClassItem item;
      if (parse_class_escape(&item)) {
        n.kind = Node::Class;
        n.items.push_back(item);
        n.icase = icase;
        return add(std::move(n));
      }
      n.kind = Node::Char;
      n.ch = parse_char_escape();
      n.icase = icase;
      return add(std::move(n));
    }
    ++pos_;
    Node n;
    n.kind = Node::Char;
    n.ch = c;
    n.icase = icase;
    return add(std::move(n));
  }

  // After a backslash: \s \S \d \D \w \W \p{..} \P{..} \h \H. Consumes and fills
  // *item if it is one of these; otherwise leaves pos_ alone and returns false.
  bool parse_class_escape(ClassItem* item) {
    char32_t e = peek();
    item->negated = false;
    switch (e) {
      case 's': ++pos_; item->kind = ClassItem::Space; return true;
      case 'S': ++pos_; item->kind = ClassItem::NotSpace; return true;
      case 'd': case 'D':
        ++pos_;
        item->kind = ClassItem::CategoryMask;
        item->mask = 1u << unicode::Nd;
        item->negated = (e == 'D');
        return true;
      case 'w': case 'W':
        ++pos_;
        item->kind = ClassItem::CategoryMask;
        item->mask = unicode::kLetterMask | unicode::kMarkMask | (1u << unicode::Nd) |
                     (1u << unicode::Pc);
        item->negated = (e == 'W');
        return true;
      case 'p': case 'P': {
        ++pos_;
        std::string name;
        if (!at_end() && peek() == '{') {
          ++pos_;
          while (!at_end() && peek() != '}') {
            if (peek() > 0x7F) fail("bad property name");
            name.push_back(static_cast<char>(peek()));
            ++pos_;
          }
          if (at_end()) fail("unterminated \\p{");
          ++pos_;
        } else if (!at_end()) {
          name.push_back(static_cast<char>(peek()));
          ++pos_;
        }
        bool neg = (e == 'P');
        if (!name.empty() && name[0] == '^') { neg = !neg; name.erase(0, 1); }
        bool ok = false;
        uint32_t m = mask_for_property(name, &ok);
        if (!ok) fail("unsupported Unicode property '" + name + "'");
        item->kind = ClassItem::CategoryMask;
        item->mask = m;
        item->negated = neg;
        return true;
      }
      default:
        return false;
    }
  }

  unsigned hex_value(char32_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    fail("bad hex digit");
  }

  // After a backslash: a single-character escape. Consumes it.
  char32_t parse_char_escape() {
    char32_t e = peek();
    ++pos_;
    switch (e) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case 'f': return '\f';
      case 'v': return '\v';
      case 'a': return 0x07;
      case 'e': return 0x1B;
      case '0': return 0;
      case 'x': {
        char32_t v = 0;
        if (!at_end() && peek() == '{') {
          ++pos_;
          while (!at_end() && peek() != '}') { v = v * 16 + hex_value(peek()); ++pos_; }
          if (at_end()) fail("unterminated \\x{");
          ++pos_;
        } else {
          for (int i = 0; i < 2 && !at_end(); ++i) { v = v * 16 + hex_value(peek()); ++pos_; }
        }
        return v;
      }
      case 'u': {
        char32_t v = 0;
        for (int i = 0; i < 4; ++i) {
          if (at_end()) fail("truncated \\u");
          v = v * 16 + hex_value(peek());
          ++pos_;
        }
        return v;
      }
      default:
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
          fail(std::string("unsupported escape \\") + static_cast<char>(e));
        }
        return e;  // escaped punctuation / literal
    }
  }

  int parse_class(bool icase) {
    ++pos_;  // '['
    Node n;
    n.kind = Node::Class;
    n.icase = icase;
    if (!at_end() && peek() == '^') { n.class_negated = true; ++pos_; }
    bool first = true;
    while (true) {
      if (at_end()) fail("unterminated character class");
      char32_t c = peek();
      if (c == ']' && !first) { ++pos_; break; }
      first = false;
      if (c == '[') fail("nested character classes are not supported");
      char32_t lo;
      if (c == '\\') {
        ++pos_;
        if (at_end()) fail("trailing backslash");
        ClassItem item;
        if (parse_class_escape(&item)) {
          n.items.push_back(item);
          continue;
        }
        lo = parse_char_escape();
      } else {
        lo = c;
        ++pos_;
      }
      char32_t hi = lo;
      if (pos_ + 1 < p_.size() && peek() == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        char32_t d = peek();
        if (d == '\\') {
          ++pos_;
          if (at_end()) fail("trailing backslash");
          hi = parse_char_escape();
        } else {
          hi = d;
          ++pos_;
        }
        if (hi < lo) fail("bad class range");
      }
      ClassItem item;
      item.kind = ClassItem::Range;
      item.lo = lo;
      item.hi = hi;
      n.items.push_back(item);
    }
    return add(std::move(n));
  }

  Regex& re_;
  std::vector<char32_t> p_;
  size_t pos_ = 0;
};

// ---------------------------------------------------------------------------
// Matcher
// ---------------------------------------------------------------------------
bool Regex::class_matches(const Node& n, char32_t c) const {
  bool hit = false;
  for (const ClassItem& it : n.items) {
    switch (it.kind) {
      case ClassItem::Range:
        if (c >= it.lo && c <= it.hi) hit = true;
        else if (n.icase) {
          char32_t o = ascii_other_case(c);
          if (o != c && o >= it.lo && o <= it.hi) hit = true;
        }
        break;
      case ClassItem::CategoryMask:
        if (c < unicode::kInvalidByteBase) {
          bool in = (it.mask >> unicode::category(c)) & 1u;
          if (in != it.negated) hit = true;
        } else if (it.negated) {
          hit = true;  // raw invalid bytes are in no category
        }
        break;
      case ClassItem::Space:
        if (unicode::is_whitespace(c)) hit = true;
        break;
      case ClassItem::NotSpace:
        if (!unicode::is_whitespace(c)) hit = true;
        break;
    }
    if (hit) break;
  }
  return hit != n.class_negated;
}

bool Regex::char_matches(const Node& n, char32_t c) const {
  switch (n.kind) {
    case Node::Char:
      return c == n.ch || (n.icase && ascii_fold(c) == ascii_fold(n.ch));
    case Node::Class:
      return class_matches(n, c);
    case Node::Any:
      return c != '\n';
    default:
      return false;
  }
}

bool Regex::single_char(int node) const {
  auto k = nodes_[node].kind;
  return k == Node::Char || k == Node::Class || k == Node::Any;
}

class Regex::Matcher {
 public:
  Matcher(const Regex& re, const std::vector<char32_t>& text) : re_(re), t_(text) {}

  bool m(int id, size_t i, Cont k) {
    if (++steps_ > kMaxSteps) throw std::runtime_error("regex: backtracking limit exceeded");
    const Node& n = re_.nodes_[id];
    switch (n.kind) {
      case Node::Empty:
        return k(i);
      case Node::Char:
      case Node::Class:
      case Node::Any:
        return i < t_.size() && re_.char_matches(n, t_[i]) && k(i + 1);
      case Node::Seq:
        return seq(n, 0, i, k);
      case Node::Alt:
        for (int kid : n.kids) {
          if (m(kid, i, k)) return true;
        }
        return false;
      case Node::Group:
        return m(n.kids[0], i, k);
      case Node::LookAhead: {
        auto accept = [](size_t) { return true; };
        if (!m(n.kids[0], i, accept)) return false;
        return k(i);
      }
      case Node::NegLookAhead: {
        auto accept = [](size_t) { return true; };
        if (m(n.kids[0], i, accept)) return false;
        return k(i);
      }
      case Node::LineStart:
        return (i == 0 || t_[i - 1] == '\n') && k(i);
      case Node::LineEnd:
        return (i == t_.size() || t_[i] == '\n') && k(i);
      case Node::TextStart:
        return i == 0 && k(i);
      case Node::TextEnd:
        return i == t_.size() && k(i);
      case Node::Repeat:
        return repeat(n, i, k);
    }
    return false;
  }

 private:
  static constexpr size_t kMaxSteps = 50u * 1000u * 1000u;

  bool seq(const Node& n, size_t j, size_t i, Cont k) {
    if (j == n.kids.size()) return k(i);
    auto next = [&](size_t p) { return seq(n, j + 1, p, k); };
    return m(n.kids[j], i, next);
  }

  bool repeat(const Node& n, size_t i, Cont k) {
    int kid = n.kids[0];
    if (re_.single_char(kid)) {
      // Fast path: count the run once, then backtrack over run lengths
      // without recursion.
      const Node& c = re_.nodes_[kid];
      size_t limit = n.max < 0 ? t_.size() - i : std::min<size_t>(n.max, t_.size() - i);
      size_t run = 0;
      while (run < limit && re_.char_matches(c, t_[i + run])) ++run;
      size_t mn = static_cast<size_t>(n.min);
      if (run < mn) return false;
      if (n.possessive) return k(i + run);
      if (n.greedy) {
        for (size_t r = run + 1; r-- > mn;) {
          if (k(i + r)) return true;
        }
      } else {
        for (size_t r = mn; r <= run; ++r) {
          if (k(i + r)) return true;
        }
      }
      return false;
    }
    return rep(n, 0, i, k);
  }

  bool rep(const Node& n, int count, size_t i, Cont k) {
    bool can_more = n.max < 0 || count < n.max;
    auto more = [&](size_t j) {
      if (j == i && count >= n.min) return false;  // no progress: stop looping
      return rep(n, count + 1, j, k);
    };
    if (n.greedy || n.possessive) {
      if (can_more && m(n.kids[0], i, more)) return true;
      return count >= n.min && k(i);
    }
    if (count >= n.min && k(i)) return true;
    return can_more && m(n.kids[0], i, more);
  }

  const Regex& re_;
  const std::vector<char32_t>& t_;
  size_t steps_ = 0;
};

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  Parser p(*this, pattern);
  root_ = p.parse();
}

bool Regex::search(const std::vector<char32_t>& cps, size_t from, size_t* match_begin,
                   size_t* match_end) const {
  Matcher mt(*this, cps);
  for (size_t s = from; s <= cps.size(); ++s) {
    size_t end = 0;
    auto accept = [&](size_t e) {
      end = e;
      return true;
    };
    if (mt.m(root_, s, accept)) {
      *match_begin = s;
      *match_end = end;
      return true;
    }
  }
  return false;
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::vector<char32_t>& cps) const {
  std::vector<std::pair<size_t, size_t>> out;
  size_t pos = 0;
  while (pos < cps.size()) {
    size_t b = 0, e = 0;
    if (!search(cps, pos, &b, &e)) break;
    if (e == b) {
      pos = b + 1;
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
  }
  return out;
}

}  // namespace llmcore
