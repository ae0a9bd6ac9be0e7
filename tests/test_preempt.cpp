// Graceful stops (train/stop.h, cli/launch.cpp), through the command. SIGTERM or SIGUSR1
// mid-run, to `meshtrain launch -n 2`, to one rank of the job alone, or to one process:
// every rank stops after the same step with exit status 75, one checkpoint of that step is
// on disk, the message says how to resume, and resuming trains bit for bit what an
// uninterrupted run trains. A second signal during the save is ignored; a hard kill during
// a save leaves the earlier checkpoints intact and a temporary directory that the next
// start removes.
//
// No timing luck: a job is signalled only once its metrics show steps done, runs far more
// steps than it can finish before the signal arrives (training.steps = 1e6 with a constant
// learning rate, so the step count bounds the run and changes nothing else), and saves are
// held open (parallel.test_fault=slow_save:R) for the signals that must land during one.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "train_runs.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// The tiny GPT-2 of the data-parallel tests, at a constant learning rate.
std::string opts(const TempDir& d) {
  return options("gpt2", 8, 0) + " --optim.schedule=constant --data.path=" + write_tokens(d, "t.bin", 3000, 37);
}

// The command train_run runs for `name` (metrics d/name.jsonl, checkpoint.dir d/name).
std::string train_cmd(const TempDir& d, const std::string& name, int ranks, const std::string& o) {
  return "env OMP_NUM_THREADS=1 " + std::string(MESHTRAIN_BIN) + (ranks > 1 ? " launch -n " + std::to_string(ranks) : "") +
         " train " + o + " --logging.progress=off --logging.metrics=" + d / (name + ".jsonl") +
         " --checkpoint.dir=" + d / name;
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// A command running in the background in its own process group, its output in a file.
struct Job {
  pid_t pid = -1;
  std::string out_path, pattern;  // pattern: what pgrep -f finds in every process of the job

  Job(const std::string& cmd, const std::string& out, const std::string& unique) : out_path(out), pattern(unique) {
    const std::string sh = "exec " + cmd + " > " + out + " 2>&1";
    pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
      execl("/bin/sh", "sh", "-c", sh.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~Job() {
    if (pid > 0) finish(0);
  }
  std::string output() const { return file_bytes(out_path); }
  // The exit status (128 + N for signal N), or -1 if still running after `seconds`, when
  // the whole job is killed.
  int finish(double seconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(-pid, SIGKILL);
        run_command("pkill -9 -f -- '" + pattern + "'", nullptr);
        waitpid(pid, &status, 0);
        pid = -1;
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

// Polls `done` every 20 ms for up to 60 s.
bool wait_for(const std::function<bool()>& done) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The complete JSON lines of a metrics file (one being written may end in half a line).
std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::vector<nlohmann::json> r;
  for (const std::string& l : read_lines(path)) {
    nlohmann::json j = nlohmann::json::parse(l, nullptr, false);
    if (!j.is_discarded()) r.push_back(j);
  }
  return r;
}

int64_t steps_logged(const std::string& path) {
  int64_t n = 0;
  for (const nlohmann::json& j : json_lines(path)) n += !j.contains("event");
  return n;
}

std::vector<pid_t> children(pid_t parent) {
  std::string out;
  run_command("pgrep -P " + std::to_string(parent), &out);
  std::vector<pid_t> r;
  std::istringstream is(out);
  for (pid_t p; is >> p;) r.push_back(p);
  return r;
}

// The value of `key` in process `pid`'s environment ("" without it).
std::string environment_value(pid_t pid, const std::string& key) {
  std::ifstream env("/proc/" + std::to_string(pid) + "/environ");
  for (std::string v; std::getline(env, v, '\0');)
    if (v.rfind(key + "=", 0) == 0) return v.substr(key.size() + 1);
  return "";
}

// The process of MPI rank `rank` under meshtrain launch (launch -> mpirun -> ranks).
pid_t rank_pid(pid_t launch, int rank) {
  for (pid_t mpirun : children(launch))
    for (pid_t p : children(mpirun))
      if (environment_value(p, "OMPI_COMM_WORLD_RANK") == std::to_string(rank)) return p;
  return -1;
}

std::string step_dir(const std::string& root, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/step_%08lld", static_cast<long long>(step));
  return root + buf;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> r;
  for (const auto& e : fs::directory_iterator(dir)) r.push_back(e.path().filename());
  std::sort(r.begin(), r.end());
  return r;
}

bool has(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

// After a stopped job: the step it stopped after, checked against its metrics, its
// checkpoint and its message.
int64_t expect_stopped(const Job& job, int rc, const std::string& metrics, const std::string& ckdir) {
  const std::string out = job.output();
  EXPECT_EQ(rc, 75) << out;
  EXPECT_TRUE(has(out, "to resume, run the same command with --checkpoint.resume=true (checkpoint.dir " + ckdir))
      << out;
  const int64_t k = steps_logged(metrics);
  const nlohmann::json last = json_lines(metrics).back();
  EXPECT_EQ(last.value("event", ""), "stopped") << last;
  EXPECT_EQ(last.value("step", -1), k) << last;
  EXPECT_EQ(last.value("checkpoint", ""), step_dir(ckdir, k)) << last;
  EXPECT_EQ(checkpoint_latest(ckdir), step_dir(ckdir, k));
  EXPECT_TRUE(has(out, "checkpoint: " + step_dir(ckdir, k))) << out;
  return k;
}

bool processes_left(const std::string& pattern) { return run_command("pgrep -f -- '" + pattern + "'", nullptr) == 0; }

// Resumes the stopped run `name` for 3 more steps and trains the same number of steps
// uninterrupted: losses, gradient norms and final parameters are the same bits.
void expect_resume_bit_identical(const TempDir& d, const std::string& name, int ranks, const std::string& o,
                                 int64_t k) {
  const std::string steps = " --training.steps=" + std::to_string(k + 3);
  RunResult resumed = train_run(d, name, ranks, o + steps + " --checkpoint.resume=true");
  RunResult straight = train_run(d, name + "_straight", ranks, o + steps);
  ASSERT_EQ(resumed.loss.size(), static_cast<size_t>(k + 3));
  expect_bit_identical(straight, resumed, name + " stopped after step " + std::to_string(k) + " and resumed");
}

TEST(Preempt, SigtermToLaunchStopsEveryRankAfterOneStep) {
  TempDir d;
  const std::string o = opts(d);
  Job job(train_cmd(d, "run", 2, o + " --training.steps=1000000"), d / "out.txt", "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return steps_logged(d / "run.jsonl") >= 3; })) << job.output();
  kill(job.pid, SIGTERM);
  const int rc = job.finish(60);
  const std::string out = job.output();
  EXPECT_TRUE(has(out, "meshtrain launch: asking every rank to stop after its current step")) << out;
  EXPECT_TRUE(has(out, "stopped by SIGUSR1 (received by ")) << out;  // mpirun passes SIGUSR1 on
  const int64_t k = expect_stopped(job, rc, d / "run.jsonl", d / "run");
  EXPECT_EQ(entries(d / "run"), std::vector<std::string>{fs::path(step_dir(d / "run", k)).filename()});
  EXPECT_FALSE(processes_left("[-]-checkpoint.dir=" + d / "run"));
  expect_resume_bit_identical(d, "run", 2, o, k);
}

// SIGHUP (the terminal launch ran in is gone) stops the job like SIGTERM; and launch
// killed outright takes the job with it: the kernel sends mpirun SIGUSR1 (its parent-death
// signal), so the ranks stop after a step and save it rather than train on with no one
// watching.
TEST(Preempt, HangupOrKillOfLaunchStopsTheJobAfterOneStep) {
  TempDir d;
  const std::string o = opts(d) + " --training.steps=1000000";
  for (int sig : {SIGHUP, SIGKILL}) {
    const std::string name = sig == SIGHUP ? "hup" : "kill";
    SCOPED_TRACE(name);
    // launch killed leaves its directory behind (in TMPDIR): in the test's own
    Job job("env TMPDIR=" + d.path + " " + train_cmd(d, name, 2, o), d / (name + ".txt"),
            "[-]-checkpoint.dir=" + d / name);
    ASSERT_TRUE(wait_for([&] { return steps_logged(d / (name + ".jsonl")) >= 3; })) << job.output();
    kill(job.pid, sig);
    const int rc = job.finish(60);
    if (sig == SIGHUP) {
      expect_stopped(job, rc, d / (name + ".jsonl"), d / name);
    } else {
      EXPECT_EQ(rc, 128 + SIGKILL);
      ASSERT_TRUE(wait_for([&] { return !processes_left("[-]-checkpoint.dir=" + d / name); })) << "the job trains on";
      const nlohmann::json last = json_lines(d / (name + ".jsonl")).back();
      EXPECT_EQ(last.value("event", ""), "stopped") << last;
      EXPECT_EQ(last.value("exit_status", 0), 75) << last;
      EXPECT_EQ(checkpoint_latest(d / name), step_dir(d / name, last.value("step", -1)));
    }
    EXPECT_FALSE(processes_left("[-]-checkpoint.dir=" + d / name));
  }
  // The killed launch's directory is left in TMPDIR; the next launch removes it, and keeps
  // one whose launch is alive (its owner file: host and pid, here this test's).
  const auto launch_dirs = [&] {
    std::vector<std::string> r;
    for (const std::string& e : entries(d.path))
      if (e.rfind("meshtrain-launch-", 0) == 0) r.push_back(e);
    return r;
  };
  ASSERT_EQ(launch_dirs().size(), 1u);
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  fs::create_directory(d / "meshtrain-launch-live");
  std::ofstream(d / "meshtrain-launch-live/owner") << host << " " << getpid() << "\n";
  std::string out;
  EXPECT_EQ(run_command("env TMPDIR=" + d.path + " " + train_cmd(d, "next", 2, opts(d) + " --training.steps=1"), &out), 0)
      << out;
  EXPECT_EQ(launch_dirs(), std::vector<std::string>{"meshtrain-launch-live"});
}

// Ctrl-C ends the job at once, and launch says so and what is on disk, with 130 (128 +
// SIGINT) as shells report an interrupted command; a rank killed outright ends it too, and
// launch says which signal and that the checkpoints written before are intact.
TEST(Preempt, InterruptOrAKilledRankEndsTheJobAndLaunchSaysSo) {
  TempDir d;
  const std::string o = opts(d) + " --training.steps=1000000";
  for (const std::string name : {"int", "rank"}) {
    SCOPED_TRACE(name);
    Job job(train_cmd(d, name, 2, o), d / (name + ".txt"), "[-]-checkpoint.dir=" + d / name);
    ASSERT_TRUE(wait_for([&] { return steps_logged(d / (name + ".jsonl")) >= 3; })) << job.output();
    if (name == "int") kill(job.pid, SIGINT);
    else kill(rank_pid(job.pid, 1), SIGKILL);
    const int rc = job.finish(60);
    const std::string out = job.output();
    if (name == "int") {
      EXPECT_EQ(rc, 128 + SIGINT) << out;
      EXPECT_TRUE(has(out, "meshtrain launch: interrupted (SIGINT): mpirun ended the job at once")) << out;
    } else {
      EXPECT_EQ(rc, 128 + SIGKILL) << out;
      EXPECT_TRUE(has(out, "meshtrain launch: the job ended by signal 9 (Killed) of a rank or mpirun")) << out;
    }
    EXPECT_TRUE(has(out, "resume with --checkpoint.resume=true")) << out;
    EXPECT_FALSE(processes_left("[-]-checkpoint.dir=" + d / name));
  }
}

// A stop asked while the ranks are still starting (mpirun just spawned, before any rank has
// its handlers) is held by launch until every rank is up, then stops them together after a
// step; mpirun alone would pass it to no rank yet (exit 0), or kill ranks still without
// handlers (exit 138). Which step is timing: launch looks for the ranks every 20 ms and
// mpirun passes the signal on while they train steps of milliseconds (on an idle machine it
// came after step 2 to 9 as often as after step 1).
TEST(Preempt, StopDuringStartUpIsHeldUntilTheRanksAreUp) {
  TempDir d;
  const std::string o = opts(d);
  Job job(train_cmd(d, "run", 2, o + " --training.steps=1000000"), d / "out.txt", "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return !children(job.pid).empty(); })) << job.output();  // mpirun is running
  kill(job.pid, SIGTERM);
  const int rc = job.finish(60);
  EXPECT_GE(expect_stopped(job, rc, d / "run.jsonl", d / "run"), 1);
  const std::string out = job.output(), asked = "meshtrain launch: asking every rank to stop";
  EXPECT_TRUE(has(out, asked) && out.find(asked) == out.rfind(asked)) << "passed on once: " << out;
  EXPECT_FALSE(processes_left("[-]-checkpoint.dir=" + d / "run"));
}

// Only rank 1 gets the signal: rank 0 learns it from the step's all-gather and both stop
// after the same step. ZeRO-1 makes each rank write its own shard of that step.
TEST(Preempt, SignalToOneRankStopsEveryRankAfterTheSameStep) {
  TempDir d;
  const std::string o = opts(d) + " --parallel.zero=1";
  Job job(train_cmd(d, "run", 2, o + " --training.steps=1000000"), d / "out.txt", "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return steps_logged(d / "run.jsonl") >= 3; })) << job.output();
  const pid_t rank1 = rank_pid(job.pid, 1);
  ASSERT_GT(rank1, 0);
  kill(rank1, SIGTERM);
  const int rc = job.finish(60);
  EXPECT_TRUE(has(job.output(), "stopped by SIGTERM (received by rank 1) after step")) << job.output();
  const int64_t k = expect_stopped(job, rc, d / "run.jsonl", d / "run");
  EXPECT_EQ(entries(step_dir(d / "run", k)),
            (std::vector<std::string>{"meta.json", "shard_00000.safetensors", "shard_00001.safetensors"}));
  EXPECT_FALSE(processes_left("[-]-checkpoint.dir=" + d / "run"));
  expect_resume_bit_identical(d, "run", 2, o, k);
}

TEST(Preempt, OneProcessStopsOnSigusr1AndResumes) {
  TempDir d;
  const std::string o = opts(d);
  Job job(train_cmd(d, "run", 1, o + " --training.steps=1000000"), d / "out.txt", "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return steps_logged(d / "run.jsonl") >= 3; })) << job.output();
  kill(job.pid, SIGUSR1);
  const int rc = job.finish(60);
  EXPECT_TRUE(has(job.output(), "stopped by SIGUSR1 after step")) << job.output();
  expect_resume_bit_identical(d, "run", 1, o, expect_stopped(job, rc, d / "run.jsonl", d / "run"));
}

TEST(Preempt, WithoutCheckpointDirTheRunStopsAndSaysNothingWasSaved) {
  TempDir d;
  const std::string cmd = "env OMP_NUM_THREADS=1 " + std::string(MESHTRAIN_BIN) + " train " + opts(d) +
                          " --training.steps=1000000 --logging.progress=off --logging.metrics=" + d / "m.jsonl";
  Job job(cmd, d / "out.txt", "[-]-logging.metrics=" + d / "m.jsonl");
  ASSERT_TRUE(wait_for([&] { return steps_logged(d / "m.jsonl") >= 3; })) << job.output();
  kill(job.pid, SIGTERM);
  EXPECT_EQ(job.finish(60), 75) << job.output();
  EXPECT_TRUE(has(job.output(), "nothing was saved: checkpoint.dir is not set")) << job.output();
  const nlohmann::json last = json_lines(d / "m.jsonl").back();
  EXPECT_EQ(last.value("event", ""), "stopped");
  EXPECT_TRUE(last.at("checkpoint").is_null()) << last;
  EXPECT_EQ(last.value("step", -1), steps_logged(d / "m.jsonl"));
}

// The stop's save is held open on rank 0 with its shard written; then launch gets SIGTERM
// again. The ranks ignore it (rank 0 says so), the save completes, and the checkpoint of an
// earlier run in the same directory is untouched, byte for byte.
TEST(Preempt, SecondSignalDuringTheSaveIsIgnored) {
  TempDir d;
  const std::string o = opts(d);
  train_run(d, "run", 2, o + " --training.steps=2");
  const std::string first = step_dir(d / "run", 2);
  const std::string meta = file_bytes(first + "/meta.json"), shard = file_bytes(first + "/shard_00000.safetensors");

  Job job(train_cmd(d, "run", 2, o + " --training.steps=1000000 --checkpoint.resume=true --parallel.test_fault=slow_save:0"),
          d / "out.txt", "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return steps_logged(d / "run.jsonl") >= 5; })) << job.output();
  kill(job.pid, SIGTERM);
  std::string tmp;
  ASSERT_TRUE(wait_for([&] {
    for (const std::string& e : entries(d / "run"))
      if (e.rfind(".tmp-step_", 0) == 0 && fs::exists(d / "run/" + e + "/shard_00000.safetensors")) tmp = e;
    return !tmp.empty();
  })) << job.output();
  kill(job.pid, SIGTERM);
  const int rc = job.finish(60);
  EXPECT_TRUE(has(job.output(), "meshtrain: already stopping after the current step (and its checkpoint); "
                                "this signal is ignored"))
      << job.output();
  const int64_t k = expect_stopped(job, rc, d / "run.jsonl", d / "run");
  EXPECT_EQ(tmp, ".tmp-" + fs::path(step_dir(d / "run", k)).filename().string());
  EXPECT_EQ(entries(d / "run"), (std::vector<std::string>{"step_00000002", fs::path(step_dir(d / "run", k)).filename()}));
  EXPECT_EQ(file_bytes(first + "/meta.json"), meta);
  EXPECT_EQ(file_bytes(first + "/shard_00000.safetensors"), shard);
  expect_resume_bit_identical(d, "run", 2, o, k);
}

// A stop asked during a periodic save stops after that step: the save in progress is the
// stop's checkpoint, and no further step is trained (or saved).
TEST(Preempt, StopDuringAPeriodicSaveStopsAfterItsStep) {
  TempDir d;
  const std::string o = opts(d) + " --checkpoint.every=4";
  Job job(train_cmd(d, "run", 1, o + " --training.steps=1000000 --parallel.test_fault=slow_save:0"), d / "out.txt",
          "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return fs::exists(d / "run/.tmp-step_00000004/shard_00000.safetensors"); }))
      << job.output();
  kill(job.pid, SIGTERM);
  const int rc = job.finish(60);
  EXPECT_EQ(expect_stopped(job, rc, d / "run.jsonl", d / "run"), 4);
  EXPECT_EQ(entries(d / "run"), std::vector<std::string>{"step_00000004"});
}

// SIGKILL in the middle of a periodic save: what is left is a temporary directory with
// rank 0's nonce and shard but no meta.json, which nothing reads; the newest complete
// checkpoint is the one before, and the next start removes the leftover and resumes from it.
TEST(Preempt, HardKillDuringASaveLeavesEarlierCheckpointsAndTheNextStartCopes) {
  TempDir d;
  const std::string o = opts(d) + " --checkpoint.every=4";
  Job job(train_cmd(d, "run", 1, o + " --training.steps=1000000 --parallel.test_fault=slow_save:0"), d / "out.txt",
          "[-]-checkpoint.dir=" + d / "run");
  ASSERT_TRUE(wait_for([&] { return fs::exists(d / "run/.tmp-step_00000008/shard_00000.safetensors"); }))
      << job.output();
  kill(job.pid, SIGKILL);
  EXPECT_EQ(job.finish(60), 128 + SIGKILL);
  EXPECT_EQ(entries(d / "run"), (std::vector<std::string>{".tmp-step_00000008", "step_00000004"}));
  EXPECT_EQ(entries(d / "run/.tmp-step_00000008"), (std::vector<std::string>{"nonce", "shard_00000.safetensors"}));
  EXPECT_EQ(checkpoint_latest(d / "run"), step_dir(d / "run", 4));

  fs::remove(d / "run.jsonl");  // steps 4-7 ran but were not saved: the resumed run logs them again
  std::string out;
  ASSERT_EQ(run_command(train_cmd(d, "run", 1, o + " --training.steps=10 --checkpoint.resume=true"), &out), 0) << out;
  EXPECT_TRUE(has(out, "removed " + d / "run/.tmp-step_00000008, an incomplete checkpoint left by an interrupted save"))
      << out;
  EXPECT_TRUE(has(out, "resumed from " + step_dir(d / "run", 4) + " at step 4")) << out;
  EXPECT_EQ(entries(d / "run"), (std::vector<std::string>{"step_00000004", "step_00000008", "step_00000010"}));
  RunResult straight = train_run(d, "straight", 1, o + " --training.steps=10");
  RunResult resumed;  // steps 4-9 and the final parameters, read as train_run reads them
  for (const nlohmann::json& j : json_lines(d / "run.jsonl")) {
    if (j.contains("event")) continue;
    resumed.loss.push_back(j["loss"]);
    resumed.grad_norm.push_back(j["grad_norm"]);
  }
  CpuAllocator alloc;  // outlives the units' tensors
  std::vector<Unit> units = model_layout(straight.model);
  for (Unit& u : units) u.w = Tensor::empty({u.numel}, DType::f32, alloc, MemTag::params);
  checkpoint_load(checkpoint_latest(d / "run"), straight.model, checkpoint_param_slices(units));
  for (Unit& u : units) resumed.units.emplace_back(u.w.f32(), u.w.f32() + u.numel);
  straight.loss.erase(straight.loss.begin(), straight.loss.begin() + 4);
  straight.grad_norm.erase(straight.grad_norm.begin(), straight.grad_norm.begin() + 4);
  expect_bit_identical(straight, resumed, "killed during the save of step 8, resumed from step 4");
}

// launch gives its mpirun a session directory of its own (mpiruns sharing TMPDIR's
// ompi.<host>.<uid> can race there when two start at once, and one fails before any rank
// starts) and removes it afterwards; one the user chose is kept, and so is mpirun's own
// where ranks may start on other machines (--host, --hostfile). mpirun tells each rank
// where its session is (OMPI_MCA_orte_top_session_dir, <base>/ompi.<host>.<uid>).
TEST(Preempt, LaunchGivesMpirunASessionDirectoryOfItsOwn) {
  TempDir d;
  const std::string o = opts(d);
  fs::create_directories(d / "tmp");
  for (const std::string name : {"own", "chosen", "hosts"}) {
    const std::string env = "env TMPDIR=" + d / "tmp" +
                            (name == "chosen" ? " OMPI_MCA_orte_tmpdir_base=" + d / "chosen_base" : "") + " ";
    std::string cmd = env + train_cmd(d, name, 2, o + " --training.steps=1000000");
    const std::string launch = " launch -n 2 ";
    if (name == "hosts") cmd.replace(cmd.find(launch), launch.size(), launch + "--host localhost:2 ");
    Job job(cmd, d / (name + ".txt"), "[-]-checkpoint.dir=" + d / name);
    ASSERT_TRUE(wait_for([&] { return steps_logged(d / (name + ".jsonl")) >= 1; })) << cmd << "\n" << job.output();
    const pid_t rank0 = rank_pid(job.pid, 0);
    ASSERT_GT(rank0, 0);
    const fs::path base = fs::path(environment_value(rank0, "OMPI_MCA_orte_top_session_dir")).parent_path();
    if (name == "own") {
      EXPECT_EQ(base.parent_path(), d / "tmp");
      EXPECT_EQ(base.filename().string().rfind("meshtrain-launch-", 0), 0u) << base;
    } else {
      EXPECT_EQ(base, name == "chosen" ? d / "chosen_base" : d / "tmp") << name;
    }
    kill(job.pid, SIGTERM);
    EXPECT_EQ(job.finish(60), 75) << job.output();
    EXPECT_EQ(entries(d / "tmp"), std::vector<std::string>{}) << name << ": launch removed its directory";
  }
}

}  // namespace
