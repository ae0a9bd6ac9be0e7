#include "nn/cp.h"

#include "core/error.h"
#include "ops/attention.h"

namespace mt {

std::vector<int32_t> cp_positions(int64_t T, CpShard cp) {
  MT_CHECK(T % (2 * cp.size) == 0 || cp.size == 1,
           "model.seq_len = " << T << " does not split into 2 x parallel.cp = " << 2 * cp.size << " chunks");
  std::vector<int32_t> pos;
  pos.reserve(T / cp.size);
  if (cp.size == 1) {
    for (int64_t t = 0; t < T; ++t) pos.push_back(static_cast<int32_t>(t));
    return pos;
  }
  const int64_t c = T / (2 * cp.size);
  for (int64_t chunk : {int64_t{cp.rank}, int64_t{2 * cp.size - 1 - cp.rank}})
    for (int64_t i = 0; i < c; ++i) pos.push_back(static_cast<int32_t>(chunk * c + i));
  return pos;
}

void CpMappings::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head,
                                   int n_kv_head) {
  attention_fused_forward(out, lse, qkv, n_head, n_kv_head);
}

void CpMappings::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                    const Tensor& lse, int n_head, int n_kv_head) {
  attention_fused_backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head);
}

bool CpMappings::takes_kept(const Tensor& kept, int n_head, int n_kv_head) const {
  return attention_fused_reads_16bit(kept, n_head, n_kv_head);
}

}  // namespace mt
