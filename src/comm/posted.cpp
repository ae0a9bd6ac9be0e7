// The pipeline's point-to-point messages, posted at once from the calling thread outside the
// group's queue (comm/communicator.h: post_send, post_recv, Transfer::wait_for).
#include <algorithm>
#include <chrono>
#include <thread>

#include "comm/communicator.h"
#include "core/error.h"

namespace mt {

namespace {

// A host buffer for a posted message of GPU tensor t, counted under MemTag::comm.
Tensor posted_buffer(const Tensor& t, Allocator* alloc) {
  MT_CHECK(!alloc || alloc->device() == Device::cpu,
           "internal: communication buffers are host memory (CommOptions::alloc on the GPU)");
  return Tensor::empty({t.numel()}, t.dtype(), alloc ? *alloc : fallback_host_allocator(), MemTag::comm);
}

// A posted message of a GPU tensor through the host buffer it keeps: a send's holds the
// tensor's copy from the start; a receive's is copied into `dst` once it has arrived.
class StagedTransfer final : public Communicator::Transfer {
 public:
  StagedTransfer(Tensor host, std::unique_ptr<Transfer> message, Tensor dst)
      : host_(std::move(host)), message_(std::move(message)), dst_(std::move(dst)) {}
  bool test() override {
    if (done_) return true;
    if (!message_->test()) return false;
    if (dst_.defined()) dst_.copy_from(host_);
    done_ = true;
    return true;
  }

 private:
  Tensor host_;  // declared before the message, so it outlives it
  std::unique_ptr<Transfer> message_;
  Tensor dst_;   // receives: the GPU tensor
  bool done_ = false;
};

}  // namespace

std::unique_ptr<Communicator::Transfer> Communicator::post_send(const Tensor& t, int peer, int tag) {
  MT_CHECK(peer >= 0 && peer < size_ && peer != rank_ && tag >= 0 && tag <= kMaxPostTag,
           "internal: posted send to rank " << peer << " of group '" << name_ << "' with tag " << tag);
  bytes_sent_ += t.nbytes();
  if (t.device() != Device::cuda) return start({{t.raw(), t.nbytes(), peer}}, {}, kPostedTag + tag);
  const Tensor h = posted_buffer(t, options().alloc);
  h.copy_from(t);  // after the kernels queued so far (core/cuda.h)
  return std::make_unique<StagedTransfer>(h, start({{h.raw(), t.nbytes(), peer}}, {}, kPostedTag + tag), Tensor());
}

std::unique_ptr<Communicator::Transfer> Communicator::post_recv(const Tensor& t, int peer, int tag) {
  MT_CHECK(peer >= 0 && peer < size_ && peer != rank_ && tag >= 0 && tag <= kMaxPostTag,
           "internal: posted receive from rank " << peer << " of group '" << name_ << "' with tag " << tag);
  if (t.device() != Device::cuda) return start({}, {{t.raw(), t.nbytes(), peer}}, kPostedTag + tag);
  const Tensor h = posted_buffer(t, options().alloc);
  return std::make_unique<StagedTransfer>(h, start({}, {{h.raw(), t.nbytes(), peer}}, kPostedTag + tag), t);
}

bool Communicator::Transfer::wait_for(double timeout_s) {
  const double t0 = now_seconds();
  int64_t us = 5;
  while (!test()) {
    const double waited = now_seconds() - t0;
    if (timeout_s > 0 && waited > timeout_s) return false;
    if (waited < 1e-4) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    us = std::min<int64_t>(2 * us, 200);
  }
  return true;
}

}  // namespace mt
