// What a run writes besides checkpoints: the summary line (a value that does not exist is
// null, never a made-up number) and output files in directories that do not exist yet; a
// path that cannot be written is an error naming the key (checkpoint.dir's before any step).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tasks.h"
#include "data/tokenizer.h"
#include "train/start_checks.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

nlohmann::json summary_of(const std::string& metrics) {
  for (const std::string& l : test::read_lines(metrics)) {
    nlohmann::json j = nlohmann::json::parse(l);
    if (j.value("event", "") == "summary") return j;
  }
  ADD_FAILURE() << "no summary line in " << metrics;
  return {};
}

// Every key of the summary is there; those in `absent` are null, all others are numbers >= 0.
// The planner's step time is null in every run here: none sets logging.hardware; nor does
// any trace its pipeline (pp_*).
void expect_summary(const nlohmann::json& j, std::vector<std::string> absent, const std::string& what) {
  absent.insert(absent.end(), {"plan_step_s", "loss_scale", "pp_step_ms", "pp_bubble", "pp_simulated_ms"});
  for (const char* k : {"steps", "loss", "val_loss", "baseline_loss", "answer_accuracy", "baseline_accuracy",
                        "tokens_per_s", "seconds", "ranks", "mem_peak", "mem_model_state", "plan_step_s", "skipped",
                        "loss_scale", "pp_step_ms", "pp_bubble", "pp_simulated_ms"})
    EXPECT_TRUE(j.contains(k)) << what << ": no " << k << " in " << j;
  for (const auto& [k, v] : j.items()) {
    if (k == "event") continue;
    const bool null = std::find(absent.begin(), absent.end(), k) != absent.end();
    if (null) {
      EXPECT_TRUE(v.is_null()) << what << ": " << k << " = " << v;
    } else {
      EXPECT_TRUE(v.is_number() && v.get<double>() >= 0) << what << ": " << k << " = " << v;
    }
  }
}

TEST(Summary, ValuesThatDoNotExistAreNull) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 2;
  c.logging.metrics = d / "held_out.jsonl";  // tiny_config holds out a validation tail
  TrainSummary s = train(c);
  expect_summary(summary_of(c.logging.metrics), {"answer_accuracy", "baseline_accuracy"}, "validation tail");
  EXPECT_TRUE(s.val_loss && s.baseline_loss && s.loss && s.tokens_per_s);
  EXPECT_FALSE(s.answer_accuracy);
  // The validation at the end is a val event too, as the periodic ones are, at the last step.
  std::vector<nlohmann::json> vals;
  for (const std::string& l : test::read_lines(c.logging.metrics))
    if (nlohmann::json j = nlohmann::json::parse(l); j.value("event", "") == "val") vals.push_back(j);
  ASSERT_EQ(vals.size(), 1u);
  EXPECT_EQ(vals[0]["step"], 1);
  EXPECT_EQ(vals[0]["val_loss"], summary_of(c.logging.metrics)["val_loss"]);

  c.data.val_fraction = 0;
  c.logging.metrics = d / "no_val.jsonl";
  c.checkpoint.dir = d / "ck";
  s = train(c);
  expect_summary(summary_of(c.logging.metrics), {"val_loss", "baseline_loss", "answer_accuracy", "baseline_accuracy"},
                 "no validation data");
  EXPECT_FALSE(s.val_loss || s.baseline_loss);

  // Resumed at its last step: no step runs, so there is no loss and no throughput. It
  // appends to its metrics file (a fresh run starts it afresh: Outputs.MetricsFile...).
  c.checkpoint.resume = true;
  c.logging.metrics = d / "nothing_left.jsonl";
  s = train(c);
  const nlohmann::json j = summary_of(c.logging.metrics);
  // Nor anything the planner's prediction is held against: those measurements are null too.
  std::vector<std::string> absent = {"loss", "tokens_per_s", "val_loss", "baseline_loss", "answer_accuracy",
                                     "baseline_accuracy"};
  for (const char* tag : {"params", "grads", "optim", "activations", "comm", "other"})
    absent.push_back(std::string("mem_steps_") + tag);
  for (const char* axis : {"dp", "tp", "pp", "cp"}) absent.push_back(std::string("comm_bytes_") + axis + "_step");
  expect_summary(j, absent, "nothing left to train");
  EXPECT_EQ(j["steps"], 2);
  EXPECT_FALSE(s.loss || s.tokens_per_s);
}

