// Every parallel axis composed: whole training runs (meshtrain launch) named by their layout,
// tp x pp with every schedule (interleaved and zbv chunks, zb-h1's split backward under tp
// and sequence parallelism), tp x pp x dp with DDP and ZeRO 1, 2 and 3, HYBRID_SHARD with
// tp, recomputation (of every block, or of each chunk's first) and accumulation inside
// composed layouts, tied and untied heads across
// tp x pp, and 8-rank layouts with all three of tp, pp and dp for each family. Each trains
// what one process trains (losses, gradient norms and final parameters, expect_equivalent),
// with the busiest rank's memory by tag as the formulas say and every tp byte predicted.
//
// Where the reduction order is fixed, a layout gives the bits of another (its twin):
// - A pipeline changes no sum of an untied model. Each unit's gradient accumulates its
//   micro-batches in the same order on whichever rank holds it, the loss and the
//   gradient norm add per-unit sums in unit order, and every other sum (tp's, dp's, ZeRO's)
//   is over the same ranks in the same order. So an untied model trains the same bits at
//   any pp, schedule, number of chunks and placement, for a given tp, sequence
//   parallelism, dp, ZeRO stage and micro-batch (at tp 1 and dp 1 that is one process's
//   run), and recomputation changes nothing either.
// - A tied head on another rank than the embedding adds its copy's gradient to the
//   embedding's once per step, where one rank adds every micro-batch's: those bits are
//   the same only between schedules with the same stages (gpipe, 1f1b, zb-h1 at one chunk).
// - ZeRO 2 and 3 reduce-scatter a unit's gradient after each of its weight halves (B or
//   BW). A split backward (zb-h1, zbv) may run several micro-batches' input halves (which
//   hold the norms' and biases' gradients) before one weight half, so it groups those terms
//   into other reductions than a whole backward: with dp, zb-h1 and zbv round apart from
//   gpipe, 1f1b and interleaved at those stages (DDP and ZeRO 1 reduce once per step: bits).
// Everything else is compared to rounding (expect_equivalent's derived bounds).
//
// Cost: tiny models (options(), 4 blocks so that pp 2 with two chunks has a block per
// stage), 6 steps; one single-rank reference per family, head and micro-batch serves every
// layout, and runs are kept per process, so a twin that is also a listed layout runs once.
#include <map>
#include <tuple>

#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

// A composed layout: its name (family first; "tied" or "untied" where the head is not the
// family's default: GPT-2 ties, Llama does not), ranks, micro-batch and the keys that make
// it; `twin` names a listed layout, or "one" for the single-rank run, with the same bits.
struct Layout {
  std::string name;
  int ranks, micro;
  std::string keys, twin;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }  // gtest's name for a parameter

const std::string kSp = " --parallel.sequence_parallel=true";
std::string tp_pp(int tp, int pp, const std::string& schedule) {
  return " --parallel.tp=" + std::to_string(tp) + " --parallel.pp=" + std::to_string(pp) +
         " --parallel.pp_schedule=" + schedule;
}
std::string zero(int stage) { return " --parallel.zero=" + std::to_string(stage); }
const std::string kRecompute = " --training.recompute=true";
const std::string kRecomputeFirst = kRecompute + " --training.recompute_blocks=1";  // of each chunk's blocks
const std::string kHybrid = " --parallel.sharding=HYBRID_SHARD --parallel.shard_group=2";

