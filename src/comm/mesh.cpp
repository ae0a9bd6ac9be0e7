#include "comm/mesh.h"

#include "core/error.h"

namespace mt {

Mesh::Mesh(Communicator& world, int dp, int pp, int tp) : world_(world) {
  MT_CHECK(dp >= 1 && pp >= 1 && tp >= 1, "parallel.dp, parallel.pp and parallel.tp must be at least 1");
  MT_CHECK(world.size() == dp * pp * tp,
           "the job has " << world.size() << " ranks but parallel.dp x parallel.pp x parallel.tp = " << dp << " x "
                          << pp << " x " << tp << " = " << dp * pp * tp << "; launch " << dp * pp * tp
                          << " ranks (meshtrain launch -n " << dp * pp * tp << ") or change the layout");
  const int r = world.rank();
  const int t = r % tp, d = (r / tp) % dp, p = r / (tp * dp);
  // Each split groups the ranks that differ only along one axis.
  tp_ = world.split(p * dp + d, t, "tp");
  dp_ = world.split(p * tp + t, d, "dp");
  pp_ = world.split(d * tp + t, p, "pp");
}

void Mesh::set_options(const CommOptions& o) {
  for (Communicator* c : {dp_.get(), pp_.get(), tp_.get()}) c->set_options(o);
}

}  // namespace mt
