// Pipeline schedules as data. A schedule is one ordered list of actions per pipeline rank:
// forwards, backwards (whole, or split into input-gradient and weight-gradient halves) and
// the sends and receives between ranks, each naming its micro-batch and model chunk. A
// function makes the lists for a named schedule, a checker proves any lists consistent
// (every action once, dependencies in order, no deadlock), a text format lets a person
// write their own, and the same lists feed the simulator (schedule_sim.h), the picture
// (schedule_svg.h) and the executor.
//
// The model is cut into S = P·v virtual stages: P pipeline ranks, v chunks per rank.
// Stage 0 holds the embedding, stage S-1 the final norm, head and loss. Chunk c of rank r
// is stage
//   loop placement (gpipe, 1f1b, zb-h1, interleaved):  c·P + r   (the micro-batch loops v times over the ranks)
//   V placement (zbv, v = 2):                         r for chunk 0, 2P-1-r for chunk 1
//                                                     (down the ranks and back up: rank 0 holds the first and last stage)
//
// Example: 1f1b with P = 2 ranks, m = 2 micro-batches; rank 0's list, as (kind, micro, chunk, peer):
//   F 0 0, SEND_ACT 0 0 1, F 1 0, SEND_ACT 1 0 1, RECV_GRAD 0 0 1, B 0 0, RECV_GRAD 1 0 1, B 1 0
// and rank 1's:
//   RECV_ACT 0 0 0, F 0 0, B 0 0, SEND_GRAD 0 0 0, RECV_ACT 1 0 0, F 1 0, B 1 0, SEND_GRAD 1 0 0
//
// Execution semantics (what "cannot deadlock" means, and what the executor must honour):
// each rank runs its list in order; a send is posted asynchronously and the rank goes on
// at once (the buffer stays alive until it completes); a receive blocks until its matching
// send has been posted; compute actions wait only for earlier actions of the same list.
// The checker replays the lists under these rules and reports any rank left waiting.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mt {

struct Action {
  // F forward; B whole backward; BI backward to the input (what the previous stage waits
  // for); BW backward to the weights (any time after BI). Transfers: ACT carries a
  // forward's output to the next stage, GRAD a backward's input gradient to the previous.
  enum Kind : uint8_t { F, B, BI, BW, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD };
  Kind kind;
  int micro;      // micro-batch, 0 .. m-1
  int chunk;      // this rank's model chunk: for a transfer, the chunk whose output is sent or whose input is received
  int peer = -1;  // transfers: the pp rank at the other end; -1 for compute

  bool is_compute() const { return kind <= BW; }
  bool is_send() const { return kind == SEND_ACT || kind == SEND_GRAD; }
  bool is_recv() const { return kind == RECV_ACT || kind == RECV_GRAD; }
  bool operator==(const Action&) const = default;
};

const char* action_kind_name(Action::Kind k);         // "F", "SEND_ACT", ...
std::optional<Action::Kind> action_kind_parse(const std::string& name);
std::string action_describe(const Action& a);          // "RECV_GRAD micro 3 chunk 0 from rank 2"

enum class Placement { loop, vee };

struct PipeLayout {
  int pp = 1;      // P: pipeline ranks
  int chunks = 1;  // v: model chunks per rank
  int micro = 1;   // m: micro-batches per optimizer step (per data-parallel rank)
  Placement placement = Placement::loop;

  int stages() const { return pp * chunks; }
  int stage(int rank, int chunk) const;  // virtual stage of chunk `chunk` of rank `rank`
  int rank_of(int stage) const;
  int chunk_of(int stage) const;
  bool operator==(const PipeLayout&) const = default;
};

struct Schedule {
  std::string name;  // gpipe | 1f1b | interleaved | zb-h1 | zbv | the file it came from
  PipeLayout layout;
  std::vector<std::vector<Action>> ranks;  // [P][actions in execution order]
};

// ---- The named schedules ----
//
//   gpipe        all forwards, then all backwards; holds all m micro-batches' activations.
//   1f1b         P-r-1 warm-up forwards on rank r, then one forward and one backward in
//                turn: at most P-r micro-batches in flight, same bubble as gpipe.
//   interleaved  1f1b over v >= 2 chunks (loop placement), forwards in groups of P
//                micro-batches per chunk; m must be a multiple of P. Bubble shrinks v-fold.
//   zb-h1        1f1b with each backward split into BI and BW; rank r delays its BWs by r
//                steps so they fill the tail. Peak activations (counting until BW) as
//                1f1b's first rank; bubble a third of 1f1b's when F, BI and BW cost alike.
//   zbv          two chunks per rank in a V (zero-bubble V): built greedily (see
//                schedule.cpp); activations held bounded by 1f1b's first rank's.
const std::vector<std::string>& schedule_names();

