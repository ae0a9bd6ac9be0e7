// Pipeline parallelism: the model cut into S = P·v stages of consecutive blocks (P ranks,
// v chunks each; parallel/schedule.h places stages on ranks), and one executor that runs
// any checked schedule. Every training step goes through it: one rank with m micro-batches
// is gradient accumulation (1f1b with P = 1: F 0, B 0, F 1, B 1, ...).
//
//   Schedule s = pipeline_schedule(cfg.parallel, cfg.model, m, recompute);  // checked
//   ModelShare share = pipeline_share(cfg.model, s, layers, pp.rank());   // this rank's chunks and slots
//   Model model(cfg.model, alloc, B, recompute, true, &tp, share);
//   Pipeline pipe(model, pp, s, B, T, timeout_s, alloc);
//   double loss_sum = pipe.train(feed, 1.0f / tokens, strategy);         // this rank's list, once
//
// The executor walks this rank's list in order. Sends and receives are posted at once
// (Communicator::post_send/post_recv) and never block the list; a compute action waits only
// for the receive it reads. Each (micro-batch, chunk) takes one of its chunk's activation
// slots from its first action to its last, so a rank holds exactly what the list needs
// (1f1b at most P - r micro-batches on rank r, gpipe all m). A send copies what it sends,
// so its slot is free at once. A receive that waits longer than parallel.timeout_s ends
// the job with a message naming the action, its stage and micro-batch, and the peer.
// Where consecutive stages sit on one rank (zbv's turn), the activation or gradient is
// copied between the rank's own slots instead. With training.device = cuda the slots and
// the sends' copies are GPU memory (copied with Tensor::copy_from, which waits for the
// kernels that wrote them); transfers go through host memory (comm/communicator.h).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "nn/model.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_config.h"
#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"

namespace mt {

// Blocks per virtual stage (S = P·v entries, each at least 1, summing to n_layer). spec
// "auto" balances the ranks' cost per token (a rank runs all its chunks): a block's matrix
// products and attention, plus the embedding on the first stage and the head and loss on
// the last (pipeline_stage_costs), then splits each rank's blocks evenly over its chunks;
// otherwise a comma-separated list such as "3,4,4,3". Throws mt::Error naming
// parallel.pp_layers when the list does not fit.
std::vector<int> pipeline_layers(const ModelConfig& cfg, const PipeLayout& layout, const std::string& spec);
// The cost per token (forward FLOPs) of each stage for a layer split: what "auto" balances.
std::vector<double> pipeline_stage_costs(const ModelConfig& cfg, const std::vector<int>& layers);

// The schedule a run's keys ask for, m micro-batches per step: parallel.pp_schedule named
// (with parallel.pp_chunks, 0: its default) or read from file:PATH. Throws mt::Error, naming
// the keys, when it cannot run this model: a layout the schedule refuses, a file written
// for another layout, fewer blocks than stages, a parallel.pp_layers list that does not fit,
// schedule_check's problems, more micro-batches than transfers can tell apart, recompute
// with a split backward, or a rank holding a tied embedding and head whose last weight
// gradient of the embedding comes before the head's (the embedding's copy would be
// reduced before the head's part is in it).
Schedule pipeline_schedule(const ParallelConfig& par, const ModelConfig& model, int m, bool recompute);

// Per chunk of `rank`, the most micro-batches whose activations its list keeps at once
// (from a micro-batch's first action on the chunk to its last).
std::vector<int> schedule_slots(const Schedule& s, int rank);
// This rank's share of the model: its chunks' layers (by `layers`, per stage), which holds
// the embedding and the head, the slots its list needs, and whether it splits backward.
ModelShare pipeline_share(const ModelConfig& cfg, const Schedule& s, const std::vector<int>& layers, int rank);
// Forward only, for validation: each rank runs micro-batches one after another through its
// chunks in stage order (receive, forward, send).
Schedule schedule_forward_only(const PipeLayout& layout);

class Pipeline {
 public:
  // Fills micro-batch `micro`'s token ids and targets ([B, T] each).
  using Feed = std::function<void(int micro, int32_t* tokens, int32_t* targets)>;
  // After a head chunk's forward (validation): its micro-batch, slot and loss sum.
  using OnHead = std::function<void(int micro, int slot, double loss)>;

  // `schedule` must pass schedule_check, and `model` be made with pipeline_share of it.
  // Sends' buffers are counted in `alloc` (MemTag::comm).
  Pipeline(Model& model, Communicator& pp, Schedule schedule, int B, int T, double timeout_s, Allocator& alloc);
  ~Pipeline();

  // One optimizer step: this rank's list, with gradient scale `scale`. The strategy hears
  // which backward is a unit's last of the step (set_sync: its chunk's last B or BW). Returns the sum of the losses of
  // the micro-batches whose head this rank holds (0 elsewhere).
  double train(const Feed& feed, float scale, DataParallel& strategy);
  // Forward only over m micro-batches (targets given): the same sum.
  double evaluate(int m, const Feed& feed, const OnHead& on_head = {});

  const Schedule& schedule() const { return schedule_; }
  // This rank's actions of the last train(), timed in seconds from its start: compute
  // actions while computing, sends while posting, receives while the rank waited for them.
  const std::vector<TimedAction>& timeline() const { return timeline_; }
  // The wall-clock time (seconds since the epoch) of that timeline's 0: ranks start their
  // timelines at different moments, and this puts them on one axis (to within the hosts'
  // clock agreement; exactly on one host).
  double timeline_origin() const { return origin_; }

 private:
  struct SendBuffer;
  void wait(Communicator::Transfer& t, const Action& a, const char* what);
  void post_send(const Tensor& t, const Action& a, int tag);
  double run(const std::vector<Action>& list, const Feed& feed, float scale, DataParallel* strategy,
             const OnHead& on_head);

  Model& model_;
  Communicator& pp_;
  Schedule schedule_;
  int B_, T_;
  double timeout_s_;
  Allocator& alloc_;
  std::vector<SendBuffer> sends_;  // reused across steps once their messages completed
  int send_copies_ = 0;            // copies allocated at the first send (schedule_send_copies)
  std::vector<TimedAction> timeline_;
  double origin_ = 0;
};

}  // namespace mt
