// What a run writes besides checkpoints: output files in directories that do not exist yet.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

// Metrics and the loss curve go into directories made for them, as checkpoint.dir does.
TEST(Outputs, DirectoriesAreCreated) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 1;
  c.logging.metrics = d / "runs/a/m.jsonl";
  c.logging.plot = d / "plots/b/loss.svg";
  train(c);
  EXPECT_EQ(test::read_lines(c.logging.metrics).size(), 2u);  // the step and the summary
  EXPECT_TRUE(fs::is_regular_file(c.logging.plot));
  c.logging.plot = "auto";  // beside the metrics file
  c.logging.metrics = d / "runs/c/m.jsonl";
  train(c);
  EXPECT_TRUE(fs::is_regular_file(d / "runs/c/m.svg"));
}

std::string error_of(const Config& c) {
  try {
    train(c);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Outputs, ErrorsNameThePathAndTheKey) {
  test::TempDir d;
  std::ofstream(d / "file") << "a file where a directory should be";
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 1;
  c.logging.metrics = d / "file/m.jsonl";
  std::string msg = error_of(c);
  EXPECT_NE(msg.find("logging.metrics"), std::string::npos) << msg;
  EXPECT_NE(msg.find(c.logging.metrics), std::string::npos) << msg;
  c.logging.metrics = d / "m.jsonl";
  c.logging.plot = d / "file/loss.svg";
  msg = error_of(c);
  EXPECT_NE(msg.find("logging.plot"), std::string::npos) << msg;
  EXPECT_NE(msg.find(c.logging.plot), std::string::npos) << msg;
}

}  // namespace
