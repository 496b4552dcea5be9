// Minimal JSON reader for llmcore_runner (tokenizer.json and friends).
//
// Small DOM: null, bool, number (kept both as double and, when integral, int64),
// string (UTF-8, \uXXXX escapes incl. surrogate pairs decoded), array, object
// (insertion order kept, lookups are linear: fine for the handful of keys we read;
// big objects such as a BPE vocab are iterated, not searched).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "unicode.h"

namespace llmcore {
namespace json {

class Value {
 public:
  enum class Type { Null, Bool, Number, String, Array, Object };

  Value() = default;

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }

  bool as_bool() const { check(Type::Bool, "bool"); return b_; }
  double as_double() const { check(Type::Number, "number"); return num_; }
  int64_t as_int() const {
    check(Type::Number, "number");
    return is_int_ ? int_ : static_cast<int64_t>(num_);
  }
  const std::string& as_string() const { check(Type::String, "string"); return str_; }
  const std::vector<Value>& as_array() const { check(Type::Array, "array"); return arr_; }
  const std::vector<std::pair<std::string, Value>>& as_object() const {
    check(Type::Object, "object");
    return obj_;
  }

  // Object member lookup; nullptr when absent or when this is not an object.
  const Value* find(const std::string& key) const {
    if (type_ != Type::Object) return nullptr;
    for (const auto& kv : obj_) {
      if (kv.first == key) return &kv.second;
    }
    return nullptr;
  }
  // Convenience accessors with defaults.
  std::string get_string(const std::string& key, const std::string& dflt = "") const {
    const Value* v = find(key);
    return (v && v->is_string()) ? v->str_ : dflt;
  }
  bool get_bool(const std::string& key, bool dflt) const {
    const Value* v = find(key);
    return (v && v->is_bool()) ? v->b_ : dflt;
  }

  static Value parse(const std::string& text);

 private:
  friend class Parser;
  void check(Type t, const char* what) const {
    if (type_ != t) throw std::runtime_error(std::string("json: value is not a ") + what);
  }

  Type type_ = Type::Null;
  bool b_ = false;
  bool is_int_ = false;
  double num_ = 0.0;
  int64_t int_ = 0;
  std::string str_;
  std::vector<Value> arr_;
  std::vector<std::pair<std::string, Value>> obj_;
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}

  Value parse_document() {
    Value v;
    skip_ws();
    parse_value(v, 0);
    skip_ws();
    if (pos_ != s_.size()) fail("trailing characters after JSON value");
    return v;
  }

 private:
  // Arrays and objects inside one another, at most: parse_value recurses once per level, so a
  // document of 100,000 '[' would overflow the stack. The same limit as llmcore's Python
  // readers (llmcore/nesting.py), so both runners refuse the same files.
  static constexpr int kMaxDepth = 512;

  [[noreturn]] void fail(const std::string& msg) const {
    // Report line/column for humans.
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') { ++line; col = 1; } else { ++col; }
    }
    throw std::runtime_error("json parse error at line " + std::to_string(line) + ", column " +
                             std::to_string(col) + ": " + msg);
  }

  void skip_ws() {
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') ++pos_; else break;
    }
  }

  bool consume_literal(const char* lit) {
    size_t n = 0;
    while (lit[n]) ++n;
    if (s_.compare(pos_, n, lit) == 0) { pos_ += n; return true; }
    return false;
  }

  // `depth`: the arrays and objects around this value.
  void parse_value(Value& out, int depth) {
    if (pos_ >= s_.size()) fail("unexpected end of input");
    char c = s_[pos_];
    if ((c == '{' || c == '[') && depth >= kMaxDepth) {
      fail("nesting too deep: more than " + std::to_string(kMaxDepth) + " arrays or objects inside one another");
    }
    switch (c) {
      case '{': parse_object(out, depth); return;
      case '[': parse_array(out, depth); return;
      case '"': out.type_ = Value::Type::String; parse_string(out.str_); return;
      case 't':
        if (!consume_literal("true")) fail("invalid literal");
        out.type_ = Value::Type::Bool; out.b_ = true; return;
      case 'f':
        if (!consume_literal("false")) fail("invalid literal");
        out.type_ = Value::Type::Bool; out.b_ = false; return;
      case 'n':
        if (!consume_literal("null")) fail("invalid literal");
        out.type_ = Value::Type::Null; return;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) { parse_number(out); return; }
        fail(std::string("unexpected character '") + c + "'");
    }
  }

  void parse_object(Value& out, int depth) {
    out.type_ = Value::Type::Object;
    ++pos_;  // '{'
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return; }
    while (true) {
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected object key string");
      std::string key;
      parse_string(key);
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != ':') fail("expected ':'");
      ++pos_;
      skip_ws();
      out.obj_.emplace_back(std::move(key), Value());
      parse_value(out.obj_.back().second, depth + 1);
      skip_ws();
      if (pos_ >= s_.size()) fail("unterminated object");
      if (s_[pos_] == ',') { ++pos_; continue; }
      if (s_[pos_] == '}') { ++pos_; return; }
      fail("expected ',' or '}'");
    }
  }

  void parse_array(Value& out, int depth) {
    out.type_ = Value::Type::Array;
    ++pos_;  // '['
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return; }
    while (true) {
      skip_ws();
      out.arr_.emplace_back();
      parse_value(out.arr_.back(), depth + 1);
      skip_ws();
      if (pos_ >= s_.size()) fail("unterminated array");
      if (s_[pos_] == ',') { ++pos_; continue; }
      if (s_[pos_] == ']') { ++pos_; return; }
      fail("expected ',' or ']'");
    }
  }

  void parse_number(Value& out) {
    size_t start = pos_;
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    auto digits = [&]() {
      size_t d = 0;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') { ++pos_; ++d; }
      return d;
    };
    if (digits() == 0) fail("invalid number");
    if (pos_ < s_.size() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (digits() == 0) fail("invalid number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) fail("invalid number");
    }
    std::string tok = s_.substr(start, pos_ - start);
    out.type_ = Value::Type::Number;
    out.num_ = std::strtod(tok.c_str(), nullptr);
    if (integral) {
      errno = 0;
      long long v = std::strtoll(tok.c_str(), nullptr, 10);
      if (errno == 0) { out.is_int_ = true; out.int_ = v; }
    }
  }

  unsigned parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f') v |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= unsigned(c - 'A' + 10);
      else fail("invalid hex digit in \\u escape");
    }
    return v;
  }

  void parse_string(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return;
      if (c != '\\') { out.push_back(c); continue; }
      if (pos_ >= s_.size()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            // High surrogate: combine with a following low surrogate if present.
            if (pos_ + 6 <= s_.size() && s_[pos_] == '\\' && s_[pos_ + 1] == 'u') {
              size_t save = pos_;
              pos_ += 2;
              uint32_t lo = parse_hex4();
              if (lo >= 0xDC00 && lo <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
              } else {
                pos_ = save;
                cp = 0xFFFD;
              }
            } else {
              cp = 0xFFFD;
            }
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            cp = 0xFFFD;
          }
          unicode::append_utf8(out, static_cast<char32_t>(cp));
          break;
        }
        default:
          fail(std::string("invalid escape '\\") + e + "'");
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

inline Value Value::parse(const std::string& text) { return Parser(text).parse_document(); }

// Serialize a UTF-8 string as a JSON string literal (used by tools/tests output).
inline std::string quote(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          static const char* hex = "0123456789abcdef";
          out += "\\u00";
          out.push_back(hex[c >> 4]);
          out.push_back(hex[c & 15]);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace json
}  // namespace llmcore
