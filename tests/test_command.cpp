// The meshtrain command as users run it: its errors and exit status, launch (option values,
// threads per rank), prepare, export (a file, or a directory for transformers), sample's
// tokenizer, a resumed run's notes and other settings that do nothing. (Outputs that would
// replace inputs: test_output_paths.cpp.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/tensor.h"
#include "core/machine.h"
#include "core/safetensors.h"
#include "ops/gemm.h"
#include "data/tasks.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "train_runs.h"

using namespace mt;
using test::error_of;
namespace fs = std::filesystem;

namespace {

// The command: bad input gives a message naming the problem and exit status 1.
TEST(Command, ErrorsExitNonZeroWithAMessage) {
  test::TempDir d;
  std::string out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " train --model.n_layr=2", &out), 1);
  EXPECT_NE(out.find("did you mean model.n_layer"), std::string::npos) << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " train --data.path=" + d.path + "/none.bin", &out), 1);
  EXPECT_NE(out.find("none.bin"), std::string::npos) << out;
  std::ofstream(d / "junk.bin") << "not a token file at all";
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " train --data.path=" + d.path + "/junk.bin", &out), 1);
  EXPECT_NE(out.find("junk.bin"), std::string::npos) << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " export --checkpoint " + d.path + " --out x.st", &out), 1);
  EXPECT_NE(out.find("no checkpoint"), std::string::npos) << out;
  // An unknown command is named (CLI11 said only "A subcommand is required"); launch checks
  // it before mpirun starts any rank.
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " nosuchcmd", &out), 1);
  EXPECT_NE(out.find("\"nosuchcmd\" is not a meshtrain command; the commands are train, launch"), std::string::npos)
      << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " checkpoint foo " + d.path, &out), 1);
  EXPECT_NE(out.find("checkpoint: \"foo\" is not a checkpoint command; use meshtrain checkpoint info DIR"),
            std::string::npos) << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " launch -n 2 nosuch", &out), 1);
  EXPECT_NE(out.find("launch: \"nosuch\" is not a command launch runs"), std::string::npos) << out;
  EXPECT_EQ(out.find("mpirun"), std::string::npos) << "no rank started:\n" << out;
  // Help is help: bench --help lists its benchmarks (it was an error); train --help prints a
  // float key as written (1e-05, not 9.999999747378752e-06); a choice that may be left unset
  // is named, not shown as a blank.
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " bench --help", &out), 0) << out;
  EXPECT_NE(out.find("meshtrain launch -n N bench comm"), std::string::npos) << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " train --help", &out), 0) << out;
  EXPECT_NE(out.find("model.norm_eps                     1e-05\n"), std::string::npos) << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " train --parallel.sharding=x", &out), 1);
  EXPECT_NE(out.find("expected one of \"\" (unset) NO_SHARD"), std::string::npos) << out;
  // A command line the parser cannot take exits 1 like any error, in meshtrain's words (it
  // exited 104 to 114 with CLI11's, and --gpus 0 printed a range ending in 1.8e308).
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"sample --checkpoint x --tokens x", "error: --tokens x is not an integer in the option's range; see "
                                                "meshtrain sample --help"},
           {"sample --checkpoint x --temperature warm", "error: --temperature warm is not a number"},
           // CLI11 took -5 for the unsigned seed as 2^64 - 5, and 10^23 without a word
           {"sample --checkpoint x --seed -5", "error: --seed: -5 is not a whole number from 0 to 18446744073709551615"},
           {"sample --checkpoint x --seed 99999999999999999999999", "error: --seed: 99999999999999999999999 is not"},
           {"prepare --input", "error: --input needs a value; see meshtrain prepare --help"},
           {"prepare", "error: --input is required; see meshtrain prepare --help"},
           {"checkpoint info", "error: DIR is required; see meshtrain checkpoint info --help"},
           {"plan --gpus 0", "error: --gpus 0: give the cluster's devices, at least 1"},
           {"plan --gpus 8 --gpus-per-node -1", "error: --gpus-per-node -1: give the devices of one node, at least 1"},
           // a field or option given twice kept its last value, silently; --set without a
           // value was told train's --section.key=value
           {"plan --gpus 8 --layout tp=2,tp=4", "error: --layout: tp given twice (tp=2 and tp=4); give each field once"},
           {"plan --gpus 8 --layout chunks=2,v=4", "error: --layout: v given twice (chunks=2 and v=4)"},
           // a directory was found after the whole plan had printed, without the reason
           {"plan --gpus 8 --svg /tmp", "error: cannot write the --svg file /tmp: Is a directory; choose another --svg"},
           {"plan --gpus 8 --config a.toml --config b.toml", "error: --config is given 2 times; give it once"},
           {"plan --gpus 8 --set model.n_layer", "error: --set model.n_layer has no value: write --set "
                                                 "section.key=value, e.g. --set model.n_layer=VALUE"},
           {"bench profile --seconds 1 --seconds 2", "error: bench profile: --seconds given twice (1 and 2); give it "
                                                     "once"},
           // bench comm reads its own options: an unknown one was "needs a value", or the
           // usage with exit status 2; 1T was read as 1 byte, 1e400 cast to int64
           {"bench comm --bogus", "error: bench comm: unknown option --bogus; usage: meshtrain launch -n N bench comm"},
           {"bench comm --sizes 4K", "error: bench comm: unknown option --sizes"},
           {"bench comm --max-bytes 1T", "error: bench comm: bad size 1T: write e.g. 1K, 64M or 1G, at most 16G"},
           {"bench comm --max-bytes 1e400", "error: bench comm: bad size 1e400"},
           {"bench comm --iters 99999999999", "error: bench comm: --iters 99999999999: give a whole number from 1"},
           // an NCCL or host-staged GPU group over CPU buffers measured the CPU's, saying nothing
           {"bench comm --gpu-comm nccl", "error: bench comm: --gpu-comm nccl carries GPU buffers, but --device is "
                                          "cpu; add --device cuda, or leave --gpu-comm out"},
           {"bench comm --dtype fp16", "error: bench comm: --dtype fp16: use f32 (fp32) or bf16"},
           {"bench comm --min-bytes 8K --max-bytes 4K", "error: bench comm: --min-bytes 8192 and --max-bytes 4096: "
                                                        "need 4 <= min-bytes <= max-bytes"},
           // bench profile likewise (an unknown option or a missing value printed the usage
           // with exit status 2); --out is checked before the minutes of measuring
           {"bench profile --bogus 1", "error: bench profile: unknown option --bogus\nusage:"},
           {"bench profile --out", "error: bench profile: option --out needs a value"},
           {"bench profile --out /", "error: bench profile: --out / is a directory; give a file name, e.g. --out "
                                     "/hardware_profile.toml"},
           {"bench profile --out /proc/x/y.toml", "error: cannot create the directory /proc/x of --out file"},
           // a file its directory takes no file in: found after the measuring, with no reason
           {"bench profile --out /proc/h.toml", "error: cannot write the --out file /proc/h.toml: "},
           // launch's -n was atoi's (99999999999 asked mpirun for 1215752191 ranks), and a
           // missing host file ended in mpirun's "internal error ... should be reported"
           {"launch -n 99999999999 train", "error: launch: -n 99999999999 is not a number of ranks; give a whole "
                                           "number from 1"},
           {"launch -n 2x train", "error: launch: -n 2x is not a number of ranks"},
           {"launch -np 0 train", "error: launch: -np 0 is not a number of ranks"},
           {"launch --hostfile /nonexistent -n 2 train", "error: launch: --hostfile /nonexistent is not a readable "
                                                         "file; give mpirun's host file"},
           {"launch -n 2 --machinefile=/ train", "error: launch: --machinefile / is not a readable file"},
           {"launch -n 2 --hostfile", "error: launch: --hostfile needs a file of host names"}}) {
    EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " " + args, &out), 1) << args << "\n" << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
  }
  // On several ranks a bad option is said once, by rank 0, and no rank is aborted (every rank
  // said it, inside Open MPI's MPI_ABORT banner); and small sizes that round up to the same
  // count per rank are measured once (three rows of 12 bytes were printed for 4, 8 and 16).
  const std::string bench = "OMP_NUM_THREADS=1 " + std::string(MESHTRAIN_BIN) + " launch -n ";
  EXPECT_EQ(test::run_command(bench + "2 bench comm --bogus 1", &out), 1) << out;
  EXPECT_NE(out.find("error: bench comm: unknown option --bogus"), std::string::npos) << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
  EXPECT_EQ(out.find("MPI_ABORT"), std::string::npos) << out;
  // bench profile likewise, and an --out only rank 0 tries (the others went on measuring)
  for (const auto& [profile, want] : std::vector<std::pair<std::string, std::string>>{
           {"--seconds 0", "error: bench profile: --seconds 0: expected"},
           {"--out /proc/h.toml", "error: cannot write the --out file /proc/h.toml"}}) {
    EXPECT_EQ(test::run_command(bench + "2 bench profile " + profile, &out), 1) << out;
    EXPECT_NE(out.find(want), std::string::npos) << out;
    EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
    EXPECT_EQ(out.find("MPI_ABORT"), std::string::npos) << out;
  }
  ASSERT_EQ(test::run_command(bench + "3 bench comm --min-bytes 4 --max-bytes 16 --iters 1", &out), 0) << out;
  size_t rows = 0;
  for (size_t at = 0; (at = out.find(" allreduce ", at)) != std::string::npos; ++at) ++rows;
  EXPECT_EQ(rows, 1u) << out;
  // Buffers that do not fit say which option makes them (it was training's advice).
  EXPECT_EQ(test::run_command("ulimit -v 12000000; " + std::string(MESHTRAIN_BIN) +
                                  " bench comm --min-bytes 16G --max-bytes 16G", &out), 1) << out;
  EXPECT_NE(out.find("out of cpu memory allocating 16.00 GiB for comm; lower --max-bytes"), std::string::npos) << out;
}

