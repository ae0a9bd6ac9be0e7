#include "train/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <toml++/toml.h>

#include "core/cuda.h"
#include "core/error.h"
#include "core/message.h"
#include "nn/tp.h"
#include "parallel/pipeline.h"
#include "parallel/schedule.h"
#include "train/faults.h"

namespace mt {

namespace {

// One configuration key: how to set it from text and read it back as JSON.
struct Key {
  std::string name;
  std::string accepts;  // for messages: "an integer", "true or false", "gpt2 | llama"
  std::function<void(Config&, const std::string&)> set;
  std::function<nlohmann::json(const Config&)> get;
};

[[noreturn]] void bad_value(const std::string& key, const std::string& v, const std::string& accepts) {
  MT_FAIL("bad value \"" << v << "\" for " << key << ": expected " << accepts);
}

// An integer that fits T: a value outside T's range is refused with the range, not wrapped
// (a static_cast would turn 4294967297 layers into 1).
template <class T>
T parse_int(const std::string& key, const std::string& v) {
  const char* b = v.data();
  const char* e = b + v.size();
  if (b != e && *b == '+' && (b + 1 == e || b[1] != '-')) ++b;  // "+5"; "+-5" stays no integer
  T x{};
  auto [p, ec] = std::from_chars(b, e, x);
  const bool digits = b != e && std::all_of(b + (*b == '-'), e, [](char ch) { return ch >= '0' && ch <= '9'; }) &&
                      e - b > (*b == '-');
  // from_chars reads "-5" as no number at all for an unsigned T: that too is out of range.
  if (digits && (ec == std::errc::result_out_of_range || (std::is_unsigned_v<T> && *b == '-' && ec != std::errc())))
    MT_FAIL("value " << v << " for " << key << " is out of range: it must be an integer from "
                     << +std::numeric_limits<T>::min() << " to " << +std::numeric_limits<T>::max());
  if (ec != std::errc() || p != e) bad_value(key, v, "an integer");
  return x;
}

// A finite number that fits T: nan and inf are refused for every number key (none of them
// means anything by them), and so is a double too large for a float key.
template <class T>
T parse_double(const std::string& key, const std::string& v) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end) bad_value(key, v, "a number");
  if (!std::isfinite(x) || std::fabs(x) > std::numeric_limits<T>::max()) {  // inf, nan, or too large for T
    char most[32];
    std::snprintf(most, sizeof most, "%g", static_cast<double>(std::numeric_limits<T>::max()));
    bad_value(key, v, std::string("a finite number (at most ") + most + " in magnitude)");
  }
  return static_cast<T>(x);
}

bool parse_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  bad_value(key, v, "true or false");
}

template <class T, class Sec>
Key int_key(const std::string& name, Sec Config::*sec, T Sec::*field) {
  return {name, "an integer",
          [=](Config& c, const std::string& v) { (c.*sec).*field = parse_int<T>(name, v); },
          [=](const Config& c) { return nlohmann::json((c.*sec).*field); }};
}
// A key's value for the JSON and messages: a float key's as written (float_as_written).
double as_written(double v) { return v; }
double as_written(float v) { return float_as_written(v); }

template <class T, class Sec>
Key num_key(const std::string& name, Sec Config::*sec, T Sec::*field) {
  return {name, "a number",
          [=](Config& c, const std::string& v) { (c.*sec).*field = parse_double<T>(name, v); },
          [=](const Config& c) { return nlohmann::json(as_written((c.*sec).*field)); }};
}
template <class Sec>
Key bool_key(const std::string& name, Sec Config::*sec, bool Sec::*field) {
  return {name, "true or false", [=](Config& c, const std::string& v) { (c.*sec).*field = parse_bool(name, v); },
          [=](const Config& c) { return nlohmann::json((c.*sec).*field); }};
}
template <class Sec>
Key str_key(const std::string& name, Sec Config::*sec, std::string Sec::*field, std::vector<std::string> allowed = {}) {
  std::string accepts = "a string";
  if (!allowed.empty()) {
    accepts = "one of";
    for (const auto& a : allowed) accepts += " " + (a.empty() ? std::string("\"\" (unset)") : a);
  }
  return {name, accepts,
          [=](Config& c, const std::string& v) {
            if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), v) == allowed.end())
              bad_value(name, v, accepts);
            (c.*sec).*field = v;
          },
          [=](const Config& c) { return nlohmann::json((c.*sec).*field); }};
}

