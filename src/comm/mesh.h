// The device mesh: the world's ranks arranged as pp x dp x tp (tp varies fastest, so
// tensor-parallel peers are neighbours), with one communicator per axis. Built once by
// splitting the world; strategies receive the group they need from it.
//
//   world rank = (pp_index * dp + dp_index) * tp + tp_index
#pragma once
#include <memory>

#include "comm/communicator.h"

namespace mt {

class Mesh {
 public:
  // Checks world size = dp x pp x tp (an mt::Error that says how to fix it otherwise).
  Mesh(Communicator& world, int dp, int pp, int tp);
  Communicator& world() const { return world_; }
  Communicator& dp() const { return *dp_; }
  Communicator& pp() const { return *pp_; }
  Communicator& tp() const { return *tp_; }
  void set_options(const CommOptions& o);  // on the dp, pp and tp groups (not the world)
  int dp_size() const { return dp_->size(); }
  int dp_rank() const { return dp_->rank(); }

 private:
  Communicator& world_;
  std::unique_ptr<Communicator> dp_, pp_, tp_;
};

}  // namespace mt