// A second --config dropped the first file's keys; a directory as data.path was "cannot read
// the header of token file DIR: Is a directory", no key named; settings that change nothing
// (checkpoint keys without checkpoint.dir, more recompute_blocks than the model's blocks, a
// cluster of partial nodes) said nothing.
TEST(Command, RepeatsDirectoriesAndSettingsThatDoNothingAreSaid) {
  test::TempDir d;
  const std::string tokens = test::write_tokens(d, "t.bin", 400, 37);
  std::ofstream(d / "a.toml") << "[model]\nn_layer = 2\n";
  std::ofstream(d / "b.toml") << "[model]\nd_model = 64\n";
  const std::string train = std::string(MESHTRAIN_BIN) + " train --model.n_layer=2 --model.n_head=2 --model.d_model=16 "
                            "--model.vocab_size=37 --model.seq_len=8 --training.global_batch=2 --training.steps=1 "
                            "--training.val_every=0 --logging.progress=off";
  for (const auto& [opts, want] : std::vector<std::pair<std::string, std::string>>{
           {"--config " + d / "a.toml" + " --config " + d / "b.toml",
            "error: --config given twice (" + d / "a.toml" + " and " + d / "b.toml" + "): train reads one "
            "configuration file; merge them into one, or give the second's keys as --section.key=value"},
           {"--data.path=" + d.path, "error: data.path = " + d.path + " is a directory; set data.path to a token file"},
           {"--data.path=" + tokens + " --data.val_path=" + d.path,
            "error: data.val_path = " + d.path + " is a directory; set data.val_path to a token file"}}) {
    std::string out;
    EXPECT_EQ(test::run_command(train + " " + opts, &out), 1) << opts << "\n" << out;
    EXPECT_NE(out.find(want), std::string::npos) << opts << "\n" << out;
  }
  std::string out;
  ASSERT_EQ(test::run_command(train + " --data.path=" + tokens + " --checkpoint.every=1 --checkpoint.keep=2 "
                                  "--training.recompute=true --training.recompute_blocks=99", &out), 0) << out;
  for (const std::string& note : {
           "note: checkpoint.every = 1 without checkpoint.dir: nothing is saved; set checkpoint.dir=DIR",
           "note: checkpoint.keep = 2 without checkpoint.dir: nothing is saved or kept; set checkpoint.dir=DIR",
           "note: training.recompute_blocks = 99 is more than the 2 blocks of the model (model.n_layer): every "
           "block recomputes, as with recompute_blocks = 0"})
    EXPECT_NE(out.find(note), std::string::npos) << note << "\n" << out;
  ASSERT_EQ(test::run_command(train + " --data.path=" + tokens + " --training.recompute=true "
                                  "--training.recompute_blocks=2", &out), 0) << out;
  EXPECT_EQ(out.find("recompute_blocks = 2"), std::string::npos) << out;
  const std::string plan = std::string(MESHTRAIN_BIN) + " plan --top 1 --gpus 8 --gpus-per-node ";
  ASSERT_EQ(test::run_command(plan + "3", &out), 0) << out;
  EXPECT_NE(out.find("note: --gpus 8 is not a whole number of nodes of --gpus-per-node 3 (2 nodes and 2 devices on "
                     "another): the planner places the groups as if every node held 3; give --gpus 6 or 9 for "
                     "whole nodes"), std::string::npos) << out;
  ASSERT_EQ(test::run_command(plan + "4", &out), 0) << out;
  EXPECT_EQ(out.find("whole number of nodes"), std::string::npos) << out;
  // bench profile wrote a CPU profile for a GPU configuration, and one from a blink of
  // measuring, without a word: now said before the measuring and in the file.
  std::ofstream(d / "gpu.toml") << "[model]\nn_layer = 2\nd_model = 32\nn_head = 2\nseq_len = 16\n"
                                   "[training]\ndevice = \"cuda\"\nmicro_batch = 2\n";
  ASSERT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " bench profile --seconds 0.1 --config " + d / "gpu.toml" +
                                  " --out " + d / "p.toml", &out), 0) << out;
  std::ifstream in(d / "p.toml");
  std::string profile{std::istreambuf_iterator<char>(in), {}};  // its comments as one text
  for (size_t at; (at = profile.find("\n# ")) != std::string::npos;) profile.replace(at, 3, " ");
  for (const std::string& note : {std::string("note: --seconds 0.1 is a short measurement: its rates vary from run to run"),
                                  "note: --config " + d / "gpu.toml" + " trains on GPUs (training.device = cuda), but "
                                  "this profile measures the CPUs; for GPUs, plan has profiles built in"}) {
    EXPECT_NE(out.find(note), std::string::npos) << note << "\n" << out;
    EXPECT_NE(profile.find(note), std::string::npos) << note << "\n" << profile;
  }
}