const std::vector<Key>& keys() {
  static const std::vector<Key> k = [] {
    using C = Config;
    std::vector<Key> v;
    v.push_back(str_key("model.family", &C::model, &ModelConfig::family, {"gpt2", "llama"}));
    v.push_back(int_key("model.n_layer", &C::model, &ModelConfig::n_layer));
    v.push_back(int_key("model.n_head", &C::model, &ModelConfig::n_head));
    v.push_back(int_key("model.n_kv_head", &C::model, &ModelConfig::n_kv_head));
    v.push_back(int_key("model.d_model", &C::model, &ModelConfig::d_model));
    v.push_back(int_key("model.d_ff", &C::model, &ModelConfig::d_ff));
    v.push_back(int_key("model.vocab_size", &C::model, &ModelConfig::vocab_size));
    v.push_back(int_key("model.seq_len", &C::model, &ModelConfig::seq_len));
    v.push_back({"model.tie_embeddings", "true or false",
                 [](Config& c, const std::string& s) { c.model.tie_embeddings = parse_bool("model.tie_embeddings", s); },
                 [](const Config& c) { return nlohmann::json(c.model.tied()); }});
    v.push_back(num_key("model.norm_eps", &C::model, &ModelConfig::norm_eps));
    v.push_back(num_key("model.rope_theta", &C::model, &ModelConfig::rope_theta));
    v.push_back(str_key("model.init_from", &C::model, &ModelConfig::init_from));

    v.push_back(str_key("data.path", &C::data, &DataConfig::path));
    v.push_back(str_key("data.val_path", &C::data, &DataConfig::val_path));
    v.push_back(num_key("data.val_fraction", &C::data, &DataConfig::val_fraction));
    v.push_back(bool_key("data.shuffle", &C::data, &DataConfig::shuffle));
    v.push_back(str_key("data.tokenizer", &C::data, &DataConfig::tokenizer));

    v.push_back(int_key("training.steps", &C::training, &TrainingConfig::steps));
    v.push_back(int_key("training.global_batch", &C::training, &TrainingConfig::global_batch));
    v.push_back(int_key("training.micro_batch", &C::training, &TrainingConfig::micro_batch));
    v.push_back(int_key("training.seed", &C::training, &TrainingConfig::seed));
    v.push_back(bool_key("training.recompute", &C::training, &TrainingConfig::recompute));
    v.push_back(int_key("training.recompute_blocks", &C::training, &TrainingConfig::recompute_blocks));
    // Kept in the model's configuration, which is what builds the activations.
    v.push_back(str_key("training.attention", &C::model, &ModelConfig::attention, {"fused", "materialized"}));
    v.push_back(str_key("training.precision", &C::model, &ModelConfig::precision, {"fp32", "bf16", "fp16"}));
    v.push_back(str_key("training.grad_dtype", &C::model, &ModelConfig::grad_dtype, {"fp32", "bf16", "fp16"}));
    v.push_back(int_key("training.val_every", &C::training, &TrainingConfig::val_every));
    v.push_back(int_key("training.val_batches", &C::training, &TrainingConfig::val_batches));
    v.push_back(int_key("training.threads", &C::training, &TrainingConfig::threads));
    v.push_back(str_key("training.device", &C::training, &TrainingConfig::device, {"cpu", "cuda"}));
    v.push_back(num_key("training.skip_spikes", &C::training, &TrainingConfig::skip_spikes));
    v.push_back(int_key("training.max_skips", &C::training, &TrainingConfig::max_skips));

    v.push_back(str_key("optim.name", &C::optim, &OptimConfig::name, {"adamw", "sgd", "lamb", "lars"}));
    v.push_back(num_key("optim.trust_coef", &C::optim, &OptimConfig::trust_coef));
    v.push_back(int_key("optim.lr_base_batch", &C::optim, &OptimConfig::lr_base_batch));
    v.push_back(num_key("optim.lr", &C::optim, &OptimConfig::lr));
    v.push_back(num_key("optim.weight_decay", &C::optim, &OptimConfig::weight_decay));
    v.push_back(num_key("optim.beta1", &C::optim, &OptimConfig::beta1));
    v.push_back(num_key("optim.beta2", &C::optim, &OptimConfig::beta2));
    v.push_back(num_key("optim.eps", &C::optim, &OptimConfig::eps));
    v.push_back(num_key("optim.momentum", &C::optim, &OptimConfig::momentum));
    v.push_back(bool_key("optim.nesterov", &C::optim, &OptimConfig::nesterov));
    v.push_back(num_key("optim.grad_clip", &C::optim, &OptimConfig::grad_clip));
    v.push_back(num_key("optim.loss_scale", &C::optim, &OptimConfig::loss_scale));
    v.push_back(int_key("optim.loss_scale_window", &C::optim, &OptimConfig::loss_scale_window));
    v.push_back(str_key("optim.schedule", &C::optim, &OptimConfig::schedule, {"constant", "cosine", "linear", "step"}));
    v.push_back(int_key("optim.warmup_steps", &C::optim, &OptimConfig::warmup_steps));
    v.push_back(num_key("optim.min_lr_ratio", &C::optim, &OptimConfig::min_lr_ratio));
    v.push_back(int_key("optim.step_size", &C::optim, &OptimConfig::step_size));
    v.push_back(num_key("optim.step_gamma", &C::optim, &OptimConfig::step_gamma));

    v.push_back(int_key("parallel.dp", &C::parallel, &ParallelConfig::dp));
    v.push_back(int_key("parallel.tp", &C::parallel, &ParallelConfig::tp));
    v.push_back(bool_key("parallel.sequence_parallel", &C::parallel, &ParallelConfig::sequence_parallel));
    v.push_back(int_key("parallel.cp", &C::parallel, &ParallelConfig::cp));
    v.push_back(int_key("parallel.pp", &C::parallel, &ParallelConfig::pp));
    v.push_back(int_key("parallel.pp_chunks", &C::parallel, &ParallelConfig::pp_chunks));
    v.push_back(str_key("parallel.pp_schedule", &C::parallel, &ParallelConfig::pp_schedule));
    v.push_back(str_key("parallel.pp_layers", &C::parallel, &ParallelConfig::pp_layers));
    v.push_back(num_key("parallel.bucket_mb", &C::parallel, &ParallelConfig::bucket_mb));
    v.push_back(str_key("parallel.grad_comm_dtype", &C::parallel, &ParallelConfig::grad_comm_dtype, {"fp32", "bf16", "fp16"}));
    v.push_back(bool_key("parallel.overlap", &C::parallel, &ParallelConfig::overlap));
    v.push_back(bool_key("parallel.hierarchical", &C::parallel, &ParallelConfig::hierarchical));
    v.push_back(int_key("parallel.ranks_per_node", &C::parallel, &ParallelConfig::ranks_per_node));
    v.push_back(str_key("parallel.grad_compression", &C::parallel, &ParallelConfig::grad_compression,
                        {"none", "int8", "powersgd"}));
    v.push_back(int_key("parallel.powersgd_rank", &C::parallel, &ParallelConfig::powersgd_rank));
    v.push_back(bool_key("parallel.debug_collectives", &C::parallel, &ParallelConfig::debug_collectives));
    v.push_back(str_key("parallel.gpu_comm", &C::parallel, &ParallelConfig::gpu_comm, {"auto", "nccl", "host"}));
    v.push_back(num_key("parallel.timeout_s", &C::parallel, &ParallelConfig::timeout_s));
    v.push_back(int_key("parallel.zero", &C::parallel, &ParallelConfig::zero));
    v.push_back(str_key("parallel.sharding", &C::parallel, &ParallelConfig::sharding,
                        {"", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"}));
    v.push_back(int_key("parallel.shard_group", &C::parallel, &ParallelConfig::shard_group));
    v.push_back(bool_key("parallel.reshard_after_forward", &C::parallel, &ParallelConfig::reshard_after_forward));
    v.push_back(bool_key("parallel.prefetch", &C::parallel, &ParallelConfig::prefetch));
    v.push_back(str_key("parallel.test_fault", &C::parallel, &ParallelConfig::test_fault));

    v.push_back(str_key("checkpoint.dir", &C::checkpoint, &CheckpointConfig::dir));
    v.push_back(int_key("checkpoint.every", &C::checkpoint, &CheckpointConfig::every));
    v.push_back(bool_key("checkpoint.resume", &C::checkpoint, &CheckpointConfig::resume));
    v.push_back(int_key("checkpoint.keep", &C::checkpoint, &CheckpointConfig::keep));
    v.push_back(str_key("checkpoint.allow_change", &C::checkpoint, &CheckpointConfig::allow_change));

    v.push_back(str_key("logging.metrics", &C::logging, &LoggingConfig::metrics));
    v.push_back(str_key("logging.plot", &C::logging, &LoggingConfig::plot));
    v.push_back(int_key("logging.every", &C::logging, &LoggingConfig::every));
    v.push_back(str_key("logging.progress", &C::logging, &LoggingConfig::progress, {"auto", "on", "off"}));
    v.push_back(str_key("logging.trace", &C::logging, &LoggingConfig::trace));
    v.push_back(bool_key("logging.profile", &C::logging, &LoggingConfig::profile));
    v.push_back(str_key("logging.hardware", &C::logging, &LoggingConfig::hardware));
    return v;
  }();
  return k;
}

// Levenshtein distance, to suggest the key a typo meant.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> d(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) d[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = d[0];
    d[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cur = d[j];
      d[j] = std::min({d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1])});
      prev = cur;
    }
  }
  return d[b.size()];
}

