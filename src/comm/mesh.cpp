#include "comm/mesh.h"

#include <cstdio>

#include "core/error.h"

namespace mt {

Mesh::Mesh(Communicator& world, int dp, int pp, int tp, int cp)
    : world_(world), n_dp_(dp), n_pp_(pp), n_tp_(tp), n_cp_(cp) {
  MT_CHECK(dp >= 1 && pp >= 1 && tp >= 1 && cp >= 1,
           "parallel.dp, parallel.pp, parallel.tp and parallel.cp must be at least 1");
  const int n = dp * pp * tp * cp;
  MT_CHECK(world.size() == n, "the job has " << world.size() << " ranks but parallel.dp x parallel.pp x parallel.cp x "
                                             << "parallel.tp = " << dp << " x " << pp << " x " << cp << " x " << tp
                                             << " = " << n << "; launch " << n << " ranks (meshtrain launch -n " << n
                                             << ") or change the layout");
  const MeshCoords m = coords(world.rank());
  // Each split groups the ranks that differ only along its axes.
  tp_ = world.split((m.pp * dp + m.dp) * cp + m.cp, m.tp, "tp");
  cp_ = world.split((m.pp * dp + m.dp) * tp + m.tp, m.cp, "cp");
  dp_ = world.split((m.pp * cp + m.cp) * tp + m.tp, m.dp, "dp");
  pp_ = world.split((m.dp * cp + m.cp) * tp + m.tp, m.pp, "pp");
  if (cp > 1) data_ = world.split(m.pp * tp + m.tp, m.dp * cp + m.cp, "dp x cp");
}

MeshCoords Mesh::coords(int r) const {
  return {r / (n_tp_ * n_cp_ * n_dp_), (r / (n_tp_ * n_cp_)) % n_dp_, (r / n_tp_) % n_cp_, r % n_tp_};
}

std::string Mesh::table(int max_ranks) const {
  auto rank_of = [&](MeshCoords m) { return ((m.pp * n_dp_ + m.dp) * n_cp_ + m.cp) * n_tp_ + m.tp; };
  // The world ranks of the group along one axis through rank r.
  auto members = [&](int r, int MeshCoords::*axis, int size) {
    std::string s;
    for (int i = 0; i < size; ++i) {
      MeshCoords m = coords(r);
      m.*axis = i;
      if (i) s += ',';
      s += std::to_string(rank_of(m));
    }
    return s;
  };
  char line[256];
  std::snprintf(line, sizeof line, "mesh: %d ranks = pp %d x dp %d x cp %d x tp %d (tp nearest)\n", world_.size(),
                n_pp_, n_dp_, n_cp_, n_tp_);
  std::string out = line;
  out += "  rank  pp dp cp tp  tp group    cp group    dp group    pp group";
  for (int r = 0; r < world_.size() && r < max_ranks; ++r) {
    const MeshCoords m = coords(r);
    std::snprintf(line, sizeof line, "\n  %4d  %2d %2d %2d %2d  %-10s  %-10s  %-10s  %s", r, m.pp, m.dp, m.cp, m.tp,
                  members(r, &MeshCoords::tp, n_tp_).c_str(), members(r, &MeshCoords::cp, n_cp_).c_str(),
                  members(r, &MeshCoords::dp, n_dp_).c_str(), members(r, &MeshCoords::pp, n_pp_).c_str());
    out += line;
  }
  if (world_.size() > max_ranks) out += "\n  ... and " + std::to_string(world_.size() - max_ranks) + " more";
  return out;
}

std::vector<Communicator*> Mesh::groups() const {
  std::vector<Communicator*> g{dp_.get(), pp_.get(), tp_.get(), cp_.get()};
  if (data_) g.push_back(data_.get());
  return g;
}

void Mesh::set_options(const CommOptions& o) {
  for (Communicator* c : groups()) c->set_options(o);
}

}  // namespace mt