// The live line says what the set-up is doing (a large model's takes minutes before the
// header): reading the data, allocating, then initialising or loading the parameters; the
// header's line clears it. Without a live line, none of it is printed.
TEST(Outputs, LiveLineSaysWhatTheSetUpDoes) {
  test::TempDir d;
  const std::string run = std::string(MESHTRAIN_BIN) + " train --training.steps=1 --model.n_layer=1 --model.d_model=32"
                                                       " --model.n_head=2 --checkpoint.dir=" + d / "ck";
  std::string out;
  ASSERT_EQ(test::run_command(run + " --logging.progress=on", &out), 0) << out;
  size_t at = 0;
  for (const char* what : {"\r\033[Ksetting up: reading the data", "\r\033[Ksetting up: allocating the model (0.",
                           "M parameters)\r\033[Ksetting up: initialising 0.", "\r\033[Kmeshtrain: gpt2, 1 layer"}) {
    const size_t found = out.find(what, at);
    EXPECT_NE(found, std::string::npos) << "no " << what << " after position " << at << " in\n" << out;
    if (found != std::string::npos) at = found;
  }
  ASSERT_EQ(test::run_command(run + " --logging.progress=on --training.steps=2 --checkpoint.resume=true", &out), 0);
  EXPECT_NE(out.find("setting up: loading 0."), std::string::npos) << out;
  EXPECT_NE(out.find(" parameters from " + d / "ck/step_00000001"), std::string::npos) << out;
  ASSERT_EQ(test::run_command(run + " --logging.progress=off --training.steps=3 --checkpoint.resume=true", &out), 0);
  EXPECT_EQ(out.find("setting up"), std::string::npos) << out;
}

// A run of 2^63 - 1 steps (stopped by SIGTERM after 3 seconds): its progress line's
// estimate is said as more than 100000 hours (the hours, cast to int, printed
// "eta -2147483648h-8m").
TEST(Outputs, ProgressOfAnEndlessRunSaysItsEstimate) {
  test::TempDir d;
  std::string out;
  const int rc = test::run_command("timeout --preserve-status -s TERM 3 " + std::string(MESHTRAIN_BIN) +
                                       " train --training.steps=9223372036854775807 --logging.progress=on "
                                       "--logging.every=1 --model.n_layer=1 --model.d_model=32 --model.n_head=2",
                                   &out);
  EXPECT_EQ(rc, 75) << out;  // stopped by the signal, as preemption is
  EXPECT_NE(out.find("/9223372036854775807 | loss"), std::string::npos) << out;
  EXPECT_NE(out.find("| eta >100000h"), std::string::npos) << out;
  EXPECT_EQ(out.find("-2147483648h"), std::string::npos) << out;
}

TEST(Summary, BuiltInTasksReportAnswerAccuracy) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", "");
  c.data.val_fraction = 0;
  c.model.vocab_size = 257;  // bytes and end-of-text
  c.training.steps = 1;
  c.logging.metrics = d / "m.jsonl";
  train(c);
  expect_summary(summary_of(c.logging.metrics), {}, "built-in tasks");
}

// A run that does not resume starts logging.metrics afresh (two runs' steps mixed in one
// file would mislead every reader); a resumed run appends to it; a run refused at start-up
// leaves it as it was.
TEST(Outputs, MetricsFileIsStartedAfreshUnlessTheRunResumes) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 2;
  c.logging.metrics = d / "m.jsonl";
  auto summaries = [&] {
    int n = 0;
    for (const std::string& l : test::read_lines(c.logging.metrics)) n += l.find("\"summary\"") != std::string::npos;
    return n;
  };
  train(c);
  const size_t one_run = test::read_lines(c.logging.metrics).size();
  train(c);
  EXPECT_EQ(test::read_lines(c.logging.metrics).size(), one_run);
  EXPECT_EQ(summaries(), 1);
  Config bad = c;
  bad.data.path = d / "none.bin";
  EXPECT_THROW(train(bad), Error);
  EXPECT_EQ(summaries(), 1) << "a refused run leaves the file as it was";
  c.checkpoint.dir = d / "ck";
  train(c);
  c.checkpoint.resume = true;
  c.training.steps = 3;
  train(c);
  const std::vector<std::string> lines = test::read_lines(c.logging.metrics);
  EXPECT_EQ(summaries(), 2) << "the resumed run appends";
  EXPECT_EQ(nlohmann::json::parse(lines.front())["step"], 0);
}

