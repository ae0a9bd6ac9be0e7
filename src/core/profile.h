// The op profiler: where a training step's time goes, per named scope.
//
//   Profiler prof(origin);          // one per run (logging.profile = true)
//   prof.step_begin();              // this thread records from here ...
//   { ProfileScope s("linear"); ... }   // anywhere below: an RAII scope
//   prof.step_end();                // ... to here
//
// A scope costs one branch on a thread-local pointer when nothing records (profiling off,
// or between steps), and two clock reads and a lookup when it does. Only the thread that
// called step_begin() records (the thread that runs the model; OpenMP workers do not).
//
// Scopes nest. Each name gets its calls, its inclusive time (total) and its exclusive time
// (self: total minus the scopes opened inside it), so self times add up: over all names,
// self + the time inside steps but outside any scope ("other") = the steps' time.
//
// The communication threads' side: record_async() adds an operation that ran on another
// thread (a collective on a group's communication thread) as an overlapping row, kept
// apart from the step's sum (it runs beside the compute).
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace mt {

class Profiler {
 public:
  struct Row {
    std::string name;
    int64_t calls = 0;
    double self_s = 0, total_s = 0;
  };
  // A timed scope for the trace, in seconds since the origin. thread: 0 for the recording
  // thread, k > 0 for the async lane of record_async(lane = k).
  struct Event {
    int name = 0;   // index into names()
    int thread = 0;
    double start = 0, end = 0;
  };

  // origin: the time (steady clock, seconds, as profile_now()) that event times count
  // from. Events are kept for the first max_event_steps steps, at most max_events of the
  // recording thread and as many of the async lanes.
  explicit Profiler(double origin, int64_t max_event_steps = 0, size_t max_events = 1 << 20);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void step_begin();  // this thread records until step_end()
  void step_end();
  int64_t steps() const { return steps_; }
  double step_seconds() const { return step_s_; }  // sum of the steps' durations

  // The id of a name (made on first use); thread-safe.
  int intern(const std::string& name);
  // Scopes on the recording thread (ProfileScope calls these).
  void push(const char* literal);  // a string literal, looked up by address
  void push_id(int id);
  void pop();
  // A lane of the trace for another thread's operations (> 0; made on first use), and an
  // operation that ran there from start to end (profile_now() clock). Thread-safe.
  int lane(const std::string& name);
  void record_async(int id, int lane, double start, double end);

  // Per name, the recording thread's scopes (self and total) and the async rows (self =
  // total), by name. Call when nothing records.
  std::vector<Row> rows() const;
  std::vector<Row> async_rows() const;
  std::vector<Event> events() const;  // the recording thread's, then the async lanes'
  std::vector<std::string> names() const;
  std::vector<std::string> lanes() const;  // lane k's name at k - 1
  double origin() const { return origin_; }

 private:
  struct Stat {
    int64_t calls = 0;
    double self_s = 0, total_s = 0;
  };
  struct Open {
    int id;
    double start, children;
  };
  // Whether to keep one more event in a list of n (each list has its own cap).
  bool keep_event(size_t n) const { return steps_ < max_event_steps_ && n < max_events_; }

  double origin_;
  int64_t max_event_steps_;
  size_t max_events_;
  std::atomic<int64_t> steps_{0};
  double step_s_ = 0, step_start_ = 0;
  std::vector<Open> stack_;
  std::vector<Stat> stats_, async_;                // by id
  std::unordered_map<const char*, int> literals_;  // string literal -> id
  std::vector<Event> events_;
  mutable std::mutex mu_;  // names and the async side (written from communication threads):
  std::vector<Event> async_events_;
  std::vector<std::string> names_, lanes_;
  std::unordered_map<std::string, int> ids_;
};

// The steady clock in seconds (the same clock as comm's now_seconds()).
double profile_now();

// The profiler recording on this thread right now (inside a step), or null. Not inline: the
// thread-local it reads stays in profile.cpp (read from other files, GCC's UBSan checked its
// address with flags the linker's TLS rewrite had changed, and reported a null pointer).
Profiler* profile_active();

class ProfileScope {
 public:
  explicit ProfileScope(const char* literal) : p_(profile_active()) {
    if (p_) p_->push(literal);
  }
  // id from p->intern(), when p is the active profiler (else nothing is recorded)
  ProfileScope(Profiler* p, int id) : p_(p && p == profile_active() ? p : nullptr) {
    if (p_) p_->push_id(id);
  }
  ~ProfileScope() {
    if (p_) p_->pop();
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* p_;
};

}  // namespace mt
