#include "regex.h"

#define PCRE2_CODE_UNIT_WIDTH 32
#include <pcre2.h>

#include <stdexcept>

#include "unicode.h"

namespace llmcore {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  int n = pcre2_get_error_message(code, buffer, sizeof(buffer) / sizeof(buffer[0]));
  std::string out;
  for (int i = 0; i < n; ++i) unicode::append_utf8(out, static_cast<char32_t>(buffer[i]));
  return out;
}

pcre2_code* code_of(void* p) { return static_cast<pcre2_code*>(p); }
pcre2_match_data* data_of(void* p) { return static_cast<pcre2_match_data*>(p); }

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  unicode::Decoded d = unicode::decode_utf8(pattern);
  for (char32_t c : d.cps) {
    if (c >= unicode::kInvalidByteBase) throw std::runtime_error("regex pattern is not valid UTF-8: " + pattern);
  }
  std::u32string units(d.cps.begin(), d.cps.end());
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(units.data()), units.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  if (code == nullptr) {
    throw std::runtime_error("regex " + pattern + " does not compile (PCRE2, at code point " +
                             std::to_string(offset) + "): " + pcre2_message(error));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // an error here only means the interpreter runs it
  code_ = code;
  match_data_ = pcre2_match_data_create_from_pattern(code, nullptr);
  if (match_data_ == nullptr) {
    pcre2_code_free(code);
    throw std::bad_alloc();
  }
}

Regex::~Regex() {
  pcre2_match_data_free(data_of(match_data_));
  pcre2_code_free(code_of(code_));
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::vector<char32_t>& cps) const {
  std::u32string subject(cps.begin(), cps.end());
  for (char32_t& c : subject) {  // valid UTF-32 throughout, so PCRE2 need not check it per match
    if (c >= unicode::kInvalidByteBase || (c >= 0xD800 && c <= 0xDFFF)) c = 0xFFFD;
  }
  const auto* units = reinterpret_cast<PCRE2_SPTR>(subject.data());
  std::vector<std::pair<size_t, size_t>> out;
  size_t pos = 0;
  while (pos < subject.size()) {
    int rc = pcre2_match(code_of(code_), units, subject.size(), pos, PCRE2_NO_UTF_CHECK, data_of(match_data_),
                         nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw std::runtime_error("regex " + pattern_ + " failed on its input: " + pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data_of(match_data_));
    size_t b = ovector[0], e = ovector[1];
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
