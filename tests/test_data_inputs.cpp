// The files a run and the commands read, as a user gives them: a FIFO where a file belongs
// (train waited on it forever, deaf to SIGTERM: data, tokenizer, init_from, hardware
// profile, schedule file), a data.path typed relative to another
// directory on resume, data.val_fraction's suggested minimum, a validation file under the
// built-in tasks, --checkpoint values that are no checkpoint, and SentencePiece's training
// failures in meshtrain's words.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include <sys/stat.h>  // mkfifo

#include "train_runs.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string kModel =
    " --model.n_layer=2 --model.n_head=2 --model.d_model=16 --model.vocab_size=257 --model.seq_len=8"
    " --training.global_batch=2 --training.steps=1";
const std::string kTiny = kModel + " --training.val_every=0 --logging.progress=off";

// meshtrain with args, under a time limit: a command that waits on a FIFO fails the test
// instead of hanging it.
int meshtrain(const std::string& args, std::string* out, const std::string& dir = "") {
  return test::run_command((dir.empty() ? "" : "cd " + dir + " && ") + "timeout 60 " + MESHTRAIN_BIN + " " + args, out);
}

TEST(DataInputs, AFifoWhereAFileBelongsIsRefused) {
  test::TempDir d;
  const std::string tokens = test::write_tokens(d, "t.bin", 400, 257), fifo = d / "fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::string out;
  ASSERT_EQ(meshtrain("train" + kTiny + " --data.path=" + tokens + " --checkpoint.dir=" + d / "ck", &out), 0) << out;
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"train" + kTiny + " --data.path=" + fifo, "data.path = " + fifo + " is a FIFO; set data.path to a token file"},
           {"train" + kTiny + " --data.path=" + tokens + " --data.val_path=" + fifo, "data.val_path = " + fifo + " is a FIFO"},
           {"train" + kTiny + " --data.path=" + tokens + " --data.tokenizer=" + fifo,
            fifo + " is a FIFO; the tokenizer must be \"byte\" or the path of a SentencePiece .model file"},
           {"train" + kTiny + " --data.path=" + tokens + " --model.init_from=" + fifo, fifo + " is a FIFO, not a "
                                                                                              "safetensors file"},
           {"train" + kTiny + " --data.path=" + tokens + " --logging.hardware=" + fifo, "hardware profile " + fifo +
                                                                                         " is a FIFO"},
           {"train" + kTiny + " --data.path=" + tokens + " --parallel.pp_schedule=file:" + fifo, fifo + " is a FIFO, "
                                                                                                  "not a schedule file"},
           {"sample --checkpoint " + d / "ck" + " --tokenizer " + fifo, fifo + " is a FIFO"},
           {"prepare --input " + tokens + " --out " + d / "p.bin --tokenizer " + fifo, fifo + " is a FIFO"}}) {
    EXPECT_EQ(meshtrain(args, &out), 1) << args << "\n" << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
  }
}

// The checkpoint records data.path as the absolute path of the file read: resumed from
// another directory, a relative data.path that names another file is refused (it trained on
// with no word), and the same file given another way is the same (it was refused).
TEST(DataInputs, ResumeComparesTheDataFilesNotTheWordsTyped) {
  test::TempDir d;
  fs::create_directories(d / "other");
  test::write_tokens(d, "t.bin", 400, 257);
  fs::copy_file(test::write_tokens(d, "u.bin", 500, 257, 9), d / "other/t.bin");
  const std::string run = "train" + kTiny + " --checkpoint.dir=" + d / "ck" + " --checkpoint.resume=true";
  std::string out;
  ASSERT_EQ(meshtrain(run + " --data.path=t.bin", &out, d.path), 0) << out;
  EXPECT_EQ(meshtrain(run + " --data.path=t.bin --training.steps=2", &out, d / "other"), 1) << out;
  EXPECT_NE(out.find("data.path = \"" + d / "t.bin" + "\" (this run: \"" + d / "other/t.bin" + "\")"),
            std::string::npos) << out;
  EXPECT_EQ(meshtrain(run + " --data.path=../t.bin --training.steps=2", &out, d / "other"), 0) << out;
  EXPECT_EQ(meshtrain(run + " --data.path=" + d / "t.bin --training.steps=3", &out), 0) << out;
}

// The least data.val_fraction the error suggests holds out enough tokens (it was printed to
// 6 digits, rounded down: the suggested value failed with the same message).
TEST(DataInputs, TheSuggestedValFractionWorks) {
  test::TempDir d;
  const std::string tokens = test::write_tokens(d, "t.bin", 3700, 257);
  std::string out;
  EXPECT_EQ(meshtrain("train" + kTiny + " --data.path=" + tokens + " --data.val_fraction=0.001", &out), 1) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("use data.val_fraction of at least ([0-9.e-]+),"))) << out;
  EXPECT_EQ(m[1], "0.00243244") << "9 of 3700 tokens: 0.00243243... rounded up (0.00243243 holds out 8)";
  EXPECT_EQ(meshtrain("train" + kTiny + " --data.path=" + tokens + " --data.val_fraction=" + m[1].str(), &out), 0)
      << out;
}