const Key& find_key(const std::string& name) {
  for (const Key& k : keys())
    if (k.name == name) return k;
  std::string best;
  size_t best_d = 1000;
  for (const Key& k : keys()) {
    size_t d = edit_distance(name, k.name);
    if (d < best_d) best_d = d, best = k.name;
  }
  std::string section = name.substr(0, name.find('.'));
  std::string same;
  for (const Key& k : keys())
    if (k.name.compare(0, section.size() + 1, section + ".") == 0) same += (same.empty() ? "" : ", ") + k.name;
  if (best_d <= 3) MT_FAIL("unknown configuration key " << name << "; did you mean " << best << "?");
  if (!same.empty()) MT_FAIL("unknown configuration key " << name << "; the [" << section << "] keys are: " << same);
  MT_FAIL("unknown configuration key " << name
                                      << "; sections are model, data, training, optim, parallel, checkpoint, logging");
}

// The keys whose values are lists, written "a,b,c" on the command line; in a TOML file
// also as arrays of strings or integers ([2, 1], ["optim.lr", "data.path"]).
bool list_key(const std::string& key) { return key == "parallel.pp_layers" || key == "checkpoint.allow_change"; }

std::string toml_value_text(const std::string& key, const toml::node& n) {
  if (auto a = n.as_array(); a && list_key(key)) {
    std::string joined;
    for (const toml::node& e : *a) {
      MT_CHECK(e.is_string() || e.is_integer(), "bad value for " << key << " in the config file: a list of strings or "
                                                                    "integers, e.g. [2, 1] (or \"2,1\")");
      if (!joined.empty()) joined += ',';
      joined += toml_value_text(key, e);
    }
    return joined;
  }
  if (auto s = n.as_string()) return s->get();
  if (auto i = n.as_integer()) return std::to_string(i->get());
  if (auto f = n.as_floating_point()) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", f->get());
    return buf;
  }
  if (auto b = n.as_boolean()) return b->get() ? "true" : "false";
  MT_FAIL("bad value for " << key << " in the config file: expected a string, number or boolean"
                            << (list_key(key) ? ", or a list of strings or integers" : ""));
}

}  // namespace

