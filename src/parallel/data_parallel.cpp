#include "parallel/data_parallel.h"

#include <cstring>

#include "core/error.h"

namespace mt {

uint64_t params_hash(const float* p, int64_t n, uint64_t h) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
  for (int64_t i = 0; i < n * 4; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

std::vector<float> host_floats(const Tensor& t) {
  std::vector<float> h((t.nbytes() + 3) / 4);
  Tensor::wrap(h.data(), {t.numel()}, t.dtype()).copy_from(t.reshape({t.numel()}));
  return h;
}

void check_same_units(Communicator& group, const std::vector<Unit>& units) {
  uint64_t h = params_hash(nullptr, 0);
  for (const Unit& u : units)  // any dtype: the bytes of its numel elements
    if (u.numel > 0) h = params_hash(host_floats(u.w).data(), u.w.nbytes() / 4, h);
  check_same_hash(group, h, "parameters");
}

void check_same_hash(Communicator& group, uint64_t hash, const std::string& what, const std::string& fix) {
  uint32_t mine[2] = {static_cast<uint32_t>(hash), static_cast<uint32_t>(hash >> 32)};
  std::vector<uint32_t> all(2 * group.size());
  group.allgather(Tensor::wrap(mine, {2}, DType::u32), Tensor::wrap(all.data(), {2 * group.size()}, DType::u32));
  for (int r = 1; r < group.size(); ++r)
    MT_CHECK(all[2 * r] == all[0] && all[2 * r + 1] == all[1],
             "rank " << r << " of group '" << group.name() << "' has different " << what << " than rank 0; " << fix);
}

}  // namespace mt
