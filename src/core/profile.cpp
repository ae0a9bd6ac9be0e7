#include "core/profile.h"

#include <chrono>

#include "core/error.h"

namespace mt {

namespace {
thread_local Profiler* t_profiler = nullptr;  // the profiler this thread records into, or null
}  // namespace

Profiler* profile_active() { return t_profiler; }

double profile_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Profiler::Profiler(double origin, int64_t max_event_steps, size_t max_events)
    : origin_(origin), max_event_steps_(max_event_steps), max_events_(max_events) {}

Profiler::~Profiler() {
  if (t_profiler == this) t_profiler = nullptr;  // a step left by an exception
}

void Profiler::step_begin() {
  MT_CHECK(t_profiler == nullptr, "internal: a profiler step begins inside another");
  stack_.clear();  // a step left by an exception may have left scopes behind
  t_profiler = this;
  step_start_ = profile_now();
}

void Profiler::step_end() {
  step_s_ += profile_now() - step_start_;
  ++steps_;
  t_profiler = nullptr;
}

int Profiler::intern(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, added] = ids_.emplace(name, static_cast<int>(names_.size()));
  if (added) names_.push_back(name);
  return it->second;
}

void Profiler::push(const char* literal) {
  auto it = literals_.find(literal);
  if (it == literals_.end()) it = literals_.emplace(literal, intern(literal)).first;
  push_id(it->second);
}

void Profiler::push_id(int id) { stack_.push_back({id, profile_now(), 0.0}); }

void Profiler::pop() {
  const double end = profile_now();
  const Open o = stack_.back();
  stack_.pop_back();
  const double total = end - o.start;
  if (static_cast<size_t>(o.id) >= stats_.size()) stats_.resize(o.id + 1);
  Stat& s = stats_[o.id];
  ++s.calls;
  s.total_s += total;
  s.self_s += total - o.children;
  // A name nested in itself (a scope inside a scope of the same name) counts its inner
  // time once in total as well: only the outermost adds to total.
  for (const Open& up : stack_)
    if (up.id == o.id) {
      s.total_s -= total;
      break;
    }
  if (!stack_.empty()) stack_.back().children += total;
  if (keep_event(events_.size())) events_.push_back({o.id, 0, o.start - origin_, end - origin_});
}

int Profiler::lane(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = 0; k < lanes_.size(); ++k)
    if (lanes_[k] == name) return static_cast<int>(k + 1);
  lanes_.push_back(name);
  return static_cast<int>(lanes_.size());
}

std::vector<std::string> Profiler::lanes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lanes_;
}

void Profiler::record_async(int id, int lane, double start, double end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<size_t>(id) >= async_.size()) async_.resize(id + 1);
  Stat& s = async_[id];
  ++s.calls;
  s.self_s += end - start;
  s.total_s += end - start;
  if (keep_event(async_events_.size())) async_events_.push_back({id, lane, start - origin_, end - origin_});
}

std::vector<Profiler::Row> Profiler::rows() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Row> r;
  for (size_t i = 0; i < stats_.size(); ++i)
    if (stats_[i].calls) r.push_back({names_[i], stats_[i].calls, stats_[i].self_s, stats_[i].total_s});
  return r;
}

std::vector<Profiler::Event> Profiler::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Event> r = events_;
  r.insert(r.end(), async_events_.begin(), async_events_.end());
  return r;
}

std::vector<std::string> Profiler::names() const {
  std::lock_guard<std::mutex> lock(mu_);
  return names_;
}

std::vector<Profiler::Row> Profiler::async_rows() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Row> r;
  for (size_t i = 0; i < async_.size(); ++i)
    if (async_[i].calls) r.push_back({names_[i], async_[i].calls, async_[i].self_s, async_[i].total_s});
  return r;
}

}  // namespace mt
