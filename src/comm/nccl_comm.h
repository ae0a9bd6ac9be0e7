// NCCL between GPUs (parallel.gpu_comm): a group whose ranks each have their own GPU runs
// its all-reduces, reduce-scatters, all-gathers and broadcasts of GPU tensors on the GPUs,
// with no host copies, and with the same results as every other path, bit for bit.
//
//   Mesh mesh(world, dp, pp, tp, cp);
//   std::string how = attach_gpu_comm(mesh, "auto", gpu_alloc);  // "dp: NCCL 2.28.9; tp: ..."
//
// Each group of two or more ranks that reduces or gathers GPU tensors (dp, tp, dp x cp, and
// every group split later: ZeRO's shard and replica groups, DDP's node groups, the tied head's
// pair of pipeline stages) first gathers every rank's GPU (its UUID) and decides:
// NCCL when every rank has a GPU of its own and NCCL loads; otherwise its GPU tensors keep
// going through host memory and MPI (comm/communicator.h), as ranks sharing one GPU must
// (NCCL refuses two ranks on one GPU). parallel.gpu_comm = nccl makes the fallback an error
// that names the ranks; host never uses NCCL.
//
// The sums are meshtrain's, not NCCL's. NCCL's reductions add in ring or tree order and
// round 16-bit partial sums at every hop; here a reduction moves each rank's pieces to their
// owners with NCCL's point-to-point sends (one group call: every pair at once), and the owner
// adds them in rank order in float and rounds once (cuda_sum_in_order, core/cuda.h), as the
// host path does. So a run on eight GPUs gives the bits of the same run with its ranks sharing
// a GPU, or on the CPU's communicator. The exchange is all-to-all (each rank sends each other
// rank its piece directly): the bytes of a ring, 2 (n - 1) / n of the tensor per all-reduce,
// in n - 1 messages per rank. All-gather and broadcast are NCCL's own (they only move bytes).
//
// Ordering: an operation records an event on the compute stream when issued, and runs on the
// group's own NCCL stream after it; the communication thread polls for completion (so the
// watchdog still ends a stuck job) and then marks the work done. Point-to-point messages
// (pipelines, the context-parallel ring), all-to-all and the hierarchical collectives still
// go through host memory.
//
// libnccl is loaded on first use (dlopen), not linked, as cuBLASLt is: CPU runs never load it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace mt {

class Mesh;

// Whether this build has NCCL support (its header was found), and the library's version
// ("2.28.9") or, when it cannot be used, why (starting with "!").
bool nccl_built();
std::string nccl_status();

// A group's choice for parallel.gpu_comm = auto | nccl, from every rank's GPU: "GPU-<uuid>",
// or "!why" when that rank cannot use NCCL. Throws under `nccl` when NCCL cannot serve the
// group (naming the ranks and what to change).
struct GpuCommChoice {
  bool nccl = false;
  std::string why;  // "NCCL 2.28.9", or why the group goes through host memory
};
GpuCommChoice choose_gpu_comm(const std::string& mode, const std::string& group, const std::vector<std::string>& gpus,
                              const std::string& version);

// Gives the mesh's groups that reduce or gather GPU tensors (dp, tp, dp x cp) and every group
// split later from any mesh group NCCL where choose_gpu_comm says so (pp and cp themselves
// carry only point-to-point messages); `mode` is parallel.gpu_comm (host: nothing).
// Collective over the world. Returns one line for the run header: each of those groups of two
// or more ranks and how its GPU tensors travel.
std::string attach_gpu_comm(Mesh& mesh, const std::string& mode, Allocator& gpu);

// NCCL collectives over `group` (collective over it: rank 0 makes the unique id and
// broadcasts it over the group), on this process's current GPU, with their receive buffers
// in `gpu` (counted under MemTag::comm). Fails when NCCL cannot be loaded.
std::unique_ptr<DeviceCollectives> nccl_collectives(Communicator& group, Allocator& gpu);

}  // namespace mt
