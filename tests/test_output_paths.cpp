// Outputs that would destroy data are refused before any work, naming both keys: train's,
// prepare's and export's outputs that are an input file or another output (by name, link or
// path), or that lie inside a checkpoint (or where a run will save one). Each case ran with
// exit status 0 and replaced the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <sys/stat.h>  // mkfifo

#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string kTiny =
    " --model.n_layer=2 --model.n_head=2 --model.d_model=16 --model.vocab_size=37 --model.seq_len=8"
    " --training.global_batch=2 --training.steps=2 --training.val_every=0 --logging.progress=off";

std::string bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

struct Outcome {
  int rc = 0;
  std::string out;
};
Outcome meshtrain(const std::string& args) {
  Outcome r;
  r.rc = test::run_command(std::string(MESHTRAIN_BIN) + " " + args, &r.out);
  return r;
}

// Each (options, message) is refused with exit status 1 and that message.
void expect_refused(const std::string& command, const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [opts, want] : cases) {
    const Outcome r = meshtrain(command + " " + opts);
    EXPECT_EQ(r.rc, 1) << opts << "\n" << r.out;
    EXPECT_NE(r.out.find("error: " + want), std::string::npos) << opts << "\n" << r.out;
  }
}

TEST(OutputPaths, TrainRefusesAnOutputThatIsAnInputOrAnotherOutput) {
  test::TempDir d;
  const std::string tokens = test::write_tokens(d, "tc.bin", 400, 37), val = test::write_tokens(d, "val.bin", 100, 37, 9);
  fs::create_symlink(tokens, d / "link.bin");
  std::ofstream(d / "hw.toml") << "not read: refused first\n";
  const std::string before = bytes_of(tokens), val_before = bytes_of(val);
  const std::string in = "data.path = " + tokens;
  expect_refused("train" + kTiny + " --data.path=" + tokens + " --data.val_path=" + val, {
      {"--logging.metrics=" + tokens, "logging.metrics = " + tokens + " is the same file as " + in +
                                          ": writing it would destroy what data.path holds; choose another "
                                          "logging.metrics"},
      {"--logging.plot=" + tokens, "logging.plot = " + tokens + " is the same file as " + in},
      {"--logging.trace=" + val, "logging.trace = " + val + " is the same file as data.val_path = " + val},
      {"--logging.metrics=" + val, "logging.metrics = " + val + " is the same file as data.val_path"},
      {"--logging.metrics=" + d / "link.bin", "logging.metrics = " + d / "link.bin" + " is the same file as " + in},
      {"--logging.metrics=" + d / "new/../tc.bin", "logging.metrics = " + d / "new/../tc.bin" + " is the same file"},
      {"--logging.metrics=" + d / "hw.toml --logging.hardware=" + d / "hw.toml",
       "logging.metrics = " + d / "hw.toml" + " is the same file as logging.hardware"},
      // two outputs: one named twice, and the trace's picture where the plot goes (auto)
      {"--logging.metrics=" + d / "m.json --logging.trace=" + d / "m.json",
       "logging.trace = " + d / "m.json" + " and logging.metrics = " + d / "m.json" + " are the same file: one "
       "would overwrite the other; give logging.trace and logging.metrics different paths"},
      {"--logging.metrics=" + d / "m.json --logging.trace=" + d / "m",
       "logging.plot = auto (" + d / "m.svg" + ") and logging.trace = " + d / "m" + " (" + d / "m.svg" + ") are the "
       "same file"}});
  EXPECT_EQ(bytes_of(tokens), before);
  EXPECT_EQ(bytes_of(val), val_before);
  EXPECT_FALSE(fs::exists(d / "new")) << "refused before any directory is made";
  EXPECT_FALSE(fs::exists(d / "m.json"));
}

