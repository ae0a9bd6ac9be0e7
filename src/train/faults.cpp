#include "train/faults.h"

#include <chrono>
#include <csignal>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace mt {

bool injected(const std::string& spec, const std::string& kind, int64_t step, int rank) {
  if (spec.rfind(kind + ":", 0) != 0) return false;
  std::istringstream in(spec.substr(kind.size() + 1));
  std::string r, steps, one;
  std::getline(in, r, ':');
  std::getline(in, steps);
  MT_CHECK(!r.empty() && !steps.empty(), "parallel.test_fault = \"" << spec << "\": write " << kind << ":RANK:STEP,STEP...");
  if (std::stoi(r) != rank) return false;
  std::istringstream list(steps);
  while (std::getline(list, one, ','))
    if (std::stoll(one) == step) return true;
  return false;
}

namespace {

bool numeric_fault(const std::string& spec) {
  return spec.rfind("overflow:", 0) == 0 || spec.rfind("spike:", 0) == 0 || spec.rfind("nan:", 0) == 0;
}

bool whole_number(const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; }

}  // namespace

void fault_spec_check(const std::string& spec) {
  if (spec.empty()) return;
  const size_t colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const bool numeric = numeric_fault(spec);
  MT_CHECK(numeric || kind == "die" || kind == "hang" || kind == "throw" || kind == "mismatch" ||
               kind == "slow_save",
           "parallel.test_fault = \"" << spec << "\": the kind is die, hang, throw, mismatch, slow_save (KIND:RANK), "
                                      "overflow, spike or nan (KIND:RANK:STEP,STEP...)");
  const std::string rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
  const size_t second = rest.find(':');
  bool ok = whole_number(rest.substr(0, second)) && (numeric == (second != std::string::npos));
  if (ok && numeric) {
    std::istringstream list(rest.substr(second + 1));
    std::string one;
    int steps = 0;
    while (std::getline(list, one, ',')) ok = ok && whole_number(one), ++steps;
    ok = ok && steps > 0;
  }
  MT_CHECK(ok, "parallel.test_fault = \"" << spec << "\": write " << kind
                                          << (numeric ? ":RANK:STEP,STEP... (whole numbers)"
                                                      : ":RANK (a whole number)"));
}

void inject_fault(const std::string& spec, int64_t step, Communicator& world, Communicator& dp) {
  if (spec.empty() || step != 1 || numeric_fault(spec)) return;
  const size_t colon = spec.find(':');
  MT_CHECK(colon != std::string::npos, "parallel.test_fault = \"" << spec << "\": write kind:rank, e.g. die:1");
  const std::string kind = spec.substr(0, colon);
  if (std::stoi(spec.substr(colon + 1)) != world.rank()) return;
  if (kind == "die") std::raise(SIGKILL);
  if (kind == "hang") std::this_thread::sleep_for(std::chrono::hours(24));
  if (kind == "throw") MT_FAIL("injected failure (parallel.test_fault = " << spec << ")");
  if (kind == "mismatch") {  // a collective the other ranks do not issue
    float extra[3] = {0, 0, 0};
    dp.allreduce(Tensor::wrap(extra, {3}, DType::f32));
    return;
  }
  if (kind == "slow_save") return;  // checkpoint_save pauses on that rank
  MT_FAIL("parallel.test_fault kind \"" << kind << "\" is not die, hang, throw, mismatch, slow_save, overflow, spike "
          "or nan");
}

}  // namespace mt
