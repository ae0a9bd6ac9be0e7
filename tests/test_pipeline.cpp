// Pipeline parallelism: stage balancing, the slots a schedule needs, and whole training runs
// (meshtrain launch) at pp 2 and 4 with every schedule, m = P, 2P and an m that P does not
// divide, both families, tied and untied heads, and pp x dp with DDP and ZeRO 1 and 2, each
// compared with the single-rank run; a checkpoint written at pp 2 x dp 2 resumes at pp 1
// and at pp 4 with interleaving; a user's schedule file runs; a stuck rank is named; the
// trace holds every action.
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "core/error.h"
#include "parallel/pipeline.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

ModelConfig model(int layers, int vocab) {
  ModelConfig m;
  m.family = "gpt2", m.n_layer = layers, m.n_head = 4, m.d_model = 32, m.vocab_size = vocab, m.seq_len = 16;
  return m;
}

PipeLayout ranks(int pp, int chunks = 1, Placement placement = Placement::loop) {
  PipeLayout l;
  l.pp = pp, l.chunks = chunks, l.placement = placement;
  return l;
}

TEST(PipelineStages, AutoBalancesBlocksAgainstTheHeadAndEmbedding) {
  // A small vocabulary: the head costs a fraction of a block, so blocks split evenly.
  EXPECT_EQ(pipeline_layers(model(8, 37), ranks(4), "auto"), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(pipeline_layers(model(7, 37), ranks(7), "auto"), std::vector<int>(7, 1));
  // A vocabulary whose head costs about three blocks: the last stage takes fewer blocks, and
  // the costliest stage is the cheapest any split allows.
  const ModelConfig big = model(12, 2400);
  const std::vector<int> layers = pipeline_layers(big, ranks(4), "auto");
  EXPECT_LT(layers.back(), layers.front());
  const std::vector<double> cost = pipeline_stage_costs(big, layers);
  const double worst = *std::max_element(cost.begin(), cost.end());
  for (const std::vector<int>& other : {std::vector<int>{3, 3, 3, 3}, std::vector<int>{4, 3, 3, 2}, std::vector<int>{4, 4, 3, 1}}) {
    const std::vector<double> c = pipeline_stage_costs(big, other);
    EXPECT_LE(worst, *std::max_element(c.begin(), c.end()));
  }
  EXPECT_EQ(pipeline_layers(big, ranks(4), "3,4,4,1"), (std::vector<int>{3, 4, 4, 1}));
  // With chunks, what balances is each rank's total over its stages: with a head of about
  // two blocks (vocabulary 750 at d_model 32), interleaving over 2 ranks puts the rank
  // holding the head (stages 1 and 3) on fewer blocks, and zbv's rank 0 (first and last
  // stage) likewise.
  const ModelConfig two = model(6, 750);
  const std::vector<int> loop = pipeline_layers(two, ranks(2, 2), "auto");
  EXPECT_EQ(loop, (std::vector<int>{2, 1, 2, 1}));
  EXPECT_EQ(pipeline_layers(two, ranks(2, 2, Placement::vee), "auto"), (std::vector<int>{1, 2, 2, 1}));
  // With 10 blocks and that head, every placement balances exactly: 6 + 4 at v = 1, and
  // 3, 3, 3, 1 at v = 2 (the head's stage takes one block) in both placements.
  const ModelConfig ten = model(10, 750);
  EXPECT_EQ(pipeline_layers(ten, ranks(2), "auto"), (std::vector<int>{6, 4}));
  EXPECT_EQ(pipeline_layers(ten, ranks(2, 2), "auto"), (std::vector<int>{3, 3, 3, 1}));
  EXPECT_EQ(pipeline_layers(ten, ranks(2, 2, Placement::vee), "auto"), (std::vector<int>{3, 3, 3, 1}));
}

TEST(PipelineStages, BadListsAreRefusedByName) {
  auto refuses = [](const std::string& spec, int stages, const std::string& want) {
    try {
      pipeline_layers(model(8, 37), ranks(stages), spec);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refuses("3,3", 4, "list 4 numbers summing to 8");
  refuses("2,2,2,3", 4, "list 4 numbers summing to 8");
  refuses("2,2,x,4", 4, "\"x\" is not a number of blocks");
  refuses("4,0,2,2", 4, "\"0\" is not a number of blocks");
  refuses("auto", 9, "model.n_layer = 8 is fewer than the 9 pipeline stages");
}

// A rank keeps exactly the micro-batches its list has in flight: 1f1b P - r, gpipe all m,
// zb-h1 (held until the weight half) as 1f1b's first rank at most.
TEST(PipelineStages, SlotsFollowTheSchedule) {
  const int P = 4, m = 8;
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(schedule_slots(schedule_make("1f1b", P, 1, m), r), std::vector<int>{P - r}) << r;
    EXPECT_EQ(schedule_slots(schedule_make("gpipe", P, 1, m), r), std::vector<int>{m}) << r;
    EXPECT_LE(schedule_slots(schedule_make("zb-h1", P, 1, m), r)[0], P) << r;
  }
  // One rank, m micro-batches: accumulation, one slot.
  EXPECT_EQ(schedule_slots(schedule_make("1f1b", 1, 1, m), 0), std::vector<int>{1});
  // The forward-only lists (validation) are deadlock-free and need one slot per chunk.
  for (const Schedule& s : {schedule_make("interleaved", 4, 2, 8), schedule_make("zbv", 4, 2, 8)}) {
    const Schedule f = schedule_forward_only(s.layout);
    const std::vector<int> stopped = schedule_replay(f, [](ActionRef, const ActionRef*) {});
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(stopped[r], static_cast<int>(f.ranks[r].size())) << s.name << " rank " << r;
      EXPECT_EQ(schedule_slots(f, r), (std::vector<int>{1, 1})) << s.name << " rank " << r;
    }
  }
}

// Options for the runs: 4 blocks (so that pp 4, and pp 2 with two chunks, have a block per
// stage), gradient clipping active (the norm must count each element once over the stages).
std::string pp_options(const std::string& family, int global, int micro, const std::string& data) {
  return options(family, global, micro) + " --model.n_layer=4 --optim.grad_clip=0.05" + data;
}

class PipelineFamily : public ::testing::TestWithParam<std::string> {};

// Every schedule trains what one process trains. Tolerances are expect_equivalent's
// (train_runs.h): a pipeline computes each micro-batch's forward and backward with the same
// operations as one rank and accumulates each unit's gradient over micro-batches in the same
// order, and the gradient norm adds the units' sums in unit order. What differs is a tied
// embedding's gradient (its two copies' sums added at the end) and, with dp, the
// reductions; an untied model without dp trains one rank's bits, and schedules with the
// same stages give the same bits.
TEST_P(PipelineFamily, SchedulesMatchSingleRank) {
  TempDir d;
  const std::string fam = GetParam(), data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  // {name, ranks, global batch, layout}; micro-batch 1, so m = global / dp
  const std::vector<std::tuple<std::string, int, int, std::string>> runs = {
      {"pp2_gpipe_m4", 2, 4, " --parallel.pp=2 --parallel.pp_schedule=gpipe"},
      {"pp2_1f1b_m4", 2, 4, " --parallel.pp=2 --parallel.pp_schedule=1f1b"},
      {"pp2_zb_m4", 2, 4, " --parallel.pp=2 --parallel.pp_schedule=zb-h1"},
      {"pp2_interleaved_m4", 2, 4, " --parallel.pp=2 --parallel.pp_schedule=interleaved"},
      {"pp2_zbv_m4", 2, 4, " --parallel.pp=2 --parallel.pp_schedule=zbv"},
      {"pp2_1f1b_m2", 2, 2, " --parallel.pp=2 --parallel.pp_schedule=1f1b"},
      {"pp2_zb_m3", 2, 3, " --parallel.pp=2 --parallel.pp_schedule=zb-h1"},
      {"pp2_1f1b_m3", 2, 3, " --parallel.pp=2 --parallel.pp_schedule=1f1b"},
      {"pp2_zbv_m3", 2, 3, " --parallel.pp=2 --parallel.pp_schedule=zbv"},
      {"pp4_1f1b_m4", 4, 4, " --parallel.pp=4 --parallel.pp_schedule=1f1b"},
      {"pp4_zb_m8", 4, 8, " --parallel.pp=4 --parallel.pp_schedule=zb-h1"},
      {"pp4_gpipe_m8", 4, 8, " --parallel.pp=4 --parallel.pp_schedule=gpipe"},
      {"pp4_1f1b_m5", 4, 5, " --parallel.pp=4 --parallel.pp_schedule=1f1b"},
      {"pp2dp2_ddp", 4, 8, " --parallel.pp=2 --parallel.pp_schedule=1f1b"},
      {"pp2dp2_zero1", 4, 8, " --parallel.pp=2 --parallel.zero=1 --parallel.pp_schedule=interleaved"},
      {"pp2dp2_zero2", 4, 8, " --parallel.pp=2 --parallel.zero=2 --parallel.pp_schedule=zb-h1"},
      {"pp2dp2_zero3", 4, 8, " --parallel.pp=2 --parallel.zero=3 --parallel.pp_schedule=zbv"},
  };
  std::map<int, RunResult> one;  // by global batch
  std::map<std::string, RunResult> got;
  for (const auto& [name, ranks, global, layout] : runs) {
    if (!one.count(global)) {
      one[global] = train_run(d, "one" + std::to_string(global), 1, pp_options(fam, global, 1, data));
      expect_memory_as_predicted(one[global], "one");
    }
    RunResult& r = got[name] = train_run(d, name, ranks, pp_options(fam, global, 1, data) + layout);
    expect_equivalent(one[global], r, fam + " " + name);
    expect_memory_as_predicted(r, name);
    // Untied and without dp, each unit's gradient and its share of the norm are one rank's
    // own: the run is one rank's, bit for bit, whatever the schedule.
    if (fam == "llama" && name.find("dp2") == std::string::npos) expect_bit_identical(one[global], r, fam + " " + name);
  }
  // The same stages and micro-batches under another schedule: the same bits (a tied head's
  // two copies are summed the same way too).
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{{"pp2_gpipe_m4", "pp2_1f1b_m4"},
                                                                             {"pp2_zb_m4", "pp2_1f1b_m4"},
                                                                             {"pp2_zb_m3", "pp2_1f1b_m3"},
                                                                             {"pp4_gpipe_m8", "pp4_zb_m8"}})
    expect_bit_identical(got[b], got[a], fam + " " + a + " vs " + b);
}