// launch passes mpirun an option's value after '=' as the next argument (Open MPI 4 said
// 'unknown option "--hostfile=FILE"'), and -n=N is the number of ranks.
TEST(Command, LaunchTakesAnOptionsValueAfterEquals) {
  test::TempDir d;
  const std::string hosts = d / "hosts";
  std::ofstream(hosts) << "localhost slots=2\n";
  std::string out;
  const std::string cmd = std::string(MESHTRAIN_BIN) + " launch -n=2 --hostfile=" + hosts +
                          " --map-by=slot train --training.steps=1 --logging.progress=off --logging.metrics=" +
                          d / "m.jsonl";
  ASSERT_EQ(test::run_command(cmd, &out), 0) << cmd << "\n" << out;
  EXPECT_NE(out.find("2 ranks"), std::string::npos) << out;
}

// Threads per rank: where OMP_NUM_THREADS does not say, each rank takes its machine's CPUs
// over the job's ranks on it: under launch with a host file too (it gave every rank one
// thread, whatever the machines), and under launch on one machine. OMP_NUM_THREADS passes
// through and training.threads overrides it; ranks whose threads outnumber the CPUs get a
// note saying what to set.
TEST(Command, ThreadsPerRankFollowTheRanksOnTheMachine) {
  test::TempDir d;
  const std::string hosts = d / "hosts";
  std::ofstream(hosts) << "localhost slots=4\n";
  const int cpus = affinity_cpus();
  const auto header = [&](const std::string& env, const std::string& launch, const std::string& opts) {
    std::string out;
    const std::string cmd = env + " " + MESHTRAIN_BIN + " launch " + launch + " train --training.steps=1 "
                            "--logging.progress=off --logging.metrics=" + d / "m.jsonl " + opts;
    EXPECT_EQ(test::run_command(cmd, &out), 0) << cmd << "\n" << out;
    return out;
  };
  const auto each = [](int t) { return ", " + std::to_string(t) + (t > 1 ? " threads each" : " thread each"); };
  const std::string unset = "env -u OMP_NUM_THREADS";
  std::string out = header(unset, "-n 1 --hostfile " + hosts, "");
  EXPECT_NE(out.find("1 rank (dp 1, cp 1, tp 1, pp 1)" + each(cpus)), std::string::npos) << out;
  out = header(unset, "-n 2", "");
  EXPECT_NE(out.find(each(std::max(1, cpus / 2))), std::string::npos) << out;
  EXPECT_EQ(out.find("which then take turns"), std::string::npos) << out;
  out = header("env OMP_NUM_THREADS=" + std::to_string(cpus), "-n 2", "");
  EXPECT_NE(out.find(each(cpus)), std::string::npos) << out;
  if (cpus > 1)
    EXPECT_NE(out.find("note: 2 ranks on this machine with " + std::to_string(cpus) + " threads each run " +
                       std::to_string(2 * cpus) + " threads on its " + std::to_string(cpus) +
                       " CPUs, which then take turns: set training.threads (or OMP_NUM_THREADS) to " +
                       std::to_string(std::max(1, cpus / 2))),
              std::string::npos)
        << out;
  out = header("env OMP_NUM_THREADS=" + std::to_string(cpus), "-n 2", "--training.threads=1");
  EXPECT_NE(out.find(each(1)), std::string::npos) << out;
  EXPECT_EQ(out.find("which then take turns"), std::string::npos) << out;
}

