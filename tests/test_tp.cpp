// Tensor parallelism in whole training runs (meshtrain launch): tp 2 and 4, tp x dp with
// ZeRO 0, 1 and 3, sequence parallelism, accumulation and recomputation train what one
// process trains; a
// checkpoint written at tp 2 x dp 2 resumes at tp 1 and tp 4; layouts the model cannot
// split are refused before any work. The model-level checks (parameters by global index,
// gradients of every plan entry) are in mpi_test_tp.cpp.
#include <tuple>

#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

class TpFamily : public ::testing::TestWithParam<std::string> {};

// The tolerances are expect_equivalent's (train_runs.h): tp changes only the order of sums
// (row-parallel products split over d_model / tp or F / tp inputs and added over ranks, the
// loss's row statistics over the vocabulary shards), the rounding that derivation covers.
TEST_P(TpFamily, LayoutsMatchSingleRank) {
  TempDir d;
  const std::string fam = GetParam(), data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  const std::string clip = " --optim.grad_clip=0.05";  // clipping active: the norm must count each element once
  const std::string sp = " --parallel.sequence_parallel=true";
  RunResult one = train_run(d, "one", 1, options(fam, 8, 0) + data + clip);
  // {name, ranks, micro-batch, layout}; llama: 2 key/value heads at tp 4, each held by two ranks
  const std::vector<std::tuple<std::string, int, int, std::string>> layouts = {
      {"tp2", 2, 0, " --parallel.tp=2"},
      {"tp4", 4, 0, " --parallel.tp=4"},
      {"tp2dp2z0", 4, 2, " --parallel.tp=2 --parallel.zero=0"},  // micro-batch 2: two micro-steps per rank
      {"tp2dp2z1", 4, 2, " --parallel.tp=2 --parallel.zero=1"},
      {"tp2dp2z3", 4, 2, " --parallel.tp=2 --parallel.zero=3"},
      {"recompute", 2, 4, " --parallel.tp=2 --training.recompute=true"},
      // sequence parallelism: the residual stream, norms and residual adds on 16 / tp positions
      {"sp4", 4, 0, " --parallel.tp=4" + sp},
      {"sp2dp2z3", 4, 2, " --parallel.tp=2 --parallel.zero=3" + sp},
      {"sp2recompute", 2, 4, " --parallel.tp=2 --training.recompute=true" + sp},
  };
  expect_activations_as_predicted(one, "one");
  for (const auto& [name, ranks, micro, layout] : layouts) {
    RunResult r = train_run(d, name, ranks, options(fam, 8, micro) + data + clip + layout);
    expect_equivalent(one, r, fam + " " + name);
    expect_tp_bytes_as_predicted(d, name);
    expect_activations_as_predicted(r, name);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TpFamily, ::testing::Values("gpt2", "llama"));

// Multi-query attention (one key/value head held by every rank) and an untied head.
TEST(Tp, MultiQueryAndUntiedHead) {
  TempDir d;
  const std::string o = options("llama", 8, 0) + " --model.n_kv_head=1 --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  RunResult one = train_run(d, "one", 1, o);
  expect_equivalent(one, train_run(d, "tp2", 2, o + " --parallel.tp=2"), "llama MQA tp 2");
  expect_equivalent(one, train_run(d, "tp4", 4, o + " --parallel.tp=4"), "llama MQA tp 4");
  const std::string g = options("gpt2", 8, 0) + " --model.tie_embeddings=false --data.path=" + d / "t.bin";
  expect_equivalent(train_run(d, "g1", 1, g), train_run(d, "g2", 2, g + " --parallel.tp=2"), "gpt2 untied tp 2");
}

// Checkpoints hold whole parameters: written at tp 2 x dp 2 (ZeRO 1), they resume at tp 1
// and at tp 4 with the uninterrupted run's losses and parameters (to rounding: the layout
// changes the order of sums), and at the same layout bit-exactly. Export writes the whole
// model from the tp shards.
TEST(Tp, CheckpointResumesAtAnotherTp) {
  TempDir d;
  const std::string o = options("llama", 8, 0) + " --optim.schedule=constant --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  expect_resumes_at_other_layouts(d, o, " --parallel.tp=2 --parallel.zero=1", {{1, ""}, {4, " --parallel.tp=4"}});
}

// Starting from a Hugging Face file, each tp rank takes its rows of every parameter: the
// run trains what one process trains from the same file.
TEST(Tp, InitFromHuggingFaceFile) {
  TempDir d;
  const std::string o = options("llama", 8, 0) + " --model.init_from=" + write_hf_init(d) +
                        " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  RunResult one = train_run(d, "one", 1, o);
  expect_equivalent(one, train_run(d, "tp2dp2z3", 4, o + " --parallel.tp=2 --parallel.zero=3"), "init_from at tp 2 x dp 2");
}

// Sizes that do not split: one message naming the key and the tp sizes that work, printed
// once, before any work.
TEST(Tp, LayoutsThatCannotSplitAreRefused) {
  TempDir d;
  const std::string bin = MESHTRAIN_BIN, data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {"--model.n_head=6 --model.d_model=48 --parallel.tp=4",
       {"model.n_head = 6", "parallel.tp can be 1, 2, 3 or 6 for this model"}},
      {"--model.family=llama --model.n_head=12 --model.n_kv_head=3 --model.d_model=48 --parallel.tp=4",
       {"model.n_kv_head = 3"}},
      {"--model.d_ff=66 --parallel.tp=4", {"model.d_ff = 66"}},
      {"--model.seq_len=18 --parallel.tp=4 --parallel.sequence_parallel=true", {"model.seq_len = 18"}},
  };
  for (const auto& [opts, wants] : bad) {
    std::string out;
    const int rc = run_command(bin + " launch -n 4 train " + options("gpt2", 8, 0) + data + " " + opts +
                                   " --logging.progress=off --checkpoint.dir=",
                               &out);
    EXPECT_NE(rc, 0) << opts;
    for (const std::string& want : wants) EXPECT_NE(out.find(want), std::string::npos) << opts << "\n" << out;
    expect_one_error(out, opts);
  }
}

}  // namespace