// The memory check's budget: MemTotal, or the memory cgroup's limit where that is less (a
// container, a job's allocation: a run over it was killed without a message); "max" and
// version 1's "no limit" (a huge number) leave MemTotal.
TEST(StartChecks, MachineMemoryIsTheSmallerOfMemTotalAndTheCgroupLimit) {
  test::TempDir d;
  auto write = [&](const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(d / path).parent_path());
    std::ofstream(d / path) << text;
  };
  write("proc/meminfo", "MemTotal:        1000 kB\nMemFree:          500 kB\n");
  EXPECT_EQ(machine_memory(d.path).bytes, 1024000);
  EXPECT_EQ(machine_memory(d.path).source, "");
  write("sys/fs/cgroup/memory.max", "max\n");
  write("proc/self/cgroup", "4:memory:/a\n0::/job/1\n");
  write("sys/fs/cgroup/memory/a/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(machine_memory(d.path).bytes, 1024000);
  write("sys/fs/cgroup/job/1/memory.max", "512000\n");
  const MachineMemory m = machine_memory(d.path);
  EXPECT_EQ(m.bytes, 512000);
  EXPECT_EQ(m.source, d / "sys/fs/cgroup/job/1/memory.max");
  write("sys/fs/cgroup/memory/a/memory.limit_in_bytes", "256000\n");
  EXPECT_EQ(machine_memory(d.path).bytes, 256000);
  EXPECT_GT(machine_memory().bytes, 0) << "this machine's";
}

// Metrics and the loss curve go into directories made for them, as checkpoint.dir does.
TEST(Outputs, DirectoriesAreCreated) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 1;
  c.logging.metrics = d / "runs/a/m.jsonl";
  c.logging.plot = d / "plots/b/loss.svg";
  train(c);
  EXPECT_EQ(test::read_lines(c.logging.metrics).size(), 3u);  // the step, the validation and the summary
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
  // checkpoint.dir before the first step, as the save would make it (not at the first save,
  // after the steps before it were trained for nothing).
  c.logging.plot = "";
  c.logging.metrics = d / "ck.jsonl";
  c.checkpoint.dir = d / "file/ckpt";
  msg = error_of(c);
  EXPECT_NE(msg.find("cannot create checkpoint.dir = " + c.checkpoint.dir), std::string::npos) << msg;
  EXPECT_TRUE(test::read_lines(c.logging.metrics).empty()) << "no step ran";
}