// A failed allocation names what to change: the training keys, or what the command that
// allocates says instead (sample: fewer samples side by side, not training's micro_batch).
TEST(Allocator, AFailureSaysWhatToChange) {
  struct Refusing final : Allocator {
    Device device() const override { return Device::cpu; }

   protected:
    void* raw_allocate(size_t) override { return nullptr; }
    void raw_deallocate(void*) override {}
  } refusing;
  const auto failure = [&] {
    return error_of([&] { Tensor::empty({1 << 20}, DType::f32, refusing, MemTag::activations); });
  };
  EXPECT_NE(failure().find("out of cpu memory allocating 4.0 MiB for activations; use a smaller model, micro_batch or "
                           "seq_len, or training.recompute=true"),
            std::string::npos)
      << failure();
  refusing.set_advice("--samples 8 side by side do not fit: draw fewer samples at once");
  EXPECT_NE(failure().find("for activations; --samples 8 side by side do not fit: draw fewer samples at once"),
            std::string::npos)
      << failure();
  EXPECT_EQ(failure().find("micro_batch"), std::string::npos) << failure();
}

// A host allocator destroyed while a tensor it gave lives stops the program and says so
// (the tensor's free would otherwise call into the destroyed allocator later).
TEST(AllocatorDeathTest, DestroyedBeforeItsTensorsSaysSo) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Tensor kept;
        {
          CpuAllocator alloc;
          kept = Tensor::empty({1024}, DType::f32, alloc, MemTag::activations);
          Tensor freed = Tensor::empty({256}, DType::f32, alloc, MemTag::params);
        }
      },
      "a host allocator is destroyed while 4.0 KiB of the tensors it gave live \\(4.0 KiB activations\\); declare "
      "the allocator before the tensors it gives");
  CpuAllocator alloc;  // every tensor freed first: nothing said
  { Tensor t = Tensor::empty({1024}, DType::f32, alloc, MemTag::activations); }
}

// The matrix products run kernels for the CPU's instruction set, under launch's ranks too
// (no warning): where this OpenBLAS does not recognise the CPU, meshtrain sets
// OPENBLAS_CORETYPE to the set for the CPU and runs again, and the header says so (an Intel
// Xeon of family 6 model 207 with OpenBLAS 0.3.21); where OpenBLAS knows it, nothing
// changes. An OPENBLAS_CORETYPE the user sets is kept, even an older one (with the warning).
TEST(Command, MatrixProductsRunTheCpusKernels) {
  test::TempDir d;
  const auto header = [&](const std::string& env, const std::string& launch) {
    std::string out;
    const std::string cmd = env + " " + MESHTRAIN_BIN + launch + " train --training.steps=1 --model.n_layer=1 "
                            "--logging.progress=off --logging.metrics=" + d / "m.jsonl";
    EXPECT_EQ(test::run_command(cmd, &out), 0) << cmd << "\n" << out;
    return out;
  };
  const std::string unset = "env -u OPENBLAS_CORETYPE -u MESHTRAIN_SET_CORETYPE";
  const char* for_cpu = blas_kernels_to_set("Prescott", blas_cpu_isa(), nullptr);  // null on an SSE-only CPU
  for (const std::string launch : {"", " launch -n 2"}) {
    const std::string out = header(unset, launch);
    EXPECT_EQ(out.find("warning: OpenBLAS runs its"), std::string::npos) << out;
    if (for_cpu && out.find("set by meshtrain") != std::string::npos)
      EXPECT_NE(out.find(std::string(for_cpu) + " kernels (" + blas_cpu_isa() + "; OPENBLAS_CORETYPE=" + for_cpu +
                         ", set by meshtrain: this OpenBLAS does not recognise the CPU)"),
                std::string::npos)
          << out;
  }
  if (std::string(blas_cpu_isa()) != "SSE") {
    const std::string out = header("env -u MESHTRAIN_SET_CORETYPE OPENBLAS_CORETYPE=Prescott", "");
    EXPECT_NE(out.find("Prescott kernels (SSE; OPENBLAS_CORETYPE=Prescott)"), std::string::npos) << out;
    EXPECT_NE(out.find("warning: OpenBLAS runs its Prescott kernels"), std::string::npos) << out;
  }
}

