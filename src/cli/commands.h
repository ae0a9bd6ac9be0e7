// The subcommands of meshtrain, one function each (main.cpp dispatches).
#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace mt {

// meshtrain launch -n N [--hostfile FILE] [mpirun options] COMMAND ...: starts N ranks
// through mpirun and waits for it, passing SIGTERM and SIGUSR1 on as a graceful stop
// (launch.cpp). Returns mpirun's exit status.
int cmd_launch(const std::vector<std::string>& args, const char* self);

// meshtrain bench comm [--min-bytes B] [--max-bytes B] [--iters K] [--dtype f32|bf16]:
// nccl-tests-style time / algorithm bandwidth / bus bandwidth per collective and size.
int cmd_bench_comm(const std::vector<std::string>& args, Communicator& world);

}  // namespace mt