// Stages of other sizes than auto's: a listed uneven split (4 + 2 blocks of 6) under 1f1b,
// and interleaved with 3 chunks a rank (6 stages of one block on 2 ranks), each against one
// rank (bit for bit where untied, as above).
TEST_P(PipelineFamily, UnevenStagesAndThreeChunksMatchSingleRank) {
  TempDir d;
  const std::string fam = GetParam(), opts = pp_options(fam, 4, 1, " --data.path=" + write_tokens(d, "t.bin", 3000, 37)) +
                                              " --model.n_layer=6";
  const RunResult one = train_run(d, "one", 1, opts);
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::string>>{
           {"pp2_layers42", " --parallel.pp=2 --parallel.pp_layers=4,2"},
           {"pp2_interleaved_v3", " --parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.pp_chunks=3"}}) {
    const RunResult r = train_run(d, name, 2, opts + layout);
    ASSERT_EQ(r.config.model.n_layer, 6) << name;
    EXPECT_NE(r.output.find(name == "pp2_layers42" ? "1f1b, 2 ranks x 1 chunk, 4 micro-batches per step; this rank's "
                                                     "blocks 0-3;"
                                                   : "interleaved, 2 ranks x 3 chunks"),
              std::string::npos)
        << r.output;
    expect_equivalent(one, r, fam + " " + name);
    expect_memory_as_predicted(r, name);
    if (fam == "llama") expect_bit_identical(one, r, fam + " " + name);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, PipelineFamily, ::testing::Values("gpt2", "llama"));