// What cannot run is refused before any work, naming the key: a test fault of no known form
// (it was found at step 1), more micro-batches per step than any run needs (the schedule's
// lists took the memory), a run whose predicted memory exceeds the machine's (it allocated
// for minutes until killed), and plan's --global-batch below 1 (it fell back silently).
TEST(Command, WhatCannotRunIsRefusedBeforeAnyWork) {
  test::TempDir d;
  const std::string train = std::string(MESHTRAIN_BIN) + " train --training.steps=1 --logging.metrics=" + d / "m.jsonl";
  for (const auto& [opt, want] : std::vector<std::pair<std::string, std::string>>{
           {"--parallel.test_fault=boom:1", "parallel.test_fault = \"boom:1\": the kind is die, hang"},
           {"--parallel.test_fault=spike:1", "write spike:RANK:STEP,STEP..."},
           {"--training.global_batch=2097152 --training.micro_batch=1", "2097152 micro-batches per step"},
           {"--model.n_layer=20000 --model.d_model=16384 --model.n_head=16", "GiB per rank"},  // a petabyte
           {"--training.global_batch=4294967312", "GiB per rank"}}) {
    std::string out;
    EXPECT_EQ(test::run_command(train + " " + opt, &out), 1) << opt;
    EXPECT_NE(out.find(want), std::string::npos) << opt << "\n" << out;
    EXPECT_FALSE(std::filesystem::exists(d / "m.jsonl") && !test::read_lines(d / "m.jsonl").empty()) << opt;
  }
  std::string out;
  EXPECT_NE(test::run_command(std::string(MESHTRAIN_BIN) + " plan --gpus 8 --global-batch 0", &out), 0);
  EXPECT_NE(out.find("--global-batch: 0 sequences per step: give at least 1"), std::string::npos) << out;
}

// prepare refuses what would write an empty or unasked-for file: a directory as --input
// (fopen opened it, the read failed unchecked: 0 tokens, rc 0), an empty text, and a
// --val-out without --val-fraction (silently not written); nothing is written.
TEST(Command, PrepareRefusesUnusableInput) {
  test::TempDir d;
  std::ofstream(d / "empty.txt").flush();
  std::ofstream(d / "text.txt") << "hello";
  const std::string bin = MESHTRAIN_BIN, o = " --out " + d / "t.bin";
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {" --input " + d.path, "--input " + d.path + " is not a regular file"},
           {" --input " + d / "none.txt", "--input " + d / "none.txt" + " is not there"},
           {" --input " + d / "empty.txt", "holds no text (0 tokens)"},
           {" --input " + d / "text.txt" + " --val-out " + d / "v.bin", "--val-out " + d / "v.bin" +
                                                                       " needs --val-fraction"},
           {" --input " + d / "text.txt" + " --val-out " + d / "v.bin --val-fraction 0.01", "holds out none"}}) {
    std::string out;
    EXPECT_EQ(test::run_command(bin + " prepare" + args + o, &out), 1) << args;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
    EXPECT_FALSE(fs::exists(d / "t.bin") || fs::exists(d / "v.bin")) << args;
  }
}

// A safetensors file that cannot be renamed into place (a directory there) leaves no
// temporary behind: finish() had cleared the handle the destructor removes it by.
TEST(Safetensors, FailedFinishRemovesTheTemporary) {
  test::TempDir d;
  fs::create_directories(d / "out");
  const float a[2] = {1, 2};
  std::string e = error_of([&] {
    SafetensorsWriter w(d / "out", {{"a", {2}}});
    w.write("a", a);
    w.finish();
  });
  EXPECT_NE(e.find("cannot rename"), std::string::npos) << e;
  for (const auto& f : fs::directory_iterator(d.path)) EXPECT_EQ(f.path().filename(), "out") << f.path();
}

