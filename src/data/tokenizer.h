// Tokenizers: the built-in byte-level one (ids 0..255 are bytes, 256 is end-of-text) and
// SentencePiece models (Debian's libsentencepiece), trained and used through one interface.
// decode() drops the eot id and renders ids outside the vocabulary as U+FFFD, so printing
// samples of a model with a padded vocabulary never throws.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int vocab_size() const = 0;
  virtual int eot() const = 0;  // end-of-text id, appended between documents
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
};

// spec: "byte" or the path of a SentencePiece .model file. A SentencePiece model's eot is
// its eos id when it defines one, else vocab_size - 1. A missing or corrupt file throws.
std::unique_ptr<Tokenizer> tokenizer_make(const std::string& spec);

// Trains a SentencePiece model (BPE) on a text file; writes <prefix>.model and <prefix>.vocab.
// Lossless: byte fallback, identity normalization, whitespace kept as is; digits split; ids
// 0/1/2 are unk/bos/eos. vocab_size (>= 260) is an upper bound on a small corpus. Each line
// of the file is one training sentence. Two threads, warnings and errors only.
void sentencepiece_train(const std::string& text_path, const std::string& model_prefix, int vocab_size);

}  // namespace mt