// Global batch 8; micro-batch 1 unless said (then m = 8 / (dp x micro)).
const std::vector<Layout> kLayouts = {
    // tp x pp, GPT-2 (tied: the head on the last stage holds a copy of the embedding)
    {"gpt2_tp2_pp2_gpipe", 4, 1, tp_pp(2, 2, "gpipe"), ""},
    {"gpt2_tp2_pp2_1f1b", 4, 1, tp_pp(2, 2, "1f1b"), "gpt2_tp2_pp2_gpipe"},
    {"gpt2_tp2_pp2_zbh1", 4, 1, tp_pp(2, 2, "zb-h1"), "gpt2_tp2_pp2_1f1b"},
    {"gpt2_tp2_pp2_interleaved", 4, 1, tp_pp(2, 2, "interleaved"), ""},
    {"gpt2_tp2_pp2_zbv", 4, 1, tp_pp(2, 2, "zbv"), ""},  // embedding and head on rank 0: no copy
    {"gpt2_tp2_pp2_sp_1f1b_recompute", 4, 1, tp_pp(2, 2, "1f1b") + kSp + kRecompute, ""},
    {"gpt2_tp2_pp2_sp_zbh1", 4, 1, tp_pp(2, 2, "zb-h1") + kSp, "gpt2_tp2_pp2_sp_1f1b_recompute"},
    {"gpt2_tp2_pp2_sp_1f1b_recompute_first", 4, 1, tp_pp(2, 2, "1f1b") + kSp + kRecomputeFirst,
     "gpt2_tp2_pp2_sp_1f1b_recompute"},
    {"gpt2_tp2_pp2_sp_zbv_m2", 4, 2, tp_pp(2, 2, "zbv") + kSp, ""},
    {"gpt2_tp2_pp2_sp_interleaved_recompute_m2", 4, 2, tp_pp(2, 2, "interleaved") + kSp + kRecompute, ""},
    {"gpt2_untied_tp2_pp2_zbh1", 4, 1, tp_pp(2, 2, "zb-h1"), ""},
    {"gpt2_untied_tp2_pp2_sp_interleaved", 4, 1, tp_pp(2, 2, "interleaved") + kSp, ""},
    {"gpt2_tp2_pp4_zbh1", 8, 1, tp_pp(2, 4, "zb-h1"), ""},
    // tp x pp x dp: DDP and ZeRO 1-3
    {"gpt2_tp2_pp2_dp2_ddp_interleaved", 8, 1, tp_pp(2, 2, "interleaved"), ""},
    {"gpt2_tp2_pp2_dp2_zero1", 8, 1, tp_pp(2, 2, "1f1b") + zero(1), ""},
    {"gpt2_tp2_pp2_dp2_zero1_zbh1", 8, 1, tp_pp(2, 2, "zb-h1") + zero(1), "gpt2_tp2_pp2_dp2_zero1"},
    {"gpt2_tp2_pp2_dp2_zero2_sp_zbh1", 8, 1, tp_pp(2, 2, "zb-h1") + zero(2) + kSp, ""},
    {"gpt2_tp2_pp2_dp2_zero3_zbv", 8, 1, tp_pp(2, 2, "zbv") + zero(3), ""},
    {"gpt2_tp2_pp2_dp2_ddp_sp_recompute_m2", 8, 2, tp_pp(2, 2, "1f1b") + kSp + kRecompute, ""},
    // HYBRID_SHARD with tp: shards over 2 of the 4 dp ranks, replicas summed across the pairs
    {"gpt2_tp2_dp4_hybrid", 8, 1, " --parallel.tp=2" + kHybrid, ""},
    {"gpt2_tp2_pp2_dp4_hybrid_sp", 16, 1, tp_pp(2, 2, "1f1b") + kHybrid + kSp, ""},

    // tp x pp, Llama (untied: a pipeline keeps the bits of the same tp without it)
    {"llama_tp2", 2, 1, " --parallel.tp=2", ""},
    {"llama_tp2_pp2_1f1b", 4, 1, tp_pp(2, 2, "1f1b"), "llama_tp2"},
    {"llama_tp2_pp2_gpipe", 4, 1, tp_pp(2, 2, "gpipe"), "llama_tp2"},
    {"llama_tp2_pp2_zbh1", 4, 1, tp_pp(2, 2, "zb-h1"), "llama_tp2"},
    {"llama_tp2_pp2_interleaved_recompute", 4, 1, tp_pp(2, 2, "interleaved") + kRecompute, "llama_tp2"},
    {"llama_tp2_pp2_sp_zbv", 4, 1, tp_pp(2, 2, "zbv") + kSp, ""},
    {"llama_tp2_pp2_sp_zbh1", 4, 1, tp_pp(2, 2, "zb-h1") + kSp, "llama_tp2_pp2_sp_zbv"},
    {"llama_tp2_pp2_sp_interleaved", 4, 1, tp_pp(2, 2, "interleaved") + kSp, "llama_tp2_pp2_sp_zbv"},
    {"llama_tp2_pp2_gpipe_m2", 4, 2, tp_pp(2, 2, "gpipe"), ""},
    {"llama_tp4_pp2_sp_zbv", 8, 1, tp_pp(4, 2, "zbv") + kSp, ""},  // each key/value head on two tp ranks
    {"llama_tied_tp2_pp2_1f1b", 4, 1, tp_pp(2, 2, "1f1b"), ""},
    {"llama_tied_tp2_pp2_sp_zbv", 4, 1, tp_pp(2, 2, "zbv") + kSp, ""},
    // pp alone with recomputation and accumulation: one process's bits
    {"llama_pp2_v2_recompute_m2", 2, 2, tp_pp(1, 2, "interleaved") + kRecompute, "one"},
    {"llama_pp2_recompute_first_m2", 2, 2, tp_pp(1, 2, "1f1b") + kRecomputeFirst, "one"},
    // pp x dp and tp x pp x dp
    {"llama_dp2_zero3", 2, 1, zero(3), ""},
    {"llama_pp2_v2_dp2_zero3", 4, 1, tp_pp(1, 2, "interleaved") + zero(3), "llama_dp2_zero3"},
    {"llama_tp2_pp2_dp2_ddp_sp_recompute", 8, 1, tp_pp(2, 2, "1f1b") + kSp + kRecompute, ""},
    {"llama_tp2_pp2_dp2_zero1_zbv", 8, 1, tp_pp(2, 2, "zbv") + zero(1), ""},
    {"llama_tp2_pp2_dp2_zero2_interleaved_m2", 8, 2, tp_pp(2, 2, "interleaved") + zero(2), ""},
    {"llama_tp2_pp2_dp2_zero3_sp_zbh1", 8, 1, tp_pp(2, 2, "zb-h1") + zero(3) + kSp, ""},
    {"llama_tp2_dp2_zero3_sp", 4, 1, " --parallel.tp=2" + zero(3) + kSp, ""},
    {"llama_tp2_pp2_dp2_zero3_sp_gpipe", 8, 1, tp_pp(2, 2, "gpipe") + zero(3) + kSp, "llama_tp2_dp2_zero3_sp"},
    {"llama_tied_tp2_pp2_dp2_zero3_interleaved", 8, 1, tp_pp(2, 2, "interleaved") + zero(3), ""},
    {"llama_tp2_dp4_hybrid_sp", 8, 1, " --parallel.tp=2" + kHybrid + kSp, ""},
};