// prepare -> train -> export -> sample, through the command.
TEST(Command, PrepareTrainExportSample) {
  test::TempDir d;
  std::ofstream(d / "text.txt") << std::string(200, 'a') + "hello meshtrain, hello world\n";
  std::string out, bin = MESHTRAIN_BIN;
  // Output directories that do not exist yet are made.
  ASSERT_EQ(test::run_command(bin + " prepare --input " + d / "text.txt" + " --out " + d / "new/t.bin", &out), 0) << out;
  ASSERT_EQ(test::run_command(bin + " train --data.path=" + d / "new/t.bin" +
                                  " --model.n_layer=1 --model.d_model=16 --model.n_head=2 --model.seq_len=16"
                                  " --training.steps=3 --training.global_batch=2 --training.micro_batch=2"
                                  " --checkpoint.dir=" + d / "ck" + " --logging.metrics=" + d / "m.jsonl",
                              &out),
            0)
      << out;
  EXPECT_NE(out.find("peak memory"), std::string::npos) << out;
  fs::create_directories(d / "taken/model.safetensors");  // refused before any work, leaving nothing
  EXPECT_EQ(test::run_command(bin + " export --checkpoint " + d / "ck" + " --out " + d / "taken", &out), 1) << out;
  EXPECT_NE(out.find("--out " + d / "taken" + ": " + d / "taken/model.safetensors" + " is a directory"),
            std::string::npos)
      << out;
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  ASSERT_EQ(test::run_command(bin + " export --checkpoint " + d / "ck" + " --out " + d / "hf/m.safetensors", &out), 0)
      << out;
  EXPECT_TRUE(fs::exists(d / "hf/m.safetensors"));
  ASSERT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck" + " --prompt hello --tokens 5", &out), 0) << out;
  EXPECT_EQ(out.rfind("hello", 0), 0u) << out;
  // Sampling options out of range are refused, not read as greedy or as nothing to generate.
  for (const auto& [opt, want] : std::vector<std::pair<std::string, std::string>>{
           {"--tokens -5", "--tokens -5 must not be negative"},
           {"--temperature -2", "--temperature -2 must be a finite number of at least 0"},
           {"--temperature nan", "--temperature nan must be a finite number"},
           {"--top-k -3", "--top-k -3 must not be negative"},
           {"--top-p 0", "--top-p 0 must be above 0 and at most 1"},
           {"--top-p 1.5", "--top-p 1.5 must be above 0 and at most 1"},
           {"--samples 0", "--samples 0 must be from 1 to 1024"}}) {
    EXPECT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck" + " " + opt, &out), 1) << opt;
    EXPECT_NE(out.find(want), std::string::npos) << opt << "\n" << out;
  }
  // A model of 256 ids on byte-level tokens (its tokenizer has 257, end-of-text the last):
  // it samples (it was refused for the tokenizer's size); what it cannot read is named.
  ASSERT_EQ(test::run_command(bin + " train --data.path=" + d / "new/t.bin" + " --model.vocab_size=256" +
                                  " --model.n_layer=1 --model.d_model=16 --model.n_head=2 --model.seq_len=16"
                                  " --training.steps=1 --training.global_batch=2 --checkpoint.dir=" + d / "ck256",
                              &out),
            0)
      << out;
  EXPECT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck256" + " --prompt hello --tokens 5", &out), 0)
      << out;
  EXPECT_EQ(out.rfind("hello", 0), 0u) << out;
  EXPECT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck256" + " --prompt ''", &out), 1) << out;
  EXPECT_NE(out.find("an empty prompt starts from the end-of-text token, id 256, past the model's "
                     "model.vocab_size = 256 ids: give a --prompt"),
            std::string::npos)
      << out;
  auto lines = test::steps_of(d, "m");
  ASSERT_EQ(lines.size(), 3u);
  for (const char* k : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "mem_params", "mem_grads",
                        "mem_optim", "mem_activations", "mem_comm", "mem_peak"})
    EXPECT_TRUE(lines[0].contains(k)) << k;
}

