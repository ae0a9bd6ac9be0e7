#include "train/stop.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <vector>

namespace mt {

namespace {

// Only lock-free atomics may be touched in a signal handler.
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free);
std::atomic<int> g_signal{0};
std::atomic<bool> g_notes{false};

constexpr char kNote[] =
    "meshtrain: already stopping after the current step (and its checkpoint); this signal is ignored\n";

void on_stop_signal(int sig) {
  int none = 0;
  if (g_signal.compare_exchange_strong(none, sig)) return;
  if (g_notes.load()) {
    const ssize_t unused = write(STDERR_FILENO, kNote, sizeof kNote - 1);  // write(2) is async-signal-safe
    (void)unused;
  }
}

}  // namespace

void stop_signals_install() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // file and MPI calls interrupted by a signal carry on
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGUSR1}) sigaction(sig, &sa, nullptr);
}

void stop_notes_enable() { g_notes = true; }

int stop_signal() { return g_signal.load(); }

std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return "signal " + std::to_string(sig);
  }
}

StepAgreement agree_step(Communicator& world, const MemStats& mine, int stop_signal) {
  const int n = kNumMemTags + 2;
  std::vector<double> local(n), all(n * world.size());
  for (int i = 0; i < kNumMemTags; ++i) local[i] = static_cast<double>(mine.peak[i]);
  local[kNumMemTags] = static_cast<double>(mine.peak_total);
  local[kNumMemTags + 1] = stop_signal;
  world.allgather(Tensor::wrap(local.data(), {n}, DType::f64), Tensor::wrap(all.data(), {n * world.size()}, DType::f64));
  StepAgreement r;
  for (int k = 0; k < world.size(); ++k) {
    for (int i = 0; i < kNumMemTags; ++i) r.peaks.peak[i] = std::max(r.peaks.peak[i], static_cast<size_t>(all[k * n + i]));
    r.peaks.peak_total = std::max(r.peaks.peak_total, static_cast<size_t>(all[k * n + kNumMemTags]));
    if (all[k * n + kNumMemTags + 1] == 0) continue;
    if (r.stop_ranks++ == 0) {
      r.stop_signal = static_cast<int>(all[k * n + kNumMemTags + 1]);
      r.stop_rank = k;
    }
  }
  return r;
}

}  // namespace mt
