// The device mesh: the world's ranks arranged as pp x dp x cp x tp (tp varies fastest, so
// the most talkative groups are nearest: tensor-parallel peers are neighbours, then the
// context-parallel ring, then data parallelism; pipeline stages are farthest apart), with
// one communicator per axis. Built once by splitting the world; strategies receive the
// group they need from it.
//
//   world rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index
//
// Gradients are reduced over dp x cp (the `data` group: every rank that holds the same
// parameters), since the cp ranks of a sequence each see only their part of it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace mt {

// A rank's place on each axis.
struct MeshCoords {
  int pp = 0, dp = 0, cp = 0, tp = 0;
};

class Mesh {
 public:
  // Checks world size = dp x pp x cp x tp (an mt::Error that says how to fix it otherwise).
  Mesh(Communicator& world, int dp, int pp, int tp, int cp = 1);
  Communicator& world() const { return world_; }
  Communicator& dp() const { return *dp_; }
  Communicator& pp() const { return *pp_; }
  Communicator& tp() const { return *tp_; }
  Communicator& cp() const { return *cp_; }
  Communicator& data() const { return data_ ? *data_ : *dp_; }  // dp x cp (dp itself when cp = 1)
  void set_options(const CommOptions& o);  // on the groups (not the world)
  std::vector<Communicator*> groups() const;  // dp, pp, tp, cp and dp x cp (when cp > 1)
  int dp_size() const { return dp_->size(); }
  int dp_rank() const { return dp_->rank(); }
  MeshCoords coords(int world_rank) const;
  // Every rank's coordinates and the members of its groups, one line per rank (the first
  // `max_ranks`), for the run header.
  std::string table(int max_ranks = 64) const;

 private:
  Communicator& world_;
  int n_dp_, n_pp_, n_tp_, n_cp_;
  std::unique_ptr<Communicator> dp_, pp_, tp_, cp_, data_;
};

}  // namespace mt