const Layout& layout_named(const std::string& name) {
  for (const Layout& l : kLayouts)
    if (l.name == name) return l;
  ADD_FAILURE() << "no layout " << name;
  return kLayouts.front();
}

// The runs of this process, by name, in one directory for all the tests of the process.
struct Runs {
  TempDir dir;
  std::string data = write_tokens(dir, "t.bin", 3000, 37);
  std::map<std::string, RunResult> done;

  // The options every run of a layout shares with its single-rank reference.
  std::string base(const Layout& l) const {
    const std::string fam = l.name.substr(0, l.name.find('_'));
    std::string o = options(fam, 8, l.micro) + " --model.n_layer=4 --optim.grad_clip=0.05 --data.path=" + data;
    if (l.name.find("_tied_") != std::string::npos) o += " --model.tie_embeddings=true";
    if (l.name.find("_untied_") != std::string::npos) o += " --model.tie_embeddings=false";
    return o;
  }
  const RunResult& run(const std::string& name, int ranks, const std::string& opts) {
    auto it = done.find(name);
    if (it == done.end()) it = done.emplace(name, train_run(dir, name, ranks, opts)).first;
    return it->second;
  }
  // One process at the layout's family, head and micro-batch.
  const RunResult& one(const Layout& l) {
    const std::string head = l.name.find("_tied_") != std::string::npos     ? "_tied"
                             : l.name.find("_untied_") != std::string::npos ? "_untied"
                                                                            : "";
    return run("one_" + l.name.substr(0, l.name.find('_')) + head + "_m" + std::to_string(l.micro), 1, base(l));
  }
  const RunResult& layout(const Layout& l) { return run(l.name, l.ranks, base(l) + l.keys); }
};

Runs& runs() {
  static Runs r;
  return r;
}

class Layouts : public ::testing::TestWithParam<Layout> {};

TEST_P(Layouts, TrainWhatOneProcessTrains) {
  const Layout& l = GetParam();
  Runs& rs = runs();
  const RunResult& one = rs.one(l);
  expect_memory_as_predicted(one, "one");
  const RunResult& r = rs.layout(l);
  ASSERT_EQ(r.loss.size(), 6u) << l.name;
  expect_equivalent(one, r, l.name);
  expect_memory_as_predicted(r, l.name);
  if (l.keys.find("--parallel.tp=") != std::string::npos && l.keys.find("--parallel.tp=1") == std::string::npos)
    expect_tp_bytes_as_predicted(rs.dir, l.name);
  if (l.twin == "one") expect_bit_identical(one, r, l.name + " vs one process");
  else if (!l.twin.empty()) expect_bit_identical(rs.layout(layout_named(l.twin)), r, l.name + " vs " + l.twin);
}

