#include "core/allocator.h"

#include <cstdio>
#include <cstdlib>
#include <new>

#include "core/error.h"

namespace mt {

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

const char* memtag_name(MemTag t) {
  static const char* names[kNumMemTags] = {"params", "grads", "optim", "activations", "comm", "other"};
  return names[static_cast<int>(t)];
}

void* Allocator::allocate(size_t bytes, MemTag tag) {
  void* p = bytes ? raw_allocate(bytes) : nullptr;
  MT_CHECK(p || !bytes, "out of " << device_name(device()) << " memory allocating " << format_bytes(bytes)
                                   << " for " << memtag_name(tag) << "; " << advice_);
  std::lock_guard<std::mutex> lock(mu_);
  int i = static_cast<int>(tag);
  stats_.live[i] += bytes;
  stats_.live_total += bytes;
  if (stats_.live[i] > stats_.peak[i]) stats_.peak[i] = stats_.live[i];
  if (stats_.live_total > stats_.peak_total) stats_.peak_total = stats_.live_total;
  return p;
}

void Allocator::deallocate(void* p, size_t bytes, MemTag tag) {
  if (!p) return;
  raw_deallocate(p);
  std::lock_guard<std::mutex> lock(mu_);
  int i = static_cast<int>(tag);
  stats_.live[i] -= bytes;
  stats_.live_total -= bytes;
}

MemStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Allocator::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.live;
  stats_.peak_total = stats_.live_total;
}

void* CpuAllocator::raw_allocate(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  return std::aligned_alloc(64, rounded);
}

void CpuAllocator::raw_deallocate(void* p) { std::free(p); }

CpuAllocator::~CpuAllocator() {
  const MemStats s = stats();
  if (s.live_total == 0) return;
  std::string tags;
  for (int i = 0; i < kNumMemTags; ++i)
    if (s.live[i] > 0)
      tags += (tags.empty() ? "" : ", ") + format_bytes(s.live[i]) + " " + memtag_name(static_cast<MemTag>(i));
  std::fflush(stdout);
  std::fprintf(stderr,
               "meshtrain: internal error: a host allocator is destroyed while %s of the tensors it gave live (%s); "
               "declare the allocator before the tensors it gives\n",
               format_bytes(s.live_total).c_str(), tags.c_str());
  std::abort();
}

Allocator& fallback_host_allocator() {
  static CpuAllocator* alloc = new CpuAllocator;
  return *alloc;
}

std::string format_bytes(size_t bytes) {
  char buf[32];
  double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

}  // namespace mt