void config_set(Config& c, const std::string& key, const std::string& value) { find_key(key).set(c, value); }

std::vector<std::string> config_keys() {
  std::vector<std::string> r;
  for (const Key& k : keys()) r.push_back(k.name);
  return r;
}

Config config_load(const std::string& toml_path, const std::vector<std::string>& overrides) {
  Config c = config_read(toml_path, overrides);
  c.validate();
  return c;
}

Config config_read(const std::string& toml_path, const std::vector<std::string>& overrides) {
  Config c;
  if (!toml_path.empty()) {
    // toml++ reads a directory as an empty file, which would train on the defaults.
    std::error_code ec;
    MT_CHECK(std::filesystem::is_regular_file(toml_path, ec),
             "--config " << toml_path << " is " << (std::filesystem::exists(toml_path, ec) ? "not a regular file"
                                                                                          : "not there")
                         << ": give the path of a TOML configuration file");
    toml::table tbl;
    try {
      tbl = toml::parse_file(toml_path);
    } catch (const toml::parse_error& e) {
      MT_FAIL("cannot read config " << toml_path << ": " << e.description() << " (line " << e.source().begin.line
                                    << ")");
    }
    for (auto&& [section, node] : tbl) {
      const toml::table* t = node.as_table();
      MT_CHECK(t, "config " << toml_path << ": top-level key " << section.str()
                            << " must be a section like [model], [data], [training], [optim], [parallel], [checkpoint], [logging]");
      for (auto&& [key, value] : *t) {
        std::string name = std::string(section.str()) + "." + std::string(key.str());
        find_key(name).set(c, toml_value_text(name, value));
      }
    }
  }
  for (const std::string& o : overrides) {
    size_t eq = o.find('=');
    MT_CHECK(eq != std::string::npos, "bad option --" << o << ": write --section.key=value, e.g. --training.steps=100");
    config_set(c, o.substr(0, eq), o.substr(eq + 1));
  }
  return c;
}

