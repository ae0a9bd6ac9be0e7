// meshtrain plan: what a layout of a model needs and how fast it runs on a cluster, or,
// without --layout, every layout that fits ranked by predicted step time and the reason
// each rejected family fails (src/plan/).
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "plan/hardware.h"
#include "plan/memory.h"  // parameter_count
#include "plan/plan_svg.h"
#include "plan/search.h"
#include "plan/time.h"
#include "train/metrics.h"       // output_parent_create
#include "train/start_checks.h"  // output_paths_check

namespace mt {

void plan_options_add(CLI::App* cmd, PlanOptions* o) {
  cmd->add_option("--config", o->config, "training configuration (its [model], [optim] and batch)");
  cmd->add_option("--set", o->overrides, "section.key=value over the configuration (repeatable)");
  cmd->add_option("--gpus", o->gpus, "devices in the cluster")->required();
  cmd->add_option("--gpus-per-node", o->gpus_per_node, "devices per node")->capture_default_str();
  cmd->add_option("--hardware", o->hardware, "a100-40gb | a100-80gb | h100 | h200 | FILE.toml (meshtrain bench profile)")
      ->capture_default_str();
  // -1 is the marker for "not given": a given value below 1 is refused here, before it could read as that.
  const CLI::Validator at_least_1(
      [](std::string& v) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long x = std::strtoll(v.c_str(), &end, 10);
        if (end == v.c_str() || *end != '\0' || errno) return "";  // not a whole number: the conversion says so
        return x >= 1 ? "" : v + " sequences per step: give at least 1 (or leave it out: the configuration's "
                             "training.global_batch)";
      },
      "");
  cmd->add_option("--global-batch", o->global_batch, "sequences per step (default: the configuration's)")
      ->check(at_least_1);
  cmd->add_option("--layout", o->layout, "dp=..,tp=..,pp=..,cp=..,v=..,schedule=..,zero=..,shard_group=..,sp=..,"
                                         "recompute=..,mb=..,gb=..; fields left out are chosen");
  cmd->add_option("--precision", o->precision, "fp32 | bf16 | fp16 (default: the configuration's training.precision where it is not fp32, "
                  "else bf16 on GPUs, fp32 on CPUs)");
  cmd->add_option("--grad-dtype", o->grad_dtype,
                  "fp32 | the precision's 16-bit type: gradients kept in it, 2Ψ + 2Ψ + 12Ψ (default: the "
                  "configuration's training.grad_dtype where it is that type, else fp32)");
  cmd->add_option("--top", o->top, "layouts to list")->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->add_option("--svg", o->svg, "draw memory per rank for the top layouts and the chosen one's pipeline");
}

namespace {

// printf's text of one number, whole however long (a finite double has up to 309 digits).
std::string format(const char* fmt, double x) {
  std::vector<char> s(static_cast<size_t>(std::snprintf(nullptr, 0, fmt, x)) + 1);
  std::snprintf(s.data(), s.size(), fmt, x);
  return s.data();
}

std::string gib(double b) { return format("%.2f GiB", b / (1024.0 * 1024 * 1024)); }

std::string seconds(double s) {
  return s >= 1 ? format("%.2f s", s) : s >= 1e-3 ? format("%.1f ms", 1e3 * s) : format("%.0f us", 1e6 * s);
}

std::string gb(double b) { return b >= 1e9 ? format("%.1f GB", b / 1e9) : format("%.1f MB", b / 1e6); }

void print_breakdown(const plan::Prediction& p, const plan::Question& q) {
  const plan::Memory& m = p.memory;
  const plan::Timing& t = p.time;
  std::printf("layout %s\n", p.layout.text().c_str());
  std::printf("  memory per GPU: params %s, grads %s, optimizer %s, activations %s, buffers %s, fp32 staging %s; "
              "peak %s of %s%s\n",
              gib(m.params).c_str(), gib(m.grads).c_str(), gib(m.optim).c_str(), gib(m.activations).c_str(),
              gib(m.comm).c_str(), gib(m.other).c_str(), gib(m.peak).c_str(), gib(q.cluster.hw.mem_bytes).c_str(),
              p.fits ? "" : ": does not fit");
  std::printf("  bytes per step and GPU: dp %s, tp %s, pp %s, cp %s\n", gb(p.comm.dp).c_str(), gb(p.comm.tp).c_str(),
              gb(p.comm.pp).c_str(), gb(p.comm.cp).c_str());
  std::printf("  time on the links: dp %s, tp %s, pp %s, cp %s; not hidden behind compute %s\n",
              seconds(t.comm_s.dp).c_str(), seconds(t.comm_s.tp).c_str(), seconds(t.comm_s.pp).c_str(),
              seconds(t.comm_s.cp).c_str(), seconds(t.exposed_comm_s).c_str());
  std::printf("  compute %s, bubble %.1f%%: step %s, %.0f tokens/s (%.0f per GPU), MFU %.1f%%\n",
              seconds(t.compute_s).c_str(), 100 * t.bubble, seconds(t.step_s).c_str(), t.tokens_per_s,
              t.tokens_per_s / q.cluster.gpus, 100 * t.mfu);
}

}  // namespace

