// The byte-level tokenizer and a wrapper around Debian's libsentencepiece.
//
// Both decode end-of-text to nothing and ids outside the vocabulary to U+FFFD, so that
// printing samples from a model whose vocabulary is padded never throws.
#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <regex>
#include <fstream>
#include <string>
#include <unordered_map>

#include "core/error.h"
#include "core/message.h"

namespace mt {
namespace {

constexpr const char* kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// ids 0..255 are the bytes of the UTF-8 text, 256 is end-of-text.
class ByteTokenizer final : public Tokenizer {
 public:
  int vocab_size() const override { return 257; }
  int eot() const override { return 256; }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int32_t id : ids) {
      if (id >= 0 && id < 256) {
        out.push_back(static_cast<char>(id));
      } else if (id != 256) {
        out += kReplacement;
      }
    }
    return out;
  }
};

// A trained SentencePiece model. Its eot is the model's eos id when the model defines one
// (sentencepiece_train always does), else vocab_size - 1.
class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) {
    const std::string kind = not_regular_kind(path);  // a FIFO would block the open below
    MT_CHECK(kind.empty(), path << " is " << kind << "; the tokenizer must be \"byte\" or the path of a "
                                                     "SentencePiece .model file");
    std::ifstream probe(path, std::ios::binary);
    MT_CHECK(probe, "cannot open SentencePiece model " << path << ": " << std::strerror(errno)
                                                       << "; the tokenizer must be \"byte\" or the path of "
                                                          "an existing .model file");
    sentencepiece::util::Status status;
    try {
      status = sp_.Load(path);
    } catch (const std::exception& e) {  // the library's stream reports a read that fails by throwing
      MT_FAIL("cannot read SentencePiece model " << path << ": " << e.what());
    }
    std::string why = status.ToString();  // the library's check, or its parser's source line
    if (why.find("ParseFromArray") != std::string::npos) why = "its bytes do not parse as one";
    MT_CHECK(status.ok(), path << " does not load as a SentencePiece model (" << why
                               << "); use a .model file written by SentencePiece or `meshtrain prepare`, "
                                  "or the tokenizer \"byte\"");
    vocab_ = sp_.GetPieceSize();
    eot_ = sp_.eos_id() >= 0 ? sp_.eos_id() : vocab_ - 1;
  }
  int vocab_size() const override { return vocab_; }
  int eot() const override { return eot_; }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    MT_CHECK(status.ok(), "SentencePiece could not encode the text: " << status.ToString());
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    // Decode runs of in-vocabulary ids; out-of-range ids become U+FFFD, eot disappears.
    std::string out;
    std::vector<int> run;
    auto flush = [&] {
      if (run.empty()) return;
      std::string text;
      const auto status = sp_.Decode(run, &text);
      MT_CHECK(status.ok(), "SentencePiece could not decode the ids: " << status.ToString());
      out += text;
      run.clear();
    };
    for (int32_t id : ids) {
      if (id == eot_) continue;
      if (id >= 0 && id < vocab_) {
        run.push_back(id);
      } else {
        flush();
        out += kReplacement;
      }
    }
    flush();
    return out;
  }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  int vocab_ = 0;
  int eot_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> tokenizer_make(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  MT_CHECK(!spec.empty(), "the tokenizer is empty; set it to \"byte\" or the path of a SentencePiece .model file");
  return std::make_unique<SentencePieceTokenizer>(spec);
}

// BPE with byte fallback, so every byte sequence encodes and decodes losslessly: the identity
// normalizer and no whitespace rewriting keep newlines, runs of spaces and leading spaces.
// Each line of the input is one training sentence.
void sentencepiece_train(const std::string& text_path, const std::string& model_prefix, int vocab_size) {
  {
    std::ifstream probe(text_path, std::ios::binary);
    MT_CHECK(probe, "cannot open tokenizer training text " << text_path << ": " << std::strerror(errno)
                                                           << "; give the path of an existing text file");
  }
  // 256 byte pieces + <unk>, <s>, </s> must fit, plus at least one merged piece.
  MT_CHECK(vocab_size >= 260, "tokenizer vocab_size " << vocab_size
                                                      << " is too small for a byte-fallback model; "
                                                         "use at least 260 (256 bytes + 3 specials + 1)");
  // SentencePiece's trainer takes time in proportion to the vocabulary asked for, however
  // small the text (2^31 took 37 s for 265 pieces); 2^24 is far past any tokenizer's.
  MT_CHECK(vocab_size <= (1 << 24), "tokenizer vocab_size " << vocab_size << " is more than the 16777216 pieces "
                                                            << "meshtrain trains; ask for fewer");
  const std::unordered_map<std::string, std::string> args = {
      {"input", text_path},
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", "bpe"},
      {"character_coverage", "1.0"},
      {"byte_fallback", "true"},
      {"hard_vocab_limit", "false"},  // small corpora may not support the full vocabulary
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},  // one piece per digit keeps arithmetic learnable
      {"max_sentence_length", "65536"},
      {"input_sentence_size", "2000000"},  // sample at most 2M lines of a large corpus
      {"shuffle_input_sentence", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"num_threads", "2"},
      {"minloglevel", "2"},  // quiet: warnings and errors only
  };
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (status.ok()) return;
  // The trainer's two failures a text meets, in meshtrain's words (it names its own flags).
  const std::string why = status.ToString();
  std::smatch m;
  if (std::regex_search(why, m, std::regex(R"(required_chars\. (\d+) vs (\d+))"))) {
    const long long required = std::stoll(m[2]);  // the characters, 256 byte pieces, <unk>, <s>, </s>
    MT_FAIL("the tokenizer's training text " << text_path << " has " << required - 259 << " distinct characters, "
                                             << "each a piece of its own beside the 256 byte pieces and <unk>, <s>, "
                                             << "</s>: " << required << " pieces, more than the " << vocab_size
                                             << " asked for; ask for at least " << required + 1);
  }
  MT_CHECK(why.find("!sentences_.empty()") == std::string::npos,
           "the tokenizer's training text " << text_path << " has no line of at most 65536 bytes to learn from "
                                            << "(each line is one training sentence): break it into lines");
  MT_FAIL("SentencePiece training on " << text_path << " failed: " << why << "; check the text and vocab_size "
                                       << vocab_size);
}

}  // namespace mt