void Config::validate() const {
  model.validate();
  optim.validate();
  MT_CHECK(training.steps >= 0, "training.steps = " << training.steps << " must not be negative");
  MT_CHECK(training.micro_batch >= 0, "training.micro_batch = " << training.micro_batch
                                                                << " must be positive (0: global_batch / dp)");
  MT_CHECK(training.global_batch >= 1, "training.global_batch = " << training.global_batch << " must be at least 1");
  MT_CHECK(training.micro_batch == 0 || training.global_batch % training.micro_batch == 0,
           "training.global_batch = " << training.global_batch << " is not a multiple of training.micro_batch = "
                                      << training.micro_batch << "; set global_batch to micro_batch times the number "
                                      << "of accumulation steps");
  MT_CHECK(training.recompute_blocks >= 0, "training.recompute_blocks = " << training.recompute_blocks
                                                                        << " must not be negative (0: every block)");
  MT_CHECK(training.recompute_blocks == 0 || training.recompute,
           "training.recompute_blocks = " << training.recompute_blocks << " names the blocks that recompute, but "
                                          << "training.recompute is false; set recompute = true too, or "
                                          << "recompute_blocks = 0");
  MT_CHECK(training.val_every >= 0, "training.val_every must not be negative");
  MT_CHECK(training.val_batches >= 1, "training.val_batches must be at least 1");
  MT_CHECK(training.threads >= 0 && training.threads <= 4096,  // OpenMP's start-up took the stack at 100000
           "training.threads = " << training.threads << " must be from 0 (all cores) to 4096");
  fault_spec_check(parallel.test_fault);
  check_device();
  if (model.grad_working()) {  // 16-bit gradients (training.grad_dtype; model.validate checked the dtype)
    MT_CHECK(parallel.grad_comm_dtype == "fp32" || parallel.grad_comm_dtype == model.grad_dtype,
             "parallel.grad_comm_dtype = " << parallel.grad_comm_dtype << " with training.grad_dtype = "
                                           << model.grad_dtype << ": reduce the gradients in " << model.grad_dtype
                                           << " (in place) or fp32 (widened, the same sums)");
  }
  MT_CHECK(training.skip_spikes >= 0, "training.skip_spikes = " << training.skip_spikes << " must not be negative "
                                      << "(standard deviations above the recent mean; 0: off)");
  MT_CHECK(training.max_skips >= 1, "training.max_skips = " << training.max_skips << " must be at least 1 (skipped "
                                    << "steps in a row before the run stops)");
  MT_CHECK(data.val_fraction >= 0 && data.val_fraction < 1, "data.val_fraction = " << data.val_fraction << " must be in [0, 1)");
  // Refused rather than ignored: a run that validates on other tokens than the user chose.
  MT_CHECK(data.val_fraction == 0 || data.val_path.empty(),
           "data.val_fraction = " << data.val_fraction << " and data.val_path = " << data.val_path
                                  << " both choose the validation tokens; set only one (val_fraction holds out the "
                                  << "tail of data.path)");
  MT_CHECK(data.val_fraction == 0 || !data.path.empty(),
           "data.val_fraction = " << data.val_fraction << " holds out the tail of data.path, but data.path is not "
                                  << "set: the built-in tasks draw their own validation problems; remove "
                                  << "data.val_fraction or set data.path");
  MT_CHECK(checkpoint.every >= 0, "checkpoint.every must not be negative");
  MT_CHECK(checkpoint.keep >= 0, "checkpoint.keep must not be negative (0 keeps all)");
  MT_CHECK(!checkpoint.resume || !checkpoint.dir.empty(), "checkpoint.resume=true needs checkpoint.dir");
  MT_CHECK(logging.every >= 1, "logging.every must be at least 1");
  MT_CHECK(parallel.dp >= 0, "parallel.dp = " << parallel.dp << " must not be negative (0: all remaining ranks)");
  validate_tp(model, parallel.tp);  // heads, key/value heads and d_ff must split tp ways
  MT_CHECK(!parallel.sequence_parallel || model.seq_len % parallel.tp == 0,
           "model.seq_len = " << model.seq_len << " does not split over parallel.tp = " << parallel.tp
                              << " ranks for parallel.sequence_parallel=true; use a seq_len that tp divides "
                              << "(e.g. " << (model.seq_len / parallel.tp + 1) * parallel.tp << ")");
  MT_CHECK(parallel.pp >= 1, "parallel.pp = " << parallel.pp << " must be at least 1");
  check_context_parallel();
  MT_CHECK(parallel.pp_chunks >= 0, "parallel.pp_chunks = " << parallel.pp_chunks
                                                            << " must not be negative (0: the schedule's default)");
  const std::string& sched = parallel.pp_schedule;
  if (sched.rfind("file:", 0) != 0) {
    const auto& names = schedule_names();
    std::string all;
    for (const std::string& n : names) all += (all.empty() ? "" : ", ") + n;
    MT_CHECK(std::find(names.begin(), names.end(), sched) != names.end(),
             "parallel.pp_schedule = \"" << sched << "\" is not a schedule; use " << all << " or file:PATH");
  }
  MT_CHECK(!(training.recompute && schedule_splits_backward(sched)),
           "training.recompute=true cannot run with parallel.pp_schedule = " << sched << ": its split backward "
           "runs the weight half after the activations are gone; use 1f1b or interleaved, or recompute=false");
  MT_CHECK(parallel.bucket_mb > 0, "parallel.bucket_mb = " << parallel.bucket_mb << " must be positive");
  check_cheaper_comm();
  MT_CHECK(parallel.timeout_s >= 0, "parallel.timeout_s must not be negative (0: no watchdog)");
  MT_CHECK(parallel.zero >= 0 && parallel.zero <= 3, "parallel.zero = " << parallel.zero << " must be 0, 1, 2 or 3");
  MT_CHECK(parallel.shard_group >= 0, "parallel.shard_group must not be negative (0: all data-parallel ranks)");
  if (!parallel.sharding.empty()) {
    const std::string& s = parallel.sharding;
    const int stage = s == "NO_SHARD" ? 0 : s == "SHARD_GRAD_OP" ? 2 : 3;
    MT_CHECK(parallel.zero == 0 || parallel.zero == stage,
             "parallel.sharding = " << s << " means parallel.zero = " << stage << ", but parallel.zero = "
                                    << parallel.zero << "; set only one of them");
  }
}

// Hierarchical reductions (DDP's all-reduce, ZeRO's reduce-scatters) and gradient
// compression (DDP's buckets; ZeRO's reductions at every stage, or under HYBRID_SHARD the
// replicas' all-reduce: parallel/zero.h).
void Config::check_cheaper_comm() const {
  const ParallelConfig& p = parallel;
  MT_CHECK(p.ranks_per_node >= 0, "parallel.ranks_per_node = " << p.ranks_per_node
                                                               << " must not be negative (0: the machines MPI finds)");
  MT_CHECK(p.powersgd_rank >= 1, "parallel.powersgd_rank = " << p.powersgd_rank
                                 << " must be at least 1 (the rank of PowerSGD's approximation; default 4)");
  if (p.grad_compression == "none") return;
  MT_CHECK(p.grad_comm_dtype == "fp32", "parallel.grad_compression = " << p.grad_compression << " compresses fp32 "
                                        << "gradients itself; leave parallel.grad_comm_dtype = fp32 (got "
                                        << p.grad_comm_dtype << ")");
}