// export into a directory (one there, or a path with a final /) writes model.safetensors and
// the config.json transformers' from_pretrained reads: its architecture and shapes are the
// model's (llama with 4 query heads on 2 key/value heads and its own RoPE theta and epsilon,
// gpt2 with a tied head and its 4 C MLP), floats as written; the directory loads back
// (model.init_from) into the same parameters.
TEST(Command, ExportToADirectoryWritesConfigJson) {
  test::TempDir d;
  const std::string bin = MESHTRAIN_BIN, tokens = test::write_tokens(d, "t.bin", 2000, 50);
  for (const std::string family : {"llama", "gpt2"}) {
    SCOPED_TRACE(family);
    const std::string model = " --model.family=" + family + " --model.vocab_size=50 --model.n_layer=2"
                              " --model.d_model=32 --model.n_head=4 --model.seq_len=16" +
                              (family == "llama" ? " --model.n_kv_head=2 --model.rope_theta=500000 "
                                                   "--model.norm_eps=1e-6"
                                                 : "");
    std::string out;
    ASSERT_EQ(test::run_command(bin + " train --data.path=" + tokens + model + " --training.steps=2"
                                    " --training.global_batch=2 --logging.progress=off --checkpoint.dir=" +
                                    d / (family + "_ck"),
                                &out),
              0)
        << out;
    const std::string hf = d / (family + "_hf/");
    ASSERT_EQ(test::run_command(bin + " export --checkpoint " + d / (family + "_ck") + " --out " + hf, &out), 0)
        << out;
    EXPECT_NE(out.find("model.safetensors and config.json"), std::string::npos) << out;
    std::ifstream in(hf + "config.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_EQ(j["vocab_size"], 50);
    EXPECT_EQ(j["torch_dtype"], "float32");
    if (family == "llama") {
      EXPECT_EQ(j["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
      EXPECT_EQ(j["model_type"], "llama");
      EXPECT_EQ(j["hidden_size"], 32);
      EXPECT_EQ(j["intermediate_size"], 96);  // 32 ceil(8 d / 3 / 32)
      EXPECT_EQ(j["num_hidden_layers"], 2);
      EXPECT_EQ(j["num_attention_heads"], 4);
      EXPECT_EQ(j["num_key_value_heads"], 2);
      EXPECT_EQ(j["head_dim"], 8);
      EXPECT_EQ(j["max_position_embeddings"], 16);
      EXPECT_EQ(j["hidden_act"], "silu");
      EXPECT_EQ(j["rope_theta"].get<double>(), 500000.0);
      EXPECT_EQ(j["rms_norm_eps"].get<double>(), 1e-6);  // the float's shortest decimal, not 9.99999997e-07
      EXPECT_EQ(j["tie_word_embeddings"], false);
      EXPECT_EQ(j["attention_bias"], false);
    } else {
      EXPECT_EQ(j["architectures"], nlohmann::json::array({"GPT2LMHeadModel"}));
      EXPECT_EQ(j["model_type"], "gpt2");
      EXPECT_EQ(j["n_embd"], 32);
      EXPECT_EQ(j["n_inner"], 128);
      EXPECT_EQ(j["n_layer"], 2);
      EXPECT_EQ(j["n_head"], 4);
      EXPECT_EQ(j["n_positions"], 16);
      EXPECT_EQ(j["activation_function"], "gelu_new");
      EXPECT_EQ(j["layer_norm_epsilon"].get<double>(), 1e-5);
      EXPECT_EQ(j["tie_word_embeddings"], true);
      EXPECT_EQ(j["resid_pdrop"], 0.0);
    }
    // The directory is a model.init_from: one step at lr 0 keeps its parameters, which
    // re-export to the same tensors.
    ASSERT_EQ(test::run_command(bin + " train --data.path=" + tokens + model + " --model.init_from=" + hf +
                                    " --training.steps=1 --optim.lr=0 --training.global_batch=2"
                                    " --logging.progress=off --checkpoint.dir=" + d / (family + "_again"),
                                &out),
              0)
        << out;
    ASSERT_EQ(test::run_command(bin + " export --checkpoint " + d / (family + "_again") + " --out " +
                                    d / (family + "_again.safetensors"),
                                &out),
              0)
        << out;
    SafetensorsReader a(hf + "model.safetensors"), b(d / (family + "_again.safetensors"));
    ASSERT_EQ(a.entries().size(), b.entries().size());
    for (const auto& [name, e] : a.entries()) {
      ASSERT_TRUE(b.has(name)) << name;
      const int64_t n = shape_numel(e.shape);
      std::vector<float> x(n), y(n);
      a.read_f32(name, x.data(), n);
      b.read_f32(name, y.data(), n);
      EXPECT_EQ(x, y) << name;
    }
  }
}

// train --help shows a default that follows model.family as such: model.tie_embeddings was
// listed as true, which is gpt2's default only (llama's head is untied).
TEST(Command, HelpShowsTheFamilyDefaultOfTieEmbeddings) {
  std::string out;
  ASSERT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " train --help", &out), 0) << out;
  const size_t at = out.find("  model.tie_embeddings ");
  ASSERT_NE(at, std::string::npos) << out;
  EXPECT_EQ(out.substr(at, out.find('\n', at) - at),
            "  model.tie_embeddings               family default: gpt2 true, llama false");
}

// prepare says the vocabulary the trained model has: a small text supports fewer pieces than
// asked, and it printed the number asked.
TEST(Command, PrepareSaysTheTrainedVocabulary) {
  test::TempDir d;
  std::ofstream(d / "corpus.txt") << tasks_generate(5, 2000);
  std::string out;
  ASSERT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " prepare --input " + d / "corpus.txt" + " --out " +
                                  d / "u.bin --train-tokenizer 70000 --tokenizer-prefix " + d / "big",
                              &out),
            0)
      << out;
  const int pieces = tokenizer_make(d / "big.model")->vocab_size();
  ASSERT_LT(pieces, 70000);
  EXPECT_NE(out.find("trained SentencePiece model " + d / "big.model" + " (vocabulary " + std::to_string(pieces) +
                     ", fewer than the 70000 asked"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("set model.vocab_size >= " + std::to_string(pieces)), std::string::npos) << out;
}

// prepare refuses tokenizer options that contradict each other, writing nothing: --tokenizer
// beside --train-tokenizer (the model given was ignored) and --tokenizer-prefix without
// --train-tokenizer (ignored too).
TEST(Command, PrepareRefusesConflictingTokenizerOptions) {
  test::TempDir d;
  std::ofstream(d / "corpus.txt") << tasks_generate(5, 200);
  sentencepiece_train(d / "corpus.txt", d / "spm", 300);
  const std::string prep = std::string(MESHTRAIN_BIN) + " prepare --input " + d / "corpus.txt" + " --out " + d / "t.bin";
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {" --tokenizer " + d / "spm.model" + " --train-tokenizer 300 --tokenizer-prefix " + d / "v",
            "--tokenizer " + d / "spm.model" + " and --train-tokenizer 300 cannot go together"},
           {" --tokenizer-prefix " + d / "v", "--tokenizer-prefix " + d / "v" + " needs --train-tokenizer N"}}) {
    std::string out;
    EXPECT_EQ(test::run_command(prep + args, &out), 1) << args;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
    EXPECT_FALSE(fs::exists(d / "t.bin") || fs::exists(d / "v.model")) << args;
  }
}