INSTANTIATE_TEST_SUITE_P(Composed, Layouts, ::testing::ValuesIn(kLayouts),
                         [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// Checkpoints of a composed layout hold whole units: written at tp 2 x pp 2 x dp 2 with ZeRO 3
// (each rank its shard of its tp rows of its stages' units), they resume in one process and
// at tp 2 x pp 2 with zbv and sequence parallelism, continuing the uninterrupted run to
// rounding, and at the same layout bit-exactly; the export assembles the whole model.
TEST(LayoutsCheckpoint, ResumesAtOtherComposedLayouts) {
  TempDir d;
  const std::string o = options("llama", 8, 1) + " --model.n_layer=4 --optim.schedule=constant --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  expect_resumes_at_other_layouts(d, o, tp_pp(2, 2, "1f1b") + zero(3), {{1, ""}, {4, tp_pp(2, 2, "zbv") + kSp}}, 8);
}

// Layouts that cannot run are refused before any work (no metrics file is started), with
// one message, printed once, that names the keys and the nearest values that work.
TEST(LayoutsRefused, NamingTheKeysAndTheNearestValues) {
  TempDir d;
  const std::string o = options("gpt2", 8, 0) + " --model.n_layer=4 --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  // {ranks, keys, what the message must say}
  const std::vector<std::tuple<int, std::string, std::string>> bad = {
      {8, " --model.n_head=6 --model.d_model=48" + tp_pp(4, 2, "1f1b"),
       "model.n_head = 6 does not split over parallel.tp = 4 ranks (each rank holds whole heads); parallel.tp can be "
       "1, 2, 3 or 6 for this model"},
      {8, " --model.family=llama --model.n_head=12 --model.n_kv_head=3 --model.d_model=48" + tp_pp(4, 2, "zbv"),
       "model.n_kv_head = 3 and parallel.tp = 4: one must divide the other"},
      {8, " --model.seq_len=18" + tp_pp(4, 2, "zb-h1") + kSp, "model.seq_len = 18 does not split over parallel.tp = 4"},
      {4, tp_pp(2, 2, "zbv") + " --parallel.pp_chunks=3", "set parallel.pp_chunks=2"},
      {8, tp_pp(2, 2, "interleaved") + " --training.global_batch=6",
       "interleaved needs a multiple of the 2 pipeline ranks; set training.global_batch=8 for 4 micro-batches"},
      {4, tp_pp(2, 2, "zbv") + kSp + kRecompute, "use 1f1b or interleaved, or recompute=false"},
      {8, tp_pp(2, 4, "interleaved"),
       "model.n_layer = 4 is fewer than parallel.pp x parallel.pp_chunks = 4 x 2 stages: every stage needs a block; "
       "set parallel.pp=2 or model.n_layer=8"},
      {8, tp_pp(2, 2, "1f1b") + " --training.global_batch=7",
       "training.global_batch = 7 is not divisible by parallel.dp = 2; set training.global_batch=6 or 8"},
      {6, tp_pp(2, 2, "1f1b"), "the job has 6 ranks, not a multiple of parallel.tp x parallel.pp x parallel.cp = 4; launch a multiple of 4 ranks"},
      {8, tp_pp(2, 2, "1f1b") + " --parallel.sharding=HYBRID_SHARD",
       "dp = 2 has none: use parallel.sharding=FULL_SHARD (one shard group of all its ranks), or launch 16 ranks for dp = 4"},
      {8, " --parallel.tp=2 --parallel.sharding=HYBRID_SHARD --parallel.shard_group=4",
       "needs parallel.shard_group between 2 and dp - 1 dividing dp = 4 (got 4); set parallel.shard_group=2"},
      {8, " --parallel.tp=2 --parallel.zero=1 --parallel.shard_group=3",
       "parallel.shard_group = 3 does not divide dp = 4; parallel.shard_group can be 1, 2 or 4"},
  };
  for (const auto& [ranks, keys, want] : bad) {
    std::string out;
    const std::string metrics = d / "refused.jsonl";
    const int rc = run_command(std::string(MESHTRAIN_BIN) + " launch -n " + std::to_string(ranks) + " train " + o + keys +
                                   " --logging.progress=off --logging.metrics=" + metrics,
                               &out);
    EXPECT_NE(rc, 0) << keys;
    EXPECT_NE(out.find(want), std::string::npos) << keys << "\n" << out;
    expect_one_error(out, keys);
    EXPECT_FALSE(std::filesystem::exists(metrics)) << keys << ": refused after the run had started";
  }
}

}  // namespace
