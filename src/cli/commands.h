// The subcommands of meshtrain, one function each (main.cpp dispatches).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace CLI {
class App;
}

namespace mt {

// meshtrain launch -n N [--hostfile FILE] [mpirun options] COMMAND ...: starts N ranks
// through mpirun and waits for it, passing SIGTERM and SIGUSR1 on as a graceful stop
// (launch.cpp). Returns mpirun's exit status.
int cmd_launch(const std::vector<std::string>& args, const char* self);
// A rank of a `train` job started by launch says, once every rank has its stop handlers,
// that launch may pass stop requests on (launch.cpp); elsewhere it does nothing.
void launch_ready_announce(Communicator& world);

// meshtrain bench comm [--min-bytes B] [--max-bytes B] [--iters K] [--dtype f32|bf16]:
// nccl-tests-style time / algorithm bandwidth / bus bandwidth per collective and size.
int cmd_bench_comm(const std::vector<std::string>& args, Communicator& world);

// meshtrain bench profile [--out FILE.toml] [--seconds S] [--config FILE.toml]: measures this
// machine (one device per rank) and writes a hardware profile for `meshtrain plan --hardware`
// (bench_profile.cpp, plan/hardware.h).
int cmd_bench_profile(const std::vector<std::string>& args, Communicator& world);

// meshtrain schedule [--schedule NAME|file:PATH] [--pp P] [--chunks V] [--microbatches M]
// [--compare] [--json] [--svg FILE] [--csv FILE] [--costs F=1,B=2,...]: builds (or reads),
// checks and simulates a pipeline schedule; prints each rank's timeline, the bubble and the
// activations held (schedule_cmd.cpp).
struct ScheduleOptions {
  std::string schedule = "1f1b";
  std::optional<int> pp, chunks, micro;  // unset: 4 ranks, the schedule's own chunks, 8 micro-batches (or the file's)
  bool compare = false, json = false;
  std::string svg, csv, costs;
};
void schedule_options_add(CLI::App* cmd, ScheduleOptions* o);
int cmd_schedule(const ScheduleOptions& o);

// meshtrain checkpoint info DIR [--json]: what a checkpoint holds (step, layout, model,
// units, totals per tensor kind, data position) and every file checked against meta.json;
// exit status 1 naming the damaged file and what to do (checkpoint_cmd.cpp).
struct CheckpointOptions {
  std::string dir;
  bool json = false;
};
void checkpoint_options_add(CLI::App* cmd, CheckpointOptions* o);
int cmd_checkpoint(const CheckpointOptions& o);

// meshtrain plan --gpus N [--config FILE] [--set k=v] [--gpus-per-node G] [--hardware NAME|FILE]
// [--global-batch B] [--layout TEXT] [--precision P] [--top K] [--json] [--svg FILE]: memory,
// bytes and step time of one layout, or every layout that fits ranked (plan_cmd.cpp).
struct PlanOptions {
  std::string config;
  std::vector<std::string> overrides;
  int gpus = 0, gpus_per_node = 8, top = 10;
  std::string hardware = "h100", layout, precision, grad_dtype, svg;
  int64_t global_batch = -1;  // -1: the configuration's
  bool json = false;
};
void plan_options_add(CLI::App* cmd, PlanOptions* o);
int cmd_plan(const PlanOptions& o);

}  // namespace mt