TEST(OutputPaths, NoOutputGoesIntoACheckpoint) {
  test::TempDir d;
  const std::string tokens = test::write_tokens(d, "tc.bin", 400, 37), ck = d / "ck", step = ck + "/step_00000002";
  const std::string train = "train" + kTiny + " --data.path=" + tokens;
  const Outcome saved = meshtrain(train + " --checkpoint.dir=" + ck + " --checkpoint.every=1");
  ASSERT_EQ(saved.rc, 0) << saved.out;
  std::string shard;
  for (const auto& e : fs::directory_iterator(step))
    if (e.path().extension() == ".safetensors") shard = e.path().string();
  ASSERT_FALSE(shard.empty());
  const std::string meta = bytes_of(step + "/meta.json"), shard_bytes = bytes_of(shard);
  const std::string inside = " lies inside the checkpoint " + step + ": writing it would damage the checkpoint; ";
  expect_refused(train, {
      {"--logging.metrics=" + step + "/meta.json",
       "logging.metrics = " + step + "/meta.json" + inside + "choose another logging.metrics, outside it"},
      {"--logging.plot=" + step + "/loss.svg", "logging.plot = " + step + "/loss.svg" + inside},
      // where this run will save a checkpoint: its step_ directories
      {"--checkpoint.dir=" + d / "ck2" + " --logging.trace=" + d / "ck2/step_00000001/t.json",
       "logging.trace = " + d / "ck2/step_00000001/t.json" + " lies inside " + d / "ck2/step_00000001" + ", the "
       "directory where checkpoint.dir = " + d / "ck2" + " saves that step's checkpoint"},
      // a save's temporary directory: the start of the run removes it
      {"--checkpoint.dir=" + d / "ck2" + " --logging.metrics=" + d / "ck2/.tmp-step_00000001/m.jsonl",
       "logging.metrics = " + d / "ck2/.tmp-step_00000001/m.jsonl" + " lies inside " + d / "ck2/.tmp-step_00000001" +
       ", a temporary directory of checkpoint.dir = " + d / "ck2" + "'s saves, which the run removes"}});
  EXPECT_FALSE(fs::exists(d / "ck2"));
  expect_refused("export", {
      {"--checkpoint " + ck + " --out " + shard, "--out " + shard + inside + "choose another --out, outside it"},
      {"--checkpoint " + ck + " --out " + step + "/", "--out " + step + "/ (" + step + "/model.safetensors)" + inside},
      {"--checkpoint " + step + " --out " + step + "/x.safetensors", "--out " + step + "/x.safetensors" + inside}});
  EXPECT_EQ(bytes_of(step + "/meta.json"), meta);
  EXPECT_EQ(bytes_of(shard), shard_bytes);
  EXPECT_FALSE(fs::exists(step + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(step + "/x.safetensors"));
  // Beside the checkpoints is no checkpoint: a metrics file in checkpoint.dir is fine.
  const Outcome beside = meshtrain(train + " --logging.metrics=" + ck + "/metrics.jsonl");
  EXPECT_EQ(beside.rc, 0) << beside.out;
}

TEST(OutputPaths, PrepareKeepsItsInputAndEachOutput) {
  test::TempDir d;
  std::ofstream(d / "c2.txt") << "the text to keep, whatever the options say\n";
  std::ofstream(d / "c.model") << "a text file with a tokenizer's name\n";
  const std::string text = bytes_of(d / "c2.txt");
  expect_refused("prepare --input " + d / "c2.txt", {
      {"--out " + d / "c2.txt", "--out " + d / "c2.txt" + " is the same file as --input " + d / "c2.txt" + ": writing "
                                "it would destroy what --input holds; choose another --out"},
      {"--out " + d / "t3.bin --val-fraction 0.1 --val-out " + d / "t3.bin",
       "--val-out " + d / "t3.bin" + " and --out " + d / "t3.bin" + " are the same file: one would overwrite the "
       "other; give --val-out and --out different paths"},
      {"--out " + d / "c2.vocab --train-tokenizer 300 --tokenizer-prefix " + d / "c2",
       "--tokenizer-prefix " + d / "c2" + " (" + d / "c2.vocab" + ") and --out " + d / "c2.vocab" + " are the same "
       "file"}});
  expect_refused("prepare --input " + d / "c.model", {
      {"--out " + d / "t.bin --train-tokenizer 300 --tokenizer-prefix " + d / "c",
       "--tokenizer-prefix " + d / "c" + " (" + d / "c.model" + ") is the same file as --input " + d / "c.model"}});
  // Relative paths, neither there yet, compared as resolved.
  const std::string cd = "cd " + d.path + " && " + MESHTRAIN_BIN;
  std::string out;
  EXPECT_EQ(test::run_command(cd + " prepare --input c2.txt --out t3.bin --val-fraction 0.1 --val-out ./sub/../t3.bin",
                              &out), 1) << out;
  EXPECT_NE(out.find("--val-out ./sub/../t3.bin and --out t3.bin are the same file"), std::string::npos) << out;
  EXPECT_EQ(bytes_of(d / "c2.txt"), text);
  EXPECT_FALSE(fs::exists(d / "t3.bin"));
  EXPECT_FALSE(fs::exists(d / "sub"));
}

// prepare and export write beside an output and rename it into place: a FIFO there was
// replaced by a regular file (and /dev/null, which this test leaves alone, likewise), a
// directory was found only after the tokenizer trained and the validation file was written,
// and a symbolic link was replaced instead of written through. Now each is refused before any
// work, and a link is written through to its target.
TEST(OutputPaths, PrepareAndExportReplaceOnlyRegularFiles) {
  test::TempDir d;
  std::ofstream(d / "c.txt") << "hello world, hello meshtrain\n";
  const std::string fifo = d / "fifo", dir = d / "dir";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  fs::create_directories(dir);
  const std::string replaced = ": the file is written beside it and renamed into place, which would replace it";
  expect_refused("prepare --input " + d / "c.txt", {
      {"--out " + fifo, "--out " + fifo + " is a FIFO" + replaced},
      {"--out " + dir + " --val-fraction 0.5 --val-out " + d / "v.bin", "--out " + dir + " is a directory" + replaced},
      {"--out " + d / "t.bin --val-fraction 0.5 --val-out " + fifo, "--val-out " + fifo + " is a FIFO"},
      {"--out " + d / "new.bin/", "--out " + d / "new.bin/" + " names a directory; give the path of a file"},
      {"--out " + d / "t.bin --train-tokenizer 300 --tokenizer-prefix " + d / "sp/", "--tokenizer-prefix " + d / "sp/" +
                                                                                    " names a directory"}});
  EXPECT_EQ(fs::status(fifo).type(), fs::file_type::fifo);
  EXPECT_FALSE(fs::exists(d / "v.bin") || fs::exists(d / "new.bin") || fs::exists(d / "sp")) << "nothing written";
  fs::create_directories(d / "target");
  fs::create_symlink(d / "target/t.bin", d / "link.bin");  // to a file not there yet
  const Outcome linked = meshtrain("prepare --input " + d / "c.txt --out " + d / "link.bin");
  ASSERT_EQ(linked.rc, 0) << linked.out;
  EXPECT_TRUE(fs::is_symlink(d / "link.bin"));
  EXPECT_GT(fs::file_size(d / "target/t.bin"), 0u);
  const Outcome trained = meshtrain("train" + kTiny + " --model.vocab_size=257 --data.path=" + d / "link.bin" +
                                    " --checkpoint.dir=" + d / "ck");
  ASSERT_EQ(trained.rc, 0) << trained.out;
  fs::create_directories(d / "hf/config.json");
  expect_refused("export --checkpoint " + d / "ck", {
      {"--out " + fifo, "--out " + fifo + " is a FIFO" + replaced},
      {"--out " + d / "hf", "--out " + d / "hf/config.json" + " is a directory" + replaced}});
  EXPECT_EQ(fs::status(fifo).type(), fs::file_type::fifo);
  EXPECT_FALSE(fs::exists(d / "hf/model.safetensors")) << "refused before the parameters are written";
}

}  // namespace