// logging.trace, logging.plot, logging.hardware and data.tokenizer are tried before any step
// (they were found only after the whole run, which then ended without its summary line);
// the trace's directory is created as the others are.
TEST(Outputs, CheckedBeforeTheFirstStep) {
  test::TempDir d;
  std::ofstream(d / "file") << "a file where a directory should be";
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 1;
  c.logging.metrics = d / "m.jsonl";
  const std::vector<std::pair<std::function<void(Config&)>, std::string>> bad = {
      {[&](Config& x) { x.logging.trace = d / "file/t.json"; }, "logging.trace file " + d / "file/t.json"},
      {[&](Config& x) { x.logging.plot = d / "file/loss.svg"; }, "logging.plot file " + d / "file/loss.svg"},
      {[&](Config& x) { x.logging.hardware = d / "none.toml"; }, "logging.hardware = " + d / "none.toml"},
      {[&](Config& x) { x.logging.hardware = d / "file"; }, "logging.hardware = " + d / "file"},
      {[&](Config& x) { x.data.tokenizer = d / "none.model"; }, "data.tokenizer = " + d / "none.model"},
  };
  for (const auto& [set, want] : bad) {
    Config x = c;
    set(x);
    const std::string msg = error_of(x);
    EXPECT_NE(msg.find(want), std::string::npos) << want << ": " << msg;
    EXPECT_FALSE(fs::exists(c.logging.metrics)) << want << ": a step ran";
  }
  EXPECT_FALSE(fs::exists(d / "m.svg")) << "a tried output that was not there is not left behind";
  c.logging.trace = d / "traces/new/t.json";
  train(c);
  EXPECT_TRUE(fs::is_regular_file(c.logging.trace));
  EXPECT_TRUE(fs::is_regular_file(c.logging.trace + ".svg"));

  // On the command line with two ranks: one message, before any step. Data that does not
  // load (a missing file, fewer tokens than one sequence) is said once too, not by each rank.
  const std::string metrics = d / "two.jsonl";
  const std::string two = std::string(MESHTRAIN_BIN) + " launch -n 2 train --model.n_layer=1 --model.d_model=16"
                          " --model.n_head=2 --model.vocab_size=37 --model.seq_len=8 --training.global_batch=2"
                          " --training.steps=1 --logging.metrics=" + metrics;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {" --data.path=" + c.data.path + " --logging.trace=" + d / "file/t.json", "logging.trace file " + d / "file/t.json"},
      {" --data.path=" + d / "none.bin", d / "none.bin"},
      {" --data.path=" + test::write_tokens(d, "t5.bin", 5, 37), "one training sequence needs model.seq_len + 1 = 9"}};
  for (const auto& [opts, want] : refused) {
    std::string out;
    EXPECT_EQ(test::run_command(two + opts, &out), 1) << out;
    EXPECT_NE(out.find(want), std::string::npos) << want << "\n" << out;
    size_t errors = 0;
    for (size_t at = out.find("error:"); at != std::string::npos; at = out.find("error:", at + 1)) ++errors;
    EXPECT_EQ(errors, 1u) << out;
    EXPECT_FALSE(fs::exists(metrics));
  }
  // Ranks started with other options: the keys that differ are named, once.
  const std::string rank = std::string(MESHTRAIN_BIN) + " train --data.path=" + c.data.path +
                           " --model.n_layer=1 --model.d_model=16 --model.n_head=2 --model.vocab_size=37"
                           " --model.seq_len=8 --training.global_batch=2 --training.steps=1 --logging.progress=off";
  std::string out;
  EXPECT_NE(test::run_command(test::mpirun_in(d) + " -n 1 " + rank + " : -n 1 " + rank +
                                  " --training.seed=7",
                              &out),
            0);
  EXPECT_NE(out.find("rank 1 runs another configuration than rank 0: training.seed = 7 (rank 0: 1337)"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << "said once\n" << out;
  // also a key that changes the collectives themselves (checked before it applies)
  EXPECT_NE(test::run_command(test::mpirun_in(d) + " -n 1 " + rank + " : -n 1 " + rank +
                                  " --parallel.debug_collectives=true",
                              &out),
            0);
  EXPECT_NE(out.find("rank 1 runs another configuration than rank 0: parallel.debug_collectives = true (rank 0: "
                     "false)"),
            std::string::npos)
      << out;
}

// A SentencePiece data.tokenizer with more pieces than model.vocab_size is refused before
// any step, naming both keys and the size to set (sample refused it only after training),
// and said once by a job; the byte tokenizer is not compared (a small vocabulary's tokens).
TEST(Outputs, TokenizerLargerThanTheVocabularyIsRefusedBeforeTheFirstStep) {
  test::TempDir d;
  std::ofstream(d / "corpus.txt") << tasks_generate(3, 3000);
  sentencepiece_train(d / "corpus.txt", d / "spm", 300);
  const int pieces = tokenizer_make(d / "spm.model")->vocab_size();
  ASSERT_GT(pieces, 257);
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));
  c.training.steps = 1;
  c.model.vocab_size = 257;
  c.logging.metrics = d / "m.jsonl";
  c.data.tokenizer = d / "spm.model";
  const std::string want = "data.tokenizer = " + d / "spm.model" + " has " + std::to_string(pieces) +
                           " tokens but model.vocab_size = 257: the model has no ids for the rest. Set "
                           "model.vocab_size=" + std::to_string(pieces) + " (or more)";
  const std::string msg = error_of(c);
  EXPECT_NE(msg.find(want), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(c.logging.metrics)) << "a step ran";
  std::string out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " launch -n 2 train --data.path=" + c.data.path +
                                  " --model.n_layer=1 --model.d_model=16 --model.n_head=2 --model.seq_len=8"
                                  " --training.global_batch=2 --training.steps=1 --logging.metrics=" + c.logging.metrics +
                                  " --data.tokenizer=" + c.data.tokenizer,
                              &out),
            1);
  EXPECT_NE(out.find(want), std::string::npos) << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << "said once\n" << out;
  EXPECT_FALSE(fs::exists(c.logging.metrics)) << "a step ran";
  c.model.vocab_size = pieces;
  train(c);
  c.model.vocab_size = 37;  // the byte tokenizer and a smaller vocabulary: its token file's
  c.data.tokenizer = "byte";
  train(c);
}

}  // namespace