int cmd_plan(const PlanOptions& o) {
  MT_CHECK(o.gpus >= 1, "--gpus " << o.gpus << ": give the cluster's devices, at least 1");
  MT_CHECK(o.gpus_per_node >= 1, "--gpus-per-node " << o.gpus_per_node << ": give the devices of one node, at least 1");
  for (const std::string& s : o.overrides)  // config_load's advice is train's --section.key=value
    MT_CHECK(s.find('=') != std::string::npos,
             "--set " << s << " has no value: write --set section.key=value, e.g. --set " << s << "=VALUE");
  // A partial last node: the planner places the groups as if every node were whole, so say so.
  const int64_t per = o.gpus_per_node, whole = o.gpus / per * per;
  const std::string partial_node =
      o.gpus > per && o.gpus % per != 0
          ? "note: --gpus " + std::to_string(o.gpus) + " is not a whole number of nodes of --gpus-per-node " +
                std::to_string(per) + " (" + std::to_string(o.gpus / per) + " nodes and " +
                std::to_string(o.gpus % per) + " devices on another): the planner places the groups as if every " +
                "node held " + std::to_string(per) + "; give --gpus " + std::to_string(whole) + " or " +
                std::to_string(whole + per) + " for whole nodes"
          : "";
  if (!partial_node.empty() && o.json) std::fprintf(stderr, "%s\n", partial_node.c_str());  // the JSON alone on stdout
  MT_CHECK(o.top >= 1, "--top " << o.top << ": give the number of layouts to list, at least 1");
  MT_CHECK(o.precision.empty() || o.precision == "fp32" || o.precision == "bf16" || o.precision == "fp16",
           "--precision " << o.precision << ": use fp32, bf16 or fp16");
  plan::Question q;
  q.cluster.gpus = o.gpus;
  q.cluster.gpus_per_node = std::min(o.gpus_per_node, o.gpus);
  q.cluster.hw = plan::hardware_get(o.hardware);
  q.config = config_read(o.config, o.overrides);
  const std::string configured = q.config.model.precision;
  const std::string precision = !o.precision.empty()   ? o.precision
                                : configured != "fp32" ? configured
                                                       : (q.cluster.hw.gpu ? "bf16" : "fp32");
  std::string grad = o.grad_dtype;
  if (grad.empty()) grad = q.config.model.grad_dtype == precision ? precision : "fp32";
  MT_CHECK(grad == "fp32" || grad == precision, "--grad-dtype " << grad << " with precision " << precision
                                                   << ": gradients are kept in fp32 or in the working precision ("
                                                   << (precision == "fp32" ? "fp32 here" : precision) << ")");
  // The precisions planned are the configuration's before it is checked. With neither option
  // given, a configuration planned in its own precision keeps its own grad_dtype: a pair the
  // engine refuses is refused by its keys.
  if (!o.precision.empty() || !o.grad_dtype.empty() || configured == "fp32") {
    config_set(q.config, "training.precision", precision);
    config_set(q.config, "training.grad_dtype", grad);
  }
  q.config.validate();
  std::error_code ec;  // --svg must not replace the files the plan reads (a built-in --hardware is none)
  const std::string hw_file = std::filesystem::is_regular_file(o.hardware, ec) ? o.hardware : "";
  output_paths_check({{"--svg", o.svg, ""}}, {{"--config", o.config, ""}, {"--hardware", hw_file, ""}});
  if (!o.svg.empty()) output_try(o.svg, "--svg");  // a directory or an unwritable place, named before the search
  q.precision = plan::Precisions::trained(precision, grad != "fp32");
  q.global_batch = o.global_batch > 0 ? o.global_batch : q.config.training.global_batch;
  plan::Layout base;
  base.global_batch = q.global_batch;
  if (!o.layout.empty()) base = plan::layout_parse(o.layout, base);
  if (base.named.count("gb")) {  // the layout's batch is the question's
    MT_CHECK(o.global_batch <= 0 || o.global_batch == base.global_batch,
             "--layout gb=" << base.global_batch << " and --global-batch " << o.global_batch << " differ; give one");
    q.global_batch = base.global_batch;
  }

  const plan::SearchResult r = plan::search(q, base);
  const double params = plan::parameter_count(q.config.model);
  nlohmann::json out;
  if (!o.json) {
    std::printf("meshtrain plan: %s %d layers x %d (%.2fB parameters), %d x %s (%d per node), global batch %lld x %d "
                "tokens, %s%s\n",
                q.config.model.family.c_str(), q.config.model.n_layer, q.config.model.d_model, params / 1e9, o.gpus,
                q.cluster.hw.name.c_str(), q.cluster.gpus_per_node, static_cast<long long>(q.global_batch),
                q.config.model.seq_len, q.precision.name.c_str(),
                q.precision.grad == 2                            ? (" with " + precision + " gradients").c_str()
                : q.config.parallel.grad_comm_dtype != "fp32" ? (", fp32 gradients reduced in " +
                                                                  q.config.parallel.grad_comm_dtype).c_str()
                                                               : "");
    if (!partial_node.empty()) std::printf("%s\n", partial_node.c_str());
    if (!q.config.parallel.pp_layers.empty() && q.config.parallel.pp_layers != "auto")
      std::printf("pipeline stages of %s blocks (parallel.pp_layers)\n", q.config.parallel.pp_layers.c_str());
    std::printf("%d layouts weighed, %zu fit\n", r.tried, r.ranked.size());
  }
  if (r.ranked.empty()) {
    if (!o.layout.empty()) {
      // A layout the engine refuses: its own reason. One that runs but fits nowhere: its
      // breakdown (the completion needing the least memory), and the exit status 1.
      const plan::Layout closest = plan::search_closest(q, base);
      if (auto problem = plan::layout_problem(q, closest)) MT_FAIL("--layout " << o.layout << ": " << *problem);
      const plan::Prediction p = plan::predict(q, closest);
      if (o.json) std::printf("%s\n", nlohmann::json{{"layouts", {plan::prediction_json(p)}}}.dump(1).c_str());
      else print_breakdown(p, q);
      std::fprintf(stderr, "meshtrain: error: --layout %s does not fit: %s; name fewer fields, shard more (zero=3, "
                   "tp, pp), recompute=full or a smaller mb\n", o.layout.c_str(), p.why_not.c_str());
      return 1;
    }
    // Nothing runs: say what each family lacks.
    std::string why;
    bool memory = false;  // some family runs but needs more memory than the device has
    for (const plan::Rejected& x : r.rejected) {
      why += "\n  " + x.family + ": " + x.reason;
      memory = memory || x.reason.rfind("does not fit", 0) == 0;
    }
    MT_FAIL("no layout of this model fits " << o.gpus << " x " << q.cluster.hw.name << ":" << why << "\n"
                                            << (memory ? "use more GPUs, a device with more memory, or a smaller model"
                                                       : "no layout runs at all: change --gpus or --global-batch as "
                                                         "the reasons above say"));
  }
  if (o.json) {
    out["layouts"] = nlohmann::json::array();
    const size_t n = o.layout.empty() ? std::min<size_t>(o.top, r.ranked.size()) : 1;
    for (size_t i = 0; i < n; ++i) out["layouts"].push_back(plan::prediction_json(r.ranked[i]));
    out["rejected"] = nlohmann::json::array();
    for (const plan::Rejected& x : r.rejected)
      out["rejected"].push_back({{"family", x.family}, {"reason", x.reason}, {"layouts", x.layouts}});
    std::printf("%s\n", out.dump(1).c_str());
  } else if (!o.layout.empty()) {
    print_breakdown(r.ranked.front(), q);
  } else {
    std::printf("%4s  %-80s %10s %9s %12s %6s %7s\n", "rank", "layout", "peak", "step", "tokens/s", "MFU", "bubble");
    for (size_t i = 0; i < r.ranked.size() && i < static_cast<size_t>(o.top); ++i) {
      const plan::Prediction& p = r.ranked[i];
      std::printf("%4zu  %-80s %10s %9s %12.0f %5.1f%% %6.1f%%\n", i + 1, p.layout.text().c_str(),
                  gib(p.memory.peak).c_str(), seconds(p.time.step_s).c_str(), p.time.tokens_per_s, 100 * p.time.mfu,
                  100 * p.time.bubble);
    }
    std::printf("best:\n");
    print_breakdown(r.ranked.front(), q);
    if (!r.rejected.empty()) {
      std::printf("rejected families (tp, pp, cp with no layout that fits):\n");
      for (const plan::Rejected& x : r.rejected)
        std::printf("  %s (%d layouts): %s\n", x.family.c_str(), x.layouts, x.reason.c_str());
    }
  }
  if (!o.svg.empty()) {
    output_parent_create(o.svg, "--svg");
    std::ofstream f(o.svg);
    const size_t n = std::min<size_t>(o.layout.empty() ? o.top : 1, r.ranked.size());
    const plan::Prediction& chosen = r.ranked.front();
    std::optional<Simulation> timeline;
    if (chosen.layout.pp > 1)
      timeline = plan::pipeline_simulation(q.config.model, chosen.layout, q.cluster, q.precision, plan::traffic(q.config));
    f << plan::plan_svg(q, std::vector<plan::Prediction>(r.ranked.begin(), r.ranked.begin() + n),
                        timeline ? &*timeline : nullptr);
    MT_CHECK(f.good(), "--svg " << o.svg << ": could not write it");
    if (!o.json) std::printf("drew %s\n", o.svg.c_str());
  }
  return 0;
}

}  // namespace mt
