// Checkpoints across layouts and elastic restarts, as whole runs (meshtrain launch):
// - written at tp 2 x pp 2 x dp 2 (ZeRO 1, 8 ranks), a checkpoint resumes in one process,
//   at tp 1 x pp 4 with two chunks per rank (interleaved) and at tp 2 x dp 4 (ZeRO 3), and
//   the resumed runs continue the uninterrupted run's losses (expect_equivalent);
// - `meshtrain export` writes the same Hugging Face file from a tp 2 x pp 2 x dp 2
//   checkpoint as from a one-process checkpoint of the same state: byte for byte when the
//   parameters are bit-identical, to rounding after training at the two layouts;
// - the same command with checkpoint.resume=true on 2 and 8 ranks continues a 4-rank run
//   (dp taken from the world size, the micro-batch re-derived where it no longer fits);
// - a resumed run refuses changed model, data and optimizer keys by name.
#include <filesystem>
#include <fstream>
#include <iterator>

#include "train_runs.h"
#include "train/resume.h"

using namespace mt;
using namespace mt::test;

namespace {

// GPT-2 with 8 blocks: 8 pipeline stages at pp 4 x 2 chunks; its tied head on the last
// stage is a copy of the first stage's embedding.
std::string eight_blocks(const TempDir& d) {
  return options("gpt2", 8, 1) + " --model.n_layer=8 --optim.schedule=constant --data.path=" +
         write_tokens(d, "t.bin", 3000, 37);
}

const std::string kTp2Pp2Dp2 = " --parallel.tp=2 --parallel.pp=2 --parallel.zero=1";

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::string export_file(const TempDir& d, const std::string& checkpoint, const std::string& name) {
  std::string out;
  const std::string file = d / name;
  EXPECT_EQ(run_command(std::string(MESHTRAIN_BIN) + " export --checkpoint " + checkpoint + " --out " + file, &out), 0)
      << out;
  return file;
}

// The two files hold the same tensors (names, dtypes, shapes, byte ranges) and metadata.
void expect_same_header(const std::string& a, const std::string& b) {
  SafetensorsReader ra(a), rb(b);
  EXPECT_EQ(ra.metadata(), rb.metadata());
  ASSERT_EQ(ra.entries().size(), rb.entries().size());
  for (const auto& [name, e] : ra.entries()) {
    ASSERT_TRUE(rb.has(name)) << name;
    const SafetensorsEntry& f = rb.entries().at(name);
    EXPECT_EQ(e.dtype, f.dtype) << name;
    EXPECT_EQ(e.shape, f.shape) << name;
    EXPECT_EQ(e.begin, f.begin) << name;
    EXPECT_EQ(e.end, f.end) << name;
  }
}

// Saved at tp 2 x pp 2 x dp 2 on 8 ranks; resumed in one process, at pp 4 x 2 chunks on 4
// ranks and at tp 2 x dp 4 with ZeRO 3 on 8 (and bit-exactly at the saved layout). The
// uninterrupted 8-rank run's export matches a one-process run's to rounding: the layouts sum
// in other orders, so the parameters differ by what expect_equivalent bounds, and each file
// holds exactly its own checkpoint's parameters.
TEST(Elastic, Tp2Pp2Dp2CheckpointResumesAtOtherLayouts) {
  TempDir d;
  const std::string o = eight_blocks(d);
  std::vector<RunResult> resumed;
  const RunResult straight =
      expect_resumes_across_layouts(d, o, 8, kTp2Pp2Dp2,
                                    {{1, ""},
                                     {4, " --parallel.pp=4 --parallel.pp_schedule=interleaved"},
                                     {8, " --parallel.tp=2 --parallel.zero=3"}},
                                    &resumed);
  ASSERT_EQ(resumed.size(), 3u);
  EXPECT_NE(resumed[1].output.find("dp 1 x tp 1 x pp 4 (interleaved, 2 chunks per rank)"), std::string::npos)
      << resumed[1].output;
  EXPECT_NE(resumed[2].output.find("dp 4 x tp 2 x pp 1, ZeRO 3"), std::string::npos) << resumed[2].output;

  const RunResult one = train_run(d, "one", 1, o);
  expect_equivalent(one, straight, "tp 2 x pp 2 x dp 2 against one process");
  const std::string a = export_file(d, d / "straight", "straight.safetensors");
  const std::string b = export_file(d, d / "one", "one.safetensors");
  expect_same_header(a, b);
  expect_export_holds(d, d / "straight", straight);
  expect_export_holds(d, d / "one", one);
}

// The same state at both layouts, bit for bit: parameters are initialised by global index
// (the same values whichever rank holds them) and a step at learning rate 0 leaves them as
// they are, so the two checkpoints hold identical parameters in different shards and
// pieces, and the exports must be identical files.
TEST(Elastic, ExportIsTheSameFileFromAnyLayout) {
  TempDir d;
  const std::string o = eight_blocks(d) + " --training.steps=1 --optim.lr=0";
  const RunResult mesh = train_run(d, "mesh", 8, o + kTp2Pp2Dp2);
  const RunResult one = train_run(d, "one", 1, o);
  ASSERT_EQ(mesh.units, one.units);
  const std::string a = file_bytes(export_file(d, d / "mesh", "mesh.safetensors"));
  const std::string b = file_bytes(export_file(d, d / "one", "one.safetensors"));
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "the exports differ (" << a.size() << " and " << b.size() << " bytes)";
}

// An elastic restart: one command line, run on 4 ranks for 3 steps, then again with
// checkpoint.resume=true on 2 and on 8 ranks: dp follows the world size, the global batch
// and the data position stay, and the losses continue the uninterrupted 4-rank run's.
// {tp and ZeRO options, micro-batch option, what the 2-rank and 8-rank resumes must say}
struct Restart {
  std::string name, layout;
  int micro;
  std::string on2, on8;
};

void PrintTo(const Restart& r, std::ostream* os) { *os << r.name; }

class ElasticRestart : public ::testing::TestWithParam<Restart> {};

TEST_P(ElasticRestart, ContinuesTheRunOnAnotherWorldSize) {
  const Restart& p = GetParam();
  TempDir d;
  const std::string o = options("gpt2", 8, p.micro) + " --optim.schedule=constant --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37) + p.layout + " --checkpoint.resume=true";
  const RunResult straight = train_run(d, "straight", 4, o);
  RunResult last3 = straight;
  last3.loss.erase(last3.loss.begin(), last3.loss.begin() + 3);
  last3.grad_norm.erase(last3.grad_norm.begin(), last3.grad_norm.begin() + 3);
  for (const auto& [ranks, note] : std::vector<std::pair<int, std::string>>{{2, p.on2}, {8, p.on8}}) {
    const std::string name = "on" + std::to_string(ranks);
    train_run(d, name, 4, o + " --training.steps=3");
    std::filesystem::remove(d / (name + ".jsonl"));
    const RunResult r = train_run(d, name, ranks, o);
    EXPECT_NE(r.output.find("elastic restart: saved at 4 ranks"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(note), std::string::npos) << name << ": no \"" << note << "\" in\n" << r.output;
    ASSERT_EQ(r.loss.size(), 3u) << r.output;
    expect_equivalent(last3, r, p.name + " resumed on " + std::to_string(ranks) + " ranks");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ElasticRestart,
    ::testing::Values(
        // micro-batch 2 given (as a config file would): it still fits at dp 2 (two
        // micro-batches per step), not at dp 8 (one sequence per rank), where it gives way.
        Restart{"dp", "", 2, "dp 2 x tp 1 x pp 1, micro-batch 2",
                "training.micro_batch = 2 does not fit this layout (global batch 8 over dp 8: 1 per rank); using 1"},
        // micro-batch derived (4 at dp 2): at dp 1 the default would be 8, more than the saved
        // run held in one forward, so it stays 4; at dp 4 the default, 2, is taken.
        Restart{"tp2_zero1", " --parallel.tp=2 --parallel.zero=1", 0,
                "training.micro_batch = 4: this layout's default (8) is larger than the checkpoint's 4",
                "dp 4 x tp 2 x pp 1, ZeRO 1, micro-batch 2"}),
    [](const ::testing::TestParamInfo<Restart>& i) { return i.param.name; });

// What a resumed run must keep, refused by name before any work (printed once by a job);
// checkpoint.allow_change accepts a chosen data or optimizer key, and the layout and run
// keys change freely.
TEST(Elastic, ResumeRefusesChangedRunKeysByName) {
  TempDir d;
  const std::string bin = MESHTRAIN_BIN;
  const std::string o = options("gpt2", 8, 0) + " --optim.schedule=constant --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37) + " --logging.progress=off --checkpoint.dir=" + d / "ck";
  std::string out;
  ASSERT_EQ(run_command(bin + " train " + o + " --training.steps=2", &out), 0) << out;
  const std::vector<std::pair<std::string, std::vector<std::string>>> refused = {
      {" --optim.lr=0.01", {"optim.lr = 0.003 (this run: 0.01)", "checkpoint.allow_change"}},
      {" --training.global_batch=16", {"training.global_batch = 8 (this run: 16)"}},
      {" --training.seed=1 --data.shuffle=false", {"data.shuffle = true (this run: false)", "training.seed = 1337"}},
      {" --data.path=" + write_tokens(d, "u.bin", 3000, 37, 8), {"data.path = \"" + d / "t.bin" + "\""}},
      {" --optim.name=sgd", {"optim.name = \"adamw\""}},
      {" --model.n_layer=3", {"model.n_layer = 2 (this run: 3)", "the model's shape cannot change"}},
      // numerics that shape no tensor may change on purpose (floats as written, not as doubles)
      {" --model.norm_eps=1e-6", {"model.norm_eps = 1e-05 (this run: 1e-06)", "set checkpoint.allow_change"}},
      {" --model.tie_embeddings=0 --checkpoint.allow_change=model.tie_embeddings",
       {"checkpoint.allow_change cannot take model.tie_embeddings"}},
      {" --training.global_batch=16 --checkpoint.allow_change=training.global_batch",
       {"checkpoint.allow_change cannot take training.global_batch"}},
      {" --checkpoint.allow_change=optim.lrr", {"checkpoint.allow_change names optim.lrr, which is not a configuration key"}},
      {" --checkpoint.allow_change=data.tokenizer", {"cannot take data.tokenizer: it is not a key a resumed run must keep"}},
      // holding out the tail of data.path trains on fewer tokens
      {" --data.val_fraction=0.1", {"data.val_fraction = 0.0 (this run: 0.1)"}},
  };
  for (size_t i = 0; i < refused.size(); ++i) {
    const auto& [opts, wants] = refused[i];
    const std::string how = i < 2 ? " launch -n 2 train " : " train ";  // the same checks on every rank
    EXPECT_NE(run_command(bin + how + o + opts + " --training.steps=4 --checkpoint.resume=true", &out), 0) << opts;
    for (const std::string& want : wants) EXPECT_NE(out.find(want), std::string::npos) << opts << "\n" << out;
    expect_one_error(out, opts);
  }
  // checkpoint.allow_change is not offered for a key it cannot take; a world size whose dp
  // does not divide the kept global batch is told which dp sizes do (not to change the batch).
  ASSERT_NE(run_command(bin + " train " + o + " --training.global_batch=16 --training.steps=4 --checkpoint.resume=true",
                        &out),
            0);
  EXPECT_EQ(out.find("allow_change"), std::string::npos) << out;
  ASSERT_NE(run_command(bin + " launch -n 3 train " + o + " --training.steps=4 --checkpoint.resume=true", &out), 0);
  EXPECT_NE(out.find("A resumed run keeps the checkpoint's training.global_batch = 8: choose the ranks (and "
                     "parallel.tp, pp, cp) so that dp divides it (dp 1, 2, 4 or 8)"),
            std::string::npos)
      << out;
  expect_one_error(out, "3 ranks");
  ASSERT_NE(run_command(bin + " train " + o + " --parallel.pp=4 --training.steps=4 --checkpoint.resume=true", &out), 0);
  EXPECT_EQ(out.find("A resumed run keeps"), std::string::npos) << "not for a layout the ranks do not fit\n" << out;
  EXPECT_TRUE(resume_key_must_match("optim.lr"));
  EXPECT_FALSE(resume_key_must_match("model.init_from"));
  EXPECT_FALSE(resume_key_must_match("training.micro_batch"));
  EXPECT_FALSE(resume_key_must_match("data.tokenizer"));  // (one that loads: a run tries it at start-up)
  // Allowed on purpose, and layout, validation and run keys (a val_path in place of the
  // held-out tail): the run continues, saying what changed.
  ASSERT_EQ(run_command(bin + " train " + o + " --optim.lr=0.001 --checkpoint.allow_change=optim.lr,data.path" +
                            " --training.steps=3 --training.recompute=true --training.attention=materialized" +
                            " --data.val_path=" + d / "u.bin" +
                            " --checkpoint.resume=true",
                        &out),
            0)
      << out;
  EXPECT_NE(out.find("optim.lr = 0.001 instead of the checkpoint's 0.003 (checkpoint.allow_change)"), std::string::npos)
      << out;
  ASSERT_EQ(run_command(bin + " train " + o + " --optim.lr=0.001 --checkpoint.allow_change=optim.lr" +
                            " --training.steps=4 --optim.schedule=cosine --checkpoint.resume=true",
                        &out),
            1)
      << out;  // the schedule is an optimizer key
  EXPECT_NE(out.find("optim.schedule = \"constant\" (this run: \"cosine\")"), std::string::npos) << out;
  ASSERT_EQ(run_command(bin + " train " + o + " --optim.lr=0.001 --model.norm_eps=1e-6 --model.rope_theta=500000" +
                            " --checkpoint.allow_change=optim.lr,model.norm_eps,model.rope_theta --training.steps=4" +
                            " --checkpoint.resume=true",
                        &out),
            0)
      << out;
  EXPECT_NE(out.find("model.norm_eps = 1e-06 instead of the checkpoint's 1e-05 (checkpoint.allow_change)"),
            std::string::npos)
      << out;
}

}  // namespace