// The largest pipeline a schedule is made or read for: pp x chunks x micro-batches forward
// passes per step (every rank makes every rank's action list: about 1 GB at this size).
constexpr int64_t kMaxScheduleForwards = int64_t{1} << 22;
// Whether pp x chunks x micro (each at least 1) is at most `most`, without overflow.
inline bool schedule_within(int64_t pp, int64_t chunks, int64_t micro, int64_t most = kMaxScheduleForwards) {
  return pp <= most && chunks <= most / pp && micro <= most / (pp * chunks);
}

// Why a named schedule cannot run a layout: the knob to change, a value to use instead
// (the smallest valid one at or above the value given, else the only valid one) and the
// reason. Callers name the knob their own way (--chunks, parallel.pp_chunks).
struct LayoutIssue {
  enum Knob { chunks, microbatches } knob;
  int use;
  std::string why;
};
// Throws mt::Error on an unknown name or a knob below 1.
std::optional<LayoutIssue> schedule_layout_issue(const std::string& name, int pp, int chunks, int micro);

int schedule_default_chunks(const std::string& name);  // 2 for interleaved and zbv, else 1
// Whether the named schedule splits each backward into input and weight halves (zb-h1 and
// zbv, the zero-bubble ones): their weight half needs the activations, so no block recomputes.
bool schedule_splits_backward(const std::string& name);

// The lists of every rank for a named schedule (throws mt::Error on an unknown name or a
// layout schedule_layout_issue rejects). Pure: the same arguments give the same lists, so
// every rank can make all of them and check them before a step.
Schedule schedule_make(const std::string& name, int pp, int chunks, int micro);

// ---- Checking ----

// Everything wrong with the lists, at most `limit` messages (the last says how many more),
// each naming the rank, the action's index in its list and what is wrong. Empty: every
// action required is there exactly once (F and B, or F, BI and BW, per micro-batch and
// stage; a send and a receive for each hop between ranks), each transfer names the right
// peer, each action comes after what it needs on its own rank, and the replay below
// finishes (no deadlock).
std::vector<std::string> schedule_check(const Schedule& s, int limit = 20);

// Where an action is: rank and index in that rank's list.
struct ActionRef {
  int rank;
  int index;
};

// Replays the lists under the execution semantics above, doing nothing but calling
// visit(action, send) in an order those semantics allow, where `send` is the matching
// send for a receive (null otherwise). Returns the index each rank stopped at (its list's
// size when it finished). The lists must name valid peers, micro-batches and chunks, each
// transfer once (schedule_check checks that before replaying).
std::vector<int> schedule_replay(const Schedule& s, const std::function<void(ActionRef, const ActionRef*)>& visit);

// Per rank, the most sent messages that can be unread at once: a send's copy is free once
// the sender has heard back from the action that reads it (a chain of messages from the
// reader to the sender), with every reader as late as the schedule allows. The executor
// allocates this many send copies up front (Pipeline::post_send), so a pipeline's buffers
// are the same on every run. 1f1b on 2 ranks: 2; gpipe: m.
std::vector<int> schedule_send_copies(const Schedule& s);

// ---- Text format ----
//
//   # comments run from # to the end of the line
//   layout,pp=2,chunks=1,microbatches=2,stages=loop      (first; stages = loop (default) | v)
//   0,F,0,0                                              rank,kind,micro,chunk
//   0,SEND_ACT,0,0,1                                     transfers add the peer rank
//
// Ranks' lines may come in any order; each rank's actions keep their order in the file.
std::string schedule_to_text(const Schedule& s);
// Parses text (source names it in messages: "FILE:LINE: ..."); throws mt::Error on a
// malformed line. Parsing does not check the schedule: run schedule_check.
Schedule schedule_from_text(const std::string& text, const std::string& source);
Schedule schedule_read(const std::string& path);
void schedule_write(const std::string& path, const Schedule& s);

}  // namespace mt
