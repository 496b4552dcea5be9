// Unicode helpers for the tokenizer: UTF-8 decode/encode, general categories, whitespace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace llmcore {
namespace unicode {

// General categories, in the order used by unicode_tables.inc.
enum Category : uint8_t {
  Cn = 0, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No,
  Pc, Pd, Ps, Pe, Pi, Pf, Po, Sm, Sc, Sk, So,
  Zs, Zl, Zp, Cc, Cf, Cs, Co,
  kNumCategories
};

// Code points >= kInvalidByteBase stand for bytes of invalid UTF-8 input
// (kInvalidByteBase + byte value). They belong to no category.
constexpr char32_t kInvalidByteBase = 0x110000;

Category category(char32_t cp);
inline uint32_t category_bit(Category c) { return 1u << c; }

constexpr uint32_t kLetterMask = (1u << Lu) | (1u << Ll) | (1u << Lt) | (1u << Lm) | (1u << Lo);
constexpr uint32_t kMarkMask = (1u << Mn) | (1u << Mc) | (1u << Me);
constexpr uint32_t kNumberMask = (1u << Nd) | (1u << Nl) | (1u << No);
constexpr uint32_t kPunctMask = (1u << Pc) | (1u << Pd) | (1u << Ps) | (1u << Pe) | (1u << Pi) |
                                (1u << Pf) | (1u << Po);
constexpr uint32_t kSymbolMask = (1u << Sm) | (1u << Sc) | (1u << Sk) | (1u << So);
constexpr uint32_t kSeparatorMask = (1u << Zs) | (1u << Zl) | (1u << Zp);
constexpr uint32_t kOtherMask = (1u << Cn) | (1u << Cc) | (1u << Cf) | (1u << Cs) | (1u << Co);

inline bool in_mask(char32_t cp, uint32_t mask) {
  if (cp >= kInvalidByteBase) return false;
  return (mask >> category(cp)) & 1u;
}
inline bool is_letter(char32_t cp) { return in_mask(cp, kLetterMask); }
inline bool is_number(char32_t cp) { return in_mask(cp, kNumberMask); }
// Unicode White_Space property (what \s matches in Oniguruma / HF tokenizers).
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