std::string compression_state_layout(const Config& c, int world_size) {
  const ParallelConfig& p = c.parallel;
  if (p.grad_compression == "none") return "";
  std::ostringstream o;
  o << p.grad_compression;
  if (p.grad_compression == "powersgd") o << " rank " << p.powersgd_rank;
  o << " over dp " << p.dp << " (" << world_size << " ranks: tp " << p.tp << ", cp " << p.cp << ", pp " << p.pp;
  if (p.hierarchical)
    o << ", compressed between nodes of "
      << (p.ranks_per_node > 0 ? std::to_string(p.ranks_per_node) + " ranks" : std::string("the machines' ranks"));
  if (p.pp > 1) o << " with " << p.pp_chunks << " chunks, layers " << p.pp_layers;
  if (p.zero == 0) o << "; DDP buckets of " << p.bucket_mb << " MiB)";
  else if (p.shard_group < p.dp * p.cp) o << "; ZeRO " << p.zero << " in shard groups of " << p.shard_group << ")";
  else o << "; ZeRO " << p.zero << ")";
  return o.str();
}

// Context parallelism cuts every sequence into 2 cp chunks (two per rank, one early and one
// late); under sequence parallelism each rank's T / cp positions split tp ways again.
void Config::check_device() const {
  MT_CHECK(parallel.gpu_comm != "nccl" || training.device == "cuda",
           "parallel.gpu_comm = nccl carries GPU tensors between ranks, but training.device = "
               << training.device << " keeps them in host memory: set training.device = cuda, or leave "
               << "parallel.gpu_comm = auto");
  if (training.device != "cuda") return;
  MT_CHECK(cuda_built(), "training.device = cuda, but this meshtrain was built without CUDA: install the CUDA toolkit "
                         "and rebuild (MESHTRAIN_CUDA=ON), or use training.device = cpu");
  MT_CHECK(model.fused_attention(), "training.device = cuda needs training.attention = fused (the GPU attention "
                                    "never stores the [T, T] probabilities)");
}

void Config::check_context_parallel() const {
  const int cp = parallel.cp, T = model.seq_len;
  MT_CHECK(cp >= 1, "parallel.cp = " << cp << " must be at least 1");
  if (cp == 1) return;
  auto nearest = [&](int step) {  // the valid seq_len values around T
    const int below = T / step * step, above = below + step;
    return below > 0 ? std::to_string(below) + " or " + std::to_string(above) : std::to_string(above);
  };
  MT_CHECK(T % (2 * cp) == 0, "model.seq_len = " << T << " does not split into 2 x parallel.cp = " << 2 * cp
                                                 << " equal chunks (each cp rank holds one early and one late chunk); "
                                                 << "use seq_len " << nearest(2 * cp) << ", or another parallel.cp");
  const int step = 2 * cp * parallel.tp;
  MT_CHECK(!parallel.sequence_parallel || T % step == 0,
           "model.seq_len = " << T << " does not split over parallel.cp x parallel.tp = " << cp * parallel.tp
                              << " ranks in two chunks for parallel.sequence_parallel=true; use seq_len "
                              << nearest(step) << ", or sequence_parallel=false");
  MT_CHECK(model.fused_attention(), "parallel.cp = " << cp << " needs training.attention = fused (the ring merges "
                                                     << "attention parts by their log-sum-exp); got " << model.attention);
}

