// BPE tokenizer reading a Hugging Face tokenizer.json: byte-level BPE (GPT-2,
// SmolLM2, Llama 3, Qwen 2) and SentencePiece-style BPE (Llama 2: Metaspace or
// Prepend/Replace normalizers, byte fallback).
//
// Encode pipeline (as in HF `tokenizers`, without the post-processor):
//   1. split the text on added tokens (leftmost-longest literal match; lstrip/rstrip/
//      single_word honoured); added tokens map straight to their ids,
//   2. each remaining segment goes through the normalizer (Prepend, Replace, Strip,
//      Sequence; NFC/NFKC treated as identity) and the pre-tokenizer: ByteLevel
//      (GPT-2 regex split + byte->unicode mapping), Split (Regex or String pattern,
//      all behaviours, invert), Digits, Metaspace, or a Sequence of these,
//   3. BPE over each piece with merge ranks (ignore_merges, byte_fallback, unk/fuse_unk).
// Decode = id -> token string, then the decoder chain (ByteLevel, Replace,
// ByteFallback, Fuse, Strip, Metaspace, Sequence), then UTF-8 (invalid -> U+FFFD).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace llmcore {

class Tokenizer {
 public:
  // Loads tokenizer.json; throws std::runtime_error with a readable message.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  static std::unique_ptr<Tokenizer> from_json_text(const std::string& text);
  ~Tokenizer();

  // Encodes text (no BOS/EOS or other post-processing).
  std::vector<int32_t> encode(const std::string& text) const;

  // Decodes ids to valid UTF-8 text. Special added tokens are dropped when
  // skip_special is true (HF's default).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const;
  std::string decode(const int32_t* ids, size_t n, bool skip_special) const;

  bool is_special(int32_t id) const;
  // One past the largest token id.
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  // -1 if the token string is not in the vocabulary.
  int32_t token_to_id(const std::string& token) const;
  const std::string& id_to_token(int32_t id) const;

  // One-line summary for diagnostics.
  std::string describe() const;

  // Pipeline stages, defined in tokenizer.cpp.
  struct Normalizer;
  struct PreTokenizer;
  struct Decoder;

 private:
  Tokenizer();

  struct AddedToken {
    int32_t id;
    std::string content;
    bool special;
    bool lstrip, rstrip, single_word;
  };
  struct MergeInfo {
    int32_t rank;
    int32_t new_id;
  };

  void build_from_json(const std::string& text);
  void bpe(const std::string& piece, std::vector<int32_t>& out) const;
  void encode_segment(const std::string& segment, bool at_start, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> special_;  // by id
  std::unordered_map<uint64_t, MergeInfo> merges_;
  std::vector<AddedToken> added_;  // sorted by content length, longest first
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_;
  std::unique_ptr<Decoder> decoder_;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  int32_t byte_fallback_ids_[256];  // "<0xXX>" tokens, -1 when absent
  std::string byte_to_unicode_[256];
};

}  // namespace llmcore
