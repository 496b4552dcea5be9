#include "unicode.h"

#include <algorithm>

namespace llmcore {
namespace unicode {

namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if the sequence is
// invalid; *prefix_len receives how many bytes form the maximal (possibly
// incomplete) valid prefix, *truncated is set if the input ended mid-sequence.
size_t utf8_seq(const unsigned char* s, size_t n, size_t i, size_t* prefix_len, bool* truncated) {
  unsigned char b = s[i];
  *truncated = false;
  if (b < 0x80) { *prefix_len = 1; return 1; }
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) { need = 1; }
  else if (b == 0xE0) { need = 2; lo = 0xA0; }
  else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) { need = 2; }
  else if (b == 0xED) { need = 2; hi = 0x9F; }
  else if (b == 0xF0) { need = 3; lo = 0x90; }
  else if (b >= 0xF1 && b <= 0xF3) { need = 3; }
  else if (b == 0xF4) { need = 3; hi = 0x8F; }
  else { *prefix_len = 1; return 0; }
  size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= n) { *prefix_len = k; *truncated = true; return 0; }
    unsigned char c = s[i + k];
    unsigned char l = (k == 1) ? lo : 0x80, h = (k == 1) ? hi : 0xBF;
    if (c < l || c > h) { *prefix_len = k; return 0; }
  }
  *prefix_len = need + 1;
  return need + 1;
}

char32_t decode_at(const unsigned char* s, size_t i, size_t len) {
  if (len == 1) return s[i];
  if (len == 2) return ((s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
  if (len == 3) return ((s[i] & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
  return ((s[i] & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) |
         (s[i + 3] & 0x3F);
}

}  // namespace

bool is_whitespace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029:
    case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

Decoded decode_utf8(const std::string& str) {
  Decoded d;
  const unsigned char* s = reinterpret_cast<const unsigned char*>(str.data());
  size_t n = str.size();
  d.cps.reserve(n);
  d.offsets.reserve(n + 1);
  size_t i = 0;
  while (i < n) {
    size_t prefix = 0;
    bool truncated = false;
    size_t len = utf8_seq(s, n, i, &prefix, &truncated);
    d.offsets.push_back(i);
    if (len == 0) {
      d.cps.push_back(kInvalidByteBase + s[i]);
      i += 1;
    } else {
      d.cps.push_back(decode_at(s, i, len));
      i += len;
    }
  }
  d.offsets.push_back(n);
  return d;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp >= kInvalidByteBase) {  // raw byte stand-in
    out.push_back(static_cast<char>(cp - kInvalidByteBase));
  } else if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(const std::string& bytes) {
  const unsigned char* s = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size();
  std::string out;
  out.reserve(n);
  size_t i = 0;
  while (i < n) {
    size_t prefix = 0;
    bool truncated = false;
    size_t len = utf8_seq(s, n, i, &prefix, &truncated);
    if (len > 0) {
      out.append(bytes, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for the maximal invalid subpart
      i += std::max<size_t>(prefix, 1);
    }
  }
  return out;
}

size_t utf8_stream_prefix(const std::string& bytes) {
  const unsigned char* s = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    size_t prefix = 0;
    bool truncated = false;
    size_t len = utf8_seq(s, n, i, &prefix, &truncated);
    if (len > 0) {
      i += len;
    } else if (truncated) {
      return i;  // may still be completed by the next token's bytes
    } else {
      i += std::max<size_t>(prefix, 1);
    }
  }
  return n;
}

}  // namespace unicode
}  // namespace llmcore