void Config::resolve_layout(int world_size, bool check_schedule) {
  const int tp_pp = parallel.tp * parallel.pp * parallel.cp;  // every axis but dp
  if (parallel.dp == 0) {
    MT_CHECK(world_size % tp_pp == 0, "the job has " << world_size << " ranks, not a multiple of parallel.tp x parallel.pp"
                                                     << " x parallel.cp = " << tp_pp << "; launch a multiple of "
                                                     << tp_pp << " ranks");
    parallel.dp = world_size / tp_pp;
  }
  MT_CHECK(world_size == parallel.dp * tp_pp,
           "the job has " << world_size << " ranks but parallel.dp x parallel.pp x parallel.cp x parallel.tp = "
                          << parallel.dp << " x " << parallel.pp << " x " << parallel.cp << " x " << parallel.tp
                          << " = " << parallel.dp * tp_pp << "; launch " << parallel.dp * tp_pp
                          << " ranks (meshtrain launch -n " << parallel.dp * tp_pp << ") or set parallel.dp="
                          << std::max(1, world_size / tp_pp));
  if (training.micro_batch == 0) {
    const int64_t below = training.global_batch / parallel.dp * parallel.dp;
    MT_CHECK(training.global_batch % parallel.dp == 0,
             "training.global_batch = " << training.global_batch << " is not divisible by parallel.dp = " << parallel.dp
                                        << "; set training.global_batch="
                                        << (below > 0 ? std::to_string(below) + " or " : "") << below + parallel.dp);
    const int64_t per_rank = training.global_batch / parallel.dp;
    training.micro_batch = per_rank;
    // A pipeline needs micro-batches to overlap: the largest micro-batch giving at least
    // 2 pp of them (a multiple of pp, as interleaving needs), else 1.
    if (parallel.pp > 1) {
      training.micro_batch = 1;
      for (int64_t b = per_rank; b >= 1; --b)
        if (per_rank % b == 0 && per_rank / b >= 2 * parallel.pp && (per_rank / b) % parallel.pp == 0) {
          training.micro_batch = b;
          break;
        }
    }
  }
  const int64_t per_step = int64_t{parallel.dp} * training.micro_batch;
  // ZeRO: the FSDP name decides the stage; the shard group defaults to all the ranks that
  // reduce gradients together (dp x cp: context-parallel ranks hold the same parameters).
  const std::string& sh = parallel.sharding;
  const int data = parallel.dp * parallel.cp;
  const char* data_name = parallel.cp > 1 ? "dp x cp" : "dp";
  if (!sh.empty()) parallel.zero = sh == "NO_SHARD" ? 0 : sh == "SHARD_GRAD_OP" ? 2 : 3;
  if (sh == "HYBRID_SHARD") {
    const int dp = data;  // the ranks that reduce gradients together (dp x cp)
    auto hybrid = [](int n, int g) { return g > 1 && g < n && n % g == 0; };
    std::vector<int64_t> between;  // dp's divisors but 1 and dp
    for (int64_t g : divisors(dp))
      if (hybrid(dp, static_cast<int>(g))) between.push_back(g);
    const std::string groups = values_text(between);
    int64_t more = dp + 1;  // the smallest dp with a hybrid shard group: one with 3 divisors or more
    while (divisors(more).size() < 3) ++more;
    MT_CHECK(hybrid(dp, parallel.shard_group),
             "parallel.sharding = HYBRID_SHARD needs parallel.shard_group between 2 and " << data_name << " - 1 dividing "
                 << data_name << " = " << dp << " (got " << parallel.shard_group << "); "
                 << (!groups.empty() ? "set parallel.shard_group=" + groups
                                     : std::string(data_name) + " = " + std::to_string(dp) + " has none: use " +
                                           "parallel.sharding=FULL_SHARD (one shard group of all its ranks), or " +
                                           "launch " + std::to_string(more * parallel.tp * parallel.pp) + " ranks for " +
                                           data_name + " = " + std::to_string(more) + " (ranks / (parallel.tp x " +
                                           "parallel.pp))"));
  } else if (parallel.shard_group == 0) {
    parallel.shard_group = data;
  }
  MT_CHECK(!parallel.hierarchical || parallel.zero == 0 || parallel.shard_group == data,
           "parallel.hierarchical=true with ZeRO reduce-scatters over all " << data_name << " ranks by node, but "
               << "parallel.shard_group = " << parallel.shard_group << " shards over groups of "
               << parallel.shard_group << " of the " << data << " (HYBRID_SHARD, itself a layout by node); use one "
               << "or the other");
  MT_CHECK(!parallel.hierarchical || parallel.grad_compression == "none" || parallel.zero == 0,
           "parallel.hierarchical=true with parallel.grad_compression = "
               << parallel.grad_compression << " compresses DDP's buckets between nodes, but parallel.zero = "
               << parallel.zero << "; for ZeRO, HYBRID_SHARD with parallel.shard_group = the ranks of a node "
               << "compresses what crosses the nodes: set parallel.hierarchical=false and parallel.shard_group");
  MT_CHECK(parallel.ranks_per_node == 0 || data % parallel.ranks_per_node == 0,
           data_name << " = " << data << " is not a multiple of parallel.ranks_per_node = " << parallel.ranks_per_node
                     << " (nodes of consecutive " << data_name << " ranks); set parallel.ranks_per_node to one of "
                     << values_text(divisors(data)));
  MT_CHECK(parallel.ranks_per_node == 0 || parallel.zero == 0 || parallel.shard_group % parallel.ranks_per_node == 0 ||
               parallel.ranks_per_node % parallel.shard_group == 0,
           "parallel.shard_group = " << parallel.shard_group << " and parallel.ranks_per_node = "
                                     << parallel.ranks_per_node << ": a shard group must hold whole nodes or lie "
                                     << "inside one; set one a multiple of the other");
  MT_CHECK(data % parallel.shard_group == 0,
           "parallel.shard_group = " << parallel.shard_group << " does not divide " << data_name << " = " << data
                                     << "; parallel.shard_group can be "
                                     << values_text(divisors(data)));
  MT_CHECK(training.global_batch % per_step == 0,
           "training.global_batch = " << training.global_batch << " is not divisible by parallel.dp x training.micro_batch = "
                                      << parallel.dp << " x " << training.micro_batch << " = " << per_step
                                      << "; make global_batch a multiple of " << per_step);
  // Beyond this many micro-batches per step the schedule's action lists alone would take
  // the machine's memory; no run needs them (a larger micro_batch does the same work).
  constexpr int64_t kMaxMicroBatches = int64_t{1} << 20;
  MT_CHECK(training.global_batch / per_step <= kMaxMicroBatches,
           "training.global_batch = " << training.global_batch << " is " << training.global_batch / per_step
                                      << " micro-batches per step (global_batch / (parallel.dp x training.micro_batch "
                                      << "= " << per_step << ")), more than the " << kMaxMicroBatches
                                      << " meshtrain runs; raise training.micro_batch or lower training.global_batch");
  // The pipeline schedule must take this many chunks and micro-batches per step.
  if (parallel.pp_schedule.rfind("file:", 0) == 0) return check_pipeline();  // against the file (always)
  if (parallel.pp_chunks == 0) parallel.pp_chunks = schedule_default_chunks(parallel.pp_schedule);
  const int m = static_cast<int>(training.global_batch / per_step);
  MT_CHECK(schedule_within(parallel.pp, parallel.pp_chunks, m),
           "parallel.pp x parallel.pp_chunks x the micro-batches per step = " << parallel.pp << " x " << parallel.pp_chunks
               << " x " << m << " forward passes per step, more than the " << kMaxScheduleForwards
               << " meshtrain schedules; raise training.micro_batch or lower training.global_batch");
  if (auto issue = schedule_layout_issue(parallel.pp_schedule, parallel.pp, parallel.pp_chunks, m)) {
    if (issue->knob == LayoutIssue::chunks)
      MT_FAIL("parallel.pp_schedule = " << parallel.pp_schedule << " cannot run parallel.pp_chunks = "
                                        << parallel.pp_chunks << ": " << issue->why << "; set parallel.pp_chunks="
                                        << issue->use);
    MT_FAIL("parallel.pp_schedule = " << parallel.pp_schedule << " cannot run " << m
                                      << (m == 1 ? " micro-batch" : " micro-batches") << " per step "
                                      << "(training.global_batch / (parallel.dp x training.micro_batch) = "
                                      << training.global_batch << " / " << per_step << "): " << issue->why
                                      << "; set training.global_batch=" << int64_t{issue->use} * per_step
                                      << " for " << issue->use << " micro-batches");
  }
  if (model.n_layer < parallel.pp * parallel.pp_chunks) {  // the nearest layouts with a block per stage
    const int L = model.n_layer, v = L / parallel.pp, p = L / parallel.pp_chunks;
    auto takes = [&](int pp, int chunks) {
      const auto issue = schedule_layout_issue(parallel.pp_schedule, pp, chunks, m);
      return !issue || issue->knob != LayoutIssue::chunks;
    };
    std::string fix;
    if (v >= 1 && takes(parallel.pp, v)) fix += "parallel.pp_chunks=" + std::to_string(v);
    if (p >= 1 && takes(p, parallel.pp_chunks)) fix += std::string(fix.empty() ? "" : ", ") + "parallel.pp=" + std::to_string(p);
    MT_FAIL("model.n_layer = " << L << " is fewer than parallel.pp x parallel.pp_chunks = " << parallel.pp << " x "
                               << parallel.pp_chunks << " stages: every stage needs a block; set " << fix
                               << (fix.empty() ? "" : " or ") << "model.n_layer=" << parallel.pp * parallel.pp_chunks);
  }
  if (check_schedule) check_pipeline();
}