// A head tied to the embedding on two ranks, and untied on one: GPT-2 untied and Llama tied.
TEST(Pipeline, TiedAndUntiedHeads) {
  TempDir d;
  const std::string data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  for (const auto& [fam, tie] : std::vector<std::pair<std::string, std::string>>{{"gpt2", "false"}, {"llama", "true"}}) {
    const std::string o = pp_options(fam, 4, 1, data) + " --model.tie_embeddings=" + tie;
    const RunResult one = train_run(d, fam + "1", 1, o);
    expect_equivalent(one, train_run(d, fam + "pp2", 2, o + " --parallel.pp=2"), fam + " tie " + tie + " pp 2");
    expect_equivalent(one, train_run(d, fam + "zbv", 2, o + " --parallel.pp=2 --parallel.pp_schedule=zbv"),
                      fam + " tie " + tie + " zbv");
  }
}

// Checkpoints record whole units: written at pp 2 x dp 2 (ZeRO 1), they resume at pp 1 and
// at pp 4 with two chunks per rank (8 stages) and continue the uninterrupted run's losses
// (to rounding), and bit-exactly at the same layout.
TEST(Pipeline, CheckpointResumesAtAnotherPipeline) {
  TempDir d;
  const std::string o = options("gpt2", 8, 1) + " --model.n_layer=8 --optim.schedule=constant --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  expect_resumes_at_other_layouts(d, o, " --parallel.pp=2 --parallel.zero=1",
                                  {{1, ""}, {4, " --parallel.pp=4 --parallel.pp_schedule=interleaved"}});
}

