#include "train/plan_report.h"

#include <cstdio>

#include "plan/comm.h"
#include "plan/hardware.h"
#include "plan/memory.h"
#include "plan/search.h"  // traffic, knobs
#include "plan/time.h"

namespace mt {

plan::Layout run_layout(const Config& c) {
  plan::Layout l;
  l.dp = c.parallel.dp, l.tp = c.parallel.tp, l.pp = c.parallel.pp, l.cp = c.parallel.cp;
  l.chunks = c.parallel.pp > 1 ? c.parallel.pp_chunks : 1;
  l.schedule = c.parallel.pp_schedule;
  l.zero = c.parallel.zero;
  l.shard_group = c.parallel.shard_group;
  l.sequence_parallel = c.parallel.sequence_parallel && c.parallel.tp > 1;
  l.recompute = plan::recompute_text(c.training.recomputed());
  l.micro_batch = c.training.micro_batch;
  l.global_batch = c.training.global_batch;
  return l;
}

namespace {

std::string mib(double b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MiB", b / (1024.0 * 1024));
  return s;
}

}  // namespace

nlohmann::json plan_report(const Config& c, int world_size, const PlanMeasured& m, std::vector<std::string>* lines) {
  nlohmann::json j = nlohmann::json::object();
  if (c.parallel.pp_schedule.rfind("file:", 0) == 0) {  // the planner knows the built-in schedules only
    lines->push_back("planner: no prediction for a schedule read from a file");
    return j;
  }
  const plan::Layout l = run_layout(c);
  const plan::Precisions prec = plan::Precisions::trained(c.model.precision, c.model.grad_working());
  const plan::Memory pm = plan::memory_per_rank(c.model, l, prec, c.optim.name, plan::knobs(c));
  const plan::CommBytes pc = plan::comm_bytes_rank(c.model, l, prec, /*pp_rank=*/0, plan::traffic(c));  // rank 0's, as measured
  const double predicted[] = {pm.params, pm.grads, pm.optim, pm.activations, pm.comm, pm.other};
  const MemTag tags[] = {MemTag::params, MemTag::grads,  MemTag::optim,
                         MemTag::activations, MemTag::comm, MemTag::other};
  // A run resumed at its last step trains none: nothing measured (null), not zero bytes.
  const bool ran = m.mem.peak_total > 0;
  const auto measured_json = [&](double v) { return ran ? nlohmann::json(v) : nlohmann::json(nullptr); };
  const auto measured_text = [&](double v) { return ran ? mib(v) : std::string("-"); };
  std::string mem = "planner, memory per tag (predicted / measured):";
  for (int i = 0; i < 6; ++i) {
    const double measured = static_cast<double>(m.mem.peak[int(tags[i])]);
    j[std::string("plan_mem_") + memtag_name(tags[i])] = predicted[i];
    j[std::string("mem_steps_") + memtag_name(tags[i])] = measured_json(measured);
    if (tags[i] == MemTag::other && predicted[i] == 0 && measured == 0) continue;  // fp32 stages nothing
    mem += std::string(i ? "," : "") + " " + memtag_name(tags[i]) + " " + mib(predicted[i]) + " / " +
           measured_text(measured);
  }
  lines->push_back(mem);
  const double axes[] = {pc.dp, pc.tp, pc.pp, pc.cp};
  const char* names[] = {"dp", "tp", "pp", "cp"};
  std::string comm = "planner, bytes per step (predicted / measured):";
  for (int i = 0; i < 4; ++i) {
    j[std::string("plan_comm_bytes_") + names[i]] = axes[i];
    j[std::string("comm_bytes_") + names[i] + "_step"] = measured_json(m.comm_bytes[i]);
    comm += std::string(i ? "," : "") + " " + names[i] + " " + mib(axes[i]) + " / " + measured_text(m.comm_bytes[i]);
  }
  lines->push_back(comm);
  if (!ran) lines->push_back("planner: no step ran, so nothing was measured");
  j["plan_step_s"] = nullptr;
  if (c.logging.hardware.empty()) {
    lines->push_back("planner, step time: set logging.hardware=FILE (from meshtrain bench profile) to predict it");
    return j;
  }
  plan::Cluster cluster;
  cluster.gpus = world_size;
  cluster.gpus_per_node = world_size;  // one machine
  cluster.hw = plan::hardware_get(c.logging.hardware);
  const plan::Timing t = plan::step_time(c.model, l, cluster, prec, plan::traffic(c));
  j["plan_step_s"] = t.step_s;
  char buf[200], measured[64] = "no step timed";
  if (m.step_s > 0)
    std::snprintf(measured, sizeof measured, "%.1f ms measured (%+.0f%%)", 1e3 * m.step_s, 100 * (t.step_s / m.step_s - 1));
  std::snprintf(buf, sizeof buf, "planner, step time with %s: %.1f ms predicted (compute %.1f ms, bubble %.1f%%), %s",
                c.logging.hardware.c_str(), 1e3 * t.step_s, 1e3 * t.compute_s, 100 * t.bubble, measured);
  lines->push_back(buf);
  return j;
}

}  // namespace mt