void Config::check_pipeline() const {
  const int64_t per_step = int64_t{parallel.dp} * training.micro_batch;
  const int m = static_cast<int>(training.global_batch / per_step);
  if (parallel.pp_schedule.rfind("file:", 0) == 0) {
    // A file written for another number of micro-batches: the batch that gives it. (A file
    // that does not read is named by pipeline_schedule.)
    std::optional<PipeLayout> file;
    try {
      file = schedule_read(parallel.pp_schedule.substr(5)).layout;
    } catch (const Error&) {
    }
    const int64_t per_micro = file ? int64_t{parallel.dp} * file->micro : 0;  // the micro_batch keeping the batch
    const int64_t kept = per_micro && training.global_batch % per_micro == 0 ? training.global_batch / per_micro : 0;
    MT_CHECK(!file || file->pp != parallel.pp || file->micro == m,
             "parallel.pp_schedule = " << parallel.pp_schedule << " is a schedule of " << file->micro
                                       << " micro-batches per step, but this run has " << m << " (training.global_batch"
                                       << " / (parallel.dp x training.micro_batch) = " << training.global_batch << " / "
                                       << per_step << "); set training.global_batch=" << file->micro * per_step
                                       << (kept ? ", or training.micro_batch=" + std::to_string(kept) : "")
                                       << ", or write the file for " << m << " micro-batches");
  }
  pipeline_schedule(parallel, model, m, training.recompute);  // throws what cannot run
}

nlohmann::json config_to_json(const Config& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const Key& k : keys()) {
    std::string sec = k.name.substr(0, k.name.find('.')), key = k.name.substr(k.name.find('.') + 1);
    j[sec][key] = k.get(c);
  }
  return j;
}

Config config_from_json(const nlohmann::json& j) {
  Config c;
  for (auto s = j.begin(); s != j.end(); ++s)
    for (auto k = s->begin(); k != s->end(); ++k) {
      std::string v = k->is_string() ? k->get<std::string>() : k->is_boolean() ? (k->get<bool>() ? "true" : "false") : k->dump();
      config_set(c, s.key() + "." + k.key(), v);
    }
  return c;
}

}  // namespace mt