// A small SentencePiece model, and the command that trains on random ids below its size in d
// (a data.tokenizer given relative to d), to which a test adds options.
std::string sentencepiece_run(const test::TempDir& d) {
  std::ofstream(d / "corpus.txt") << tasks_generate(5, 2000);
  sentencepiece_train(d / "corpus.txt", d / "spm", 300);
  return "cd " + d.path + " && " + MESHTRAIN_BIN + " train --data.path=" + test::write_tokens(d, "t.bin", 2000, 260) +
         " --model.vocab_size=300 --model.n_layer=1 --model.d_model=16 --model.n_head=2 --model.seq_len=16"
         " --training.global_batch=2 --logging.progress=off --checkpoint.dir=ck";
}

// A run's checkpoints record its SentencePiece data.tokenizer by its absolute path, so sample
// works from any directory (it could not open the relative "spm.model" elsewhere); a model
// that is really gone is said, with what to pass.
TEST(Command, SampleFindsTheTokenizerFromAnyDirectory) {
  test::TempDir d;
  std::string out;
  ASSERT_EQ(test::run_command(sentencepiece_run(d) + " --training.steps=1 --data.tokenizer=spm.model", &out), 0) << out;
  const std::string sample =
      "cd / && " + std::string(MESHTRAIN_BIN) + " sample --checkpoint " + d / "ck" + " --prompt copy --tokens 5";
  ASSERT_EQ(test::run_command(sample, &out), 0) << out;
  EXPECT_EQ(out.rfind("copy", 0), 0u) << out;
  fs::rename(d / "spm.model", d / "moved.model");
  EXPECT_EQ(test::run_command(sample, &out), 1) << out;
  EXPECT_NE(out.find("cannot open SentencePiece model " + d / "spm.model"), std::string::npos) << out;
  EXPECT_NE(out.find("Pass --tokenizer FILE.model, that SentencePiece model where it is now"), std::string::npos)
      << out;
  EXPECT_EQ(test::run_command(sample + " --tokenizer " + d / "moved.model", &out), 0) << out;
}

// A resume in another precision trained on without a word, and fp16's loss scale was
// dropped silently: said, with what carries over. fp16's loss-scaling keys must match only
// where both runs are fp16 (a bf16 run was refused for an optim.loss_scale it does not use).
TEST(Command, ResumeNotesAnotherPrecision) {
  test::TempDir d;
  const std::string train = std::string(MESHTRAIN_BIN) + " train " + test::options("gpt2", 4, 2) +
                            " --data.path=" + test::write_tokens(d, "t.bin", 400, 37) + " --checkpoint.dir=" + d / "ck" +
                            " --checkpoint.every=1 --logging.progress=off";
  std::string out;
  ASSERT_EQ(test::run_command(train + " --training.steps=1 --training.precision=fp16", &out), 0) << out;
  ASSERT_EQ(test::run_command(train + " --training.steps=2 --training.precision=fp16 --checkpoint.resume=true", &out), 0)
      << out;
  EXPECT_EQ(out.find("training.precision ="), std::string::npos) << "the same precision\n" << out;
  ASSERT_EQ(test::run_command(train + " --training.steps=3 --training.precision=bf16 --training.grad_dtype=bf16 "
                                      "--checkpoint.resume=true", &out), 0) << out;
  EXPECT_NE(out.find("training.precision = bf16, grad_dtype = bf16 instead of the checkpoint's fp16, fp32: the "
                     "fp32 parameters and optimizer state carry over; fp16's loss scale is dropped"),
            std::string::npos) << out;
  ASSERT_EQ(test::run_command(train + " --training.steps=4 --training.precision=bf16 --training.grad_dtype=bf16 "
                                      "--optim.loss_scale=1024 --checkpoint.resume=true", &out), 0) << out;
  ASSERT_EQ(test::run_command(train + " --training.steps=5 --training.precision=fp16 --checkpoint.resume=true", &out), 0)
      << out;
  EXPECT_NE(out.find("instead of the checkpoint's bf16, bf16: the fp32 parameters and optimizer state carry over; the "
                     "loss scale starts at optim.loss_scale"),
            std::string::npos) << out;
  EXPECT_EQ(test::run_command(train + " --training.steps=6 --training.precision=fp16 --optim.loss_scale_window=7 "
                                      "--checkpoint.resume=true", &out), 1) << out;
  EXPECT_NE(out.find("optim.loss_scale_window = 1000 (this run: 7)"), std::string::npos) << "both fp16\n" << out;
}

// A resumed run whose data.tokenizer is not the checkpoint's says so, naming both: one left
// out (byte) went into the new checkpoints silently, and sample printed noise. The same
// model, given relative or absolute, is no change.

TEST(Command, ResumeNotesAnotherTokenizer) {
  test::TempDir d;
  const std::string train = sentencepiece_run(d);
  std::string out;
  ASSERT_EQ(test::run_command(train + " --training.steps=1 --data.tokenizer=spm.model", &out), 0) << out;
  ASSERT_EQ(test::run_command(train + " --training.steps=2 --checkpoint.resume=true --data.tokenizer=" + d / "spm.model",
                              &out),
            0)
      << out;
  EXPECT_EQ(out.find("data.tokenizer"), std::string::npos) << "the same model\n" << out;
  ASSERT_EQ(test::run_command(train + " --training.steps=3 --checkpoint.resume=true", &out), 0) << out;
  EXPECT_NE(out.find("data.tokenizer = byte instead of the checkpoint's " + d / "spm.model" +
                     ": this run's checkpoints record byte, which sample decodes with; pass --data.tokenizer=" +
                     d / "spm.model" + " to keep the checkpoint's"),
            std::string::npos)
      << out;
}

}  // namespace