// Under the built-in tasks a data.val_path is text, not tasks: no answer accuracy is scored
// on it (the answer mask was applied to any validation file).
TEST(DataInputs, NoAnswerAccuracyOnAValidationFile) {
  test::TempDir d;
  const std::string val = test::write_tokens(d, "v.bin", 400, 257);
  const test::RunResult r = test::train_run(d, "tasks", 1, kModel + " --training.val_every=1 --data.val_path=" + val);
  ASSERT_EQ(r.loss.size(), 1u) << r.output;
  EXPECT_TRUE(r.summary["answer_accuracy"].is_null()) << r.summary.dump();
  EXPECT_EQ(r.output.find("answer accuracy"), std::string::npos) << r.output;
}

// sample reads the tokenizer and checks the prompt before the parameters load (minutes for a
// large model): a bad --tokenizer is said even where a shard is damaged.
TEST(DataInputs, SampleChecksTheTokenizerBeforeLoading) {
  test::TempDir d;
  const std::string tokens = test::write_tokens(d, "t.bin", 400, 257);
  std::string out;
  ASSERT_EQ(meshtrain("train" + kTiny + " --data.path=" + tokens + " --checkpoint.dir=" + d / "ck", &out), 0) << out;
  const std::string dir = checkpoint_latest(d / "ck");
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") {
      std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-8, std::ios::end);
      f << "damaged!";
    }
  EXPECT_EQ(meshtrain("sample --checkpoint " + d / "ck" + " --tokenizer " + d / "none.model", &out), 1) << out;
  EXPECT_NE(out.find("--tokenizer " + d / "none.model"), std::string::npos) << out;
  EXPECT_EQ(meshtrain("sample --checkpoint " + d / "ck", &out), 1) << out;
  EXPECT_EQ(out.find("--tokenizer"), std::string::npos) << "the damaged shard\n" << out;
  // and validation on the training file itself is said
  EXPECT_EQ(meshtrain("train" + kTiny + " --data.path=" + tokens + " --data.val_path=" + tokens, &out), 0) << out;
  EXPECT_NE(out.find("is data.path's file: validation reads the tokens the run trains on"), std::string::npos) << out;
}

TEST(DataInputs, ACheckpointOptionThatNamesNoCheckpointSaysWhy) {
  test::TempDir d;
  std::ofstream(d / "file.txt") << "text";
  const std::string where = "; give a checkpoint directory (step_N) or a run's checkpoint.dir";
  for (const std::string& command : std::vector<std::string>{"sample --prompt a", "export --out " + d / "x.safetensors"})
    for (const auto& [value, want] : std::vector<std::pair<std::string, std::string>>{
             {"''", "--checkpoint is empty" + where},
             {d / "file.txt", "--checkpoint " + d / "file.txt" + " is a file, not a checkpoint directory" + where},
             {d / "gone", "--checkpoint " + d / "gone" + " is not there; "}}) {
      std::string out;
      EXPECT_EQ(meshtrain(command + " --checkpoint " + value, &out), 1) << command << " " << value << "\n" << out;
      EXPECT_NE(out.find(want), std::string::npos) << command << " " << value << "\n" << out;
    }
}

// SentencePiece's own failures named its flags (--character_coverage, which meshtrain does not
// have) and its source lines; --train-tokenizer -5 tokenized with bytes without a word.
TEST(DataInputs, TokenizerTrainingFailuresSayWhatToChange) {
  test::TempDir d;
  std::string many;  // 400 distinct CJK characters, one line each
  for (int i = 0; i < 400; ++i) {
    const int c = 0x4E00 + i;
    many += {static_cast<char>(0xE0 | (c >> 12)), static_cast<char>(0x80 | ((c >> 6) & 0x3F)),
             static_cast<char>(0x80 | (c & 0x3F)), '\n'};
  }
  std::ofstream(d / "many.txt") << many;
  std::ofstream(d / "long.txt") << std::string(80000, 'a');
  const std::string prep = "prepare --out " + d / "t.bin --input ";
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {d / "many.txt --train-tokenizer 300", "has 400 distinct characters, each a piece of its own beside the 256 "
                                                  "byte pieces and <unk>, <s>, </s>: 659 pieces, more than the 300 asked "
                                                  "for; ask for at least 660"},
           {d / "long.txt --train-tokenizer 300", "has no line of at most 65536 bytes to learn from"},
           {d / "many.txt --train-tokenizer -5", "--train-tokenizer -5 must be a vocabulary size from 260"}}) {
    std::string out;
    EXPECT_EQ(meshtrain(prep + args, &out), 1) << args << "\n" << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
    EXPECT_EQ(out.find("trainer_interface"), std::string::npos) << out;
  }
  EXPECT_FALSE(fs::exists(d / "t.bin"));
}

}  // namespace