// A schedule written as a file (here 1f1b's own lists) runs and trains bit-identically to
// the named one; a file for another layout is refused naming both and the batch that fits.
TEST(Pipeline, ScheduleFromFile) {
  TempDir d;
  const std::string o = pp_options("llama", 4, 1, " --data.path=" + write_tokens(d, "t.bin", 3000, 37)) +
                        " --parallel.pp=2";
  schedule_write(d / "mine.csv", schedule_make("1f1b", 2, 1, 4));
  expect_bit_identical(train_run(d, "named", 2, o), train_run(d, "file", 2, o + " --parallel.pp_schedule=file:" + d / "mine.csv"),
                       "schedule file");
  std::string out;
  EXPECT_NE(run_command(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o + " --training.global_batch=8" +
                            " --parallel.pp_schedule=file:" + d / "mine.csv" + " --logging.progress=off",
                        &out),
            0);
  EXPECT_NE(out.find("is a schedule of 4 micro-batches per step, but this run has 8 (training.global_batch / "
                     "(parallel.dp x training.micro_batch) = 8 / 1); set training.global_batch=4, or "
                     "training.micro_batch=2, or write the file for 8 micro-batches"),
            std::string::npos)
      << out;
}

// Layouts a schedule cannot run are refused before any work, once, naming the key and a value that works.
TEST(Pipeline, LayoutsThatCannotRunAreRefused) {
  TempDir d;
  const std::string o = pp_options("gpt2", 4, 1, " --data.path=" + write_tokens(d, "t.bin", 3000, 37));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {" --parallel.pp=2 --parallel.pp_schedule=zbv --parallel.pp_chunks=3", "set parallel.pp_chunks=2"},
      {" --parallel.pp=2 --parallel.pp_schedule=interleaved --training.global_batch=3",
       "set training.global_batch=4 for 4 micro-batches"},
      {" --parallel.pp=2 --parallel.pp_chunks=4 --parallel.pp_schedule=interleaved",
       "model.n_layer = 4 is fewer than parallel.pp x parallel.pp_chunks = 2 x 4"},
      {" --parallel.pp=2 --parallel.pp_layers=1,2", "lists 2 stages holding 3 blocks"},
      {" --parallel.pp=2 --parallel.pp_schedule=zb-h1 --training.recompute=true", "use 1f1b or interleaved"},
      // every rank would make every rank's lists of 2^23 forward passes: gigabytes
      {" --parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.pp_chunks=4 --training.global_batch=1048576 "
       "--training.micro_batch=1",
       "parallel.pp x parallel.pp_chunks x the micro-batches per step = 2 x 4 x 1048576 forward passes per step, more "
       "than the 4194304 meshtrain schedules; raise training.micro_batch"},
      {" --parallel.pp=2 --parallel.pp_schedule=2f2b", "is not a schedule"},
      // a schedule file that is no file: the key named
      {" --parallel.pp=2 --parallel.pp_schedule=file:", "parallel.pp_schedule = file: names no file"},
      {" --parallel.pp=2 --parallel.pp_schedule=file:" + d.path,
       "parallel.pp_schedule = file:" + d.path + ": " + d.path + " is a directory, not a schedule file"},
      {" --parallel.pp=2 --parallel.pp_schedule=file:" + d / "none.csv",
       "parallel.pp_schedule = file:" + d / "none.csv" + ": cannot open the schedule file " + d / "none.csv" +
           ": No such file"},
  };
  expect_refused(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o, bad);
}

