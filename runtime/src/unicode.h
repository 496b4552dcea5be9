// Unicode helpers for the tokenizer: UTF-8 decode/encode, whitespace. (Character classes
// such as \p{L} and \p{N} are PCRE2's: see regex.h.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace llmcore {
namespace unicode {

constexpr char32_t kInvalidByteBase = 0x110000;  // + byte: an invalid UTF-8 byte, as decode_utf8 reports it

bool is_whitespace(char32_t cp);

// Decoded text: code points plus the byte offset where each one starts
// (offsets has cps.size() + 1 entries; the last is the byte length).
struct Decoded {
  std::vector<char32_t> cps;
  std::vector<size_t> offsets;
};
Decoded decode_utf8(const std::string& s);

void append_utf8(std::string& out, char32_t cp);

// Replace each maximal invalid UTF-8 subsequence with U+FFFD (like Rust's
// String::from_utf8_lossy, which HF tokenizers uses when decoding).
std::string utf8_lossy(const std::string& bytes);

// Length of the longest prefix of `bytes` that does not end inside a UTF-8
// sequence that could still be completed by more bytes. Used for streaming.
size_t utf8_stream_prefix(const std::string& bytes);

}  // namespace unicode
}  // namespace llmcore
