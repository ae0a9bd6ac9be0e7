// Device allocators that count live and peak bytes per tag, so the trainer can report
// where memory goes (params, grads, optimizer state, activations, communication buffers).
// Allocators are objects owned by whoever trains (no global allocator): tensors keep a
// pointer to the allocator that made their storage and give the bytes back to it.
// Thread-safe: the communication thread allocates staging buffers beside the trainer.
#pragma once
#include <array>
#include <cstddef>
#include <mutex>
#include <utility>
#include <string>

namespace mt {

enum class Device { cpu, cuda };
const char* device_name(Device d);

enum class MemTag { params, grads, optim, activations, comm, other };
constexpr int kNumMemTags = 6;
const char* memtag_name(MemTag t);  // "params", "grads", "optim", "activations", "comm", "other"

struct MemStats {
  std::array<size_t, kNumMemTags> live{};  // bytes allocated now, per tag
  std::array<size_t, kNumMemTags> peak{};  // highest live bytes seen, per tag
  size_t live_total = 0;
  size_t peak_total = 0;  // highest sum over tags seen at one moment
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  void* allocate(size_t bytes, MemTag tag);
  void deallocate(void* p, size_t bytes, MemTag tag);
  MemStats stats() const;  // a snapshot
  void reset_peaks();      // peaks := live
  // What a failed allocation's message tells the user to change (default: the training
  // keys that shrink memory); a command that allocates for something else says its own.
  void set_advice(std::string advice) { advice_ = std::move(advice); }
  const std::string& advice() const { return advice_; }

 protected:
  virtual void* raw_allocate(size_t bytes) = 0;
  virtual void raw_deallocate(void* p) = 0;

 private:
  mutable std::mutex mu_;
  MemStats stats_;
  std::string advice_ = "use a smaller model, micro_batch or seq_len, or training.recompute=true";
};

// Host memory, 64-byte aligned (AVX-512 lines). A tensor frees itself through the allocator
// that gave it, so the allocator must outlive its tensors: destroyed while any of them live,
// it says how many bytes of which tags and aborts (a later free would call into a destroyed
// object, which fails somewhere else or not at all).
class CpuAllocator final : public Allocator {
 public:
  ~CpuAllocator() override;
  Device device() const override { return Device::cpu; }

 protected:
  void* raw_allocate(size_t bytes) override;
  void raw_deallocate(void* p) override;
};

// The host allocator for communicators and groups made without one (tests): never
// destroyed, since a communicator kept until the program ends may still hold its buffers.
Allocator& fallback_host_allocator();

std::string format_bytes(size_t bytes);  // "12.3 MiB"

}  // namespace mt
