// llmcore_tokenize: exercise the runner's tokenizer on its own (tests, debugging).
//
//   llmcore_tokenize TOKENIZER.json --info
//   llmcore_tokenize TOKENIZER.json --encode TEXT          -> "id id id"
//   llmcore_tokenize TOKENIZER.json --decode "id id id" [--keep-special]
//   llmcore_tokenize TOKENIZER.json --encode-json          stdin: ["text", ...]  stdout: [[ids], ...]
//   llmcore_tokenize TOKENIZER.json --decode-json [--keep-special]
//                                                          stdin: [[ids], ...]   stdout: ["text", ...]
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include "json.h"
#include "tokenizer.h"

using llmcore::Tokenizer;
namespace json = llmcore::json;

static int usage() {
  std::fprintf(stderr,
               "usage: llmcore_tokenize TOKENIZER.json (--info | --encode TEXT | --decode \"IDS\" | "
               "--encode-json | --decode-json) [--keep-special]\n");
  return 2;
}

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  std::string path = argv[1];
  std::string mode = argv[2];
  std::string arg;
  bool skip_special = true;
  for (int i = 3; i < argc; ++i) {
    if (std::strcmp(argv[i], "--keep-special") == 0) skip_special = false;
    else arg = argv[i];
  }
  try {
    std::unique_ptr<Tokenizer> tok = Tokenizer::load(path);
    if (mode == "--info") {
      std::printf("%s\n", tok->describe().c_str());
    } else if (mode == "--encode") {
      auto ids = tok->encode(arg);
      for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %d" : "%d", ids[i]);
      std::printf("\n");
    } else if (mode == "--decode") {
      std::vector<int32_t> ids;
      std::istringstream ss(arg);
      long v;
      while (ss >> v) ids.push_back(static_cast<int32_t>(v));
      std::string s = tok->decode(ids, skip_special);
      std::fwrite(s.data(), 1, s.size(), stdout);
      std::printf("\n");
    } else if (mode == "--encode-json" || mode == "--decode-json") {
      std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
      json::Value v = json::Value::parse(input);
      std::string out = "[";
      bool first = true;
      for (const auto& item : v.as_array()) {
        if (!first) out += ",";
        first = false;
        if (mode == "--encode-json") {
          auto ids = tok->encode(item.as_string());
          out += "[";
          for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
          out += "]";
        } else {
          std::vector<int32_t> ids;
          for (const auto& x : item.as_array()) ids.push_back(static_cast<int32_t>(x.as_int()));
          out += json::quote(tok->decode(ids, skip_special));
        }
      }
      out += "]\n";
      std::fwrite(out.data(), 1, out.size(), stdout);
    } else {
      return usage();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmcore_tokenize: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