// A pipeline rank that stops answering: its neighbour's watchdog names what it waits for
// (the action, micro-batch, chunk and peer), and the job ends instead of hanging.
TEST(Pipeline, StuckRankIsNamed) {
  TempDir d;
  const std::string o = pp_options("gpt2", 4, 1, " --data.path=" + write_tokens(d, "t.bin", 3000, 37));
  std::string out;
  const int rc = run_command(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o +
                                 " --parallel.pp=2 --parallel.test_fault=hang:1 --parallel.timeout_s=3"
                                 " --logging.progress=off",
                             &out);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("pipeline rank 0 (stage 0, chunk 0) has waited 3 s for its data: RECV_GRAD micro 0 chunk 0 from "
                     "rank 1"),
            std::string::npos)
      << out;
}

// logging.trace: every step's actions on every pipeline rank, as Chrome trace events, the
// picture beside it, and the measured bubble in the summary.
TEST(Pipeline, TraceHoldsEveryAction) {
  TempDir d;
  const std::string o = pp_options("gpt2", 4, 1, " --data.path=" + write_tokens(d, "t.bin", 3000, 37)) +
                        " --parallel.pp=2 --parallel.pp_schedule=zb-h1 --logging.trace=" + d / "trace.json";
  const RunResult r = train_run(d, "traced", 2, o);
  const Schedule s = schedule_make("zb-h1", 2, 1, 4);
  size_t actions = 0;
  for (const auto& list : s.ranks) actions += list.size();
  std::ifstream in(d / "trace.json");
  const auto j = nlohmann::json::parse(in);
  size_t events = 0;
  for (const auto& e : j["traceEvents"]) events += e["ph"] == "X";
  EXPECT_EQ(events, actions * r.loss.size());
  EXPECT_TRUE(std::filesystem::exists(d / "trace.json.svg"));
  ASSERT_TRUE(r.summary.contains("pp_bubble")) << r.summary.dump();
  EXPECT_GT(r.summary["pp_bubble"].get<double>(), 0);
  EXPECT_LT(r.summary["pp_bubble"].get<double>(), 1);
  EXPECT_GT(r.summary["pp_simulated_ms"].get<double>(), 0);
}

}  // namespace
