#include "plan/plan.h"

#include <limits>
#include <map>
#include <sstream>

#include "core/error.h"

namespace mt::plan {

Precisions Precisions::of(const std::string& name, bool grad_working) {
  Precisions p;
  p.name = name;
  if (name == "fp32") {
    MT_CHECK(!grad_working, "precision fp32 keeps gradients in fp32; grad_dtype = bf16 needs precision bf16 or fp16");
    return p;
  }
  MT_CHECK(name == "bf16" || name == "fp16", "precision = " << name << ": use fp32, bf16 or fp16");
  p.param = 2, p.activation = 2, p.kept = 2, p.master = 4, p.moment = 4;
  p.grad = grad_working ? 2 : 4;
  return p;
}

Precisions Precisions::trained(const std::string& name, bool grad_working) {
  Precisions p = of(name, grad_working);
  p.activation = 4;
  p.kept = p.param;
  return p;
}

std::string Layout::text() const {
  std::ostringstream s;
  s << "dp=" << dp << ",tp=" << tp << ",pp=" << pp << ",cp=" << cp << ",v=" << chunks << ",schedule=" << schedule
    << ",zero=" << zero;
  if (shard_group > 0) s << ",shard_group=" << shard_group;
  s << ",sp=" << (sequence_parallel ? 1 : 0) << ",recompute=" << recompute << ",mb=" << micro_batch
    << ",gb=" << global_batch;
  return s.str();
}

Recompute Layout::recomputed() const {
  if (recompute == "full") return {Recompute::kAll};
  if (recompute.empty() || recompute.find_first_not_of("0123456789") != std::string::npos) return {};
  return {static_cast<int>(std::min<int64_t>(std::stoll(recompute.substr(0, 10)), Recompute::kAll))};
}

std::string recompute_text(Recompute r) {
  return !r.any() ? "none" : r.blocks == Recompute::kAll ? "full" : std::to_string(r.blocks);
}

namespace {

int64_t parse_int(const std::string& key, const std::string& value, int64_t least,
                  int64_t most = std::numeric_limits<int>::max()) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MT_CHECK(used == value.size() && !value.empty() && v >= least && v <= most,
           "--layout " << key << "=" << value << ": expected a whole number from " << least << " to " << most);
  return v;
}

}  // namespace

Layout layout_parse(const std::string& text, Layout base) {
  std::istringstream in(text);
  std::string item;
  std::map<std::string, std::string> seen;  // key -> its item: a key given twice would keep only its last value
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    MT_CHECK(eq != std::string::npos, "--layout: '" << item << "' is not key=value (for example tp=8,pp=4,dp=2)");
    static const std::map<std::string, std::string> alias = {
        {"chunks", "v"},         {"pp_chunks", "v"}, {"micro_batch", "mb"}, {"global_batch", "gb"},
        {"sequence_parallel", "sp"}, {"pp_schedule", "schedule"}};
    const std::string given(item, 0, eq), value(item, eq + 1);
    const auto a = alias.find(given);
    const std::string& key = a == alias.end() ? given : a->second;
    MT_CHECK(!seen.count(key), "--layout: " << key << " given twice (" << seen[key] << " and " << item
                                            << "); give each field once");
    seen[key] = item;
    if (key == "dp") base.dp = static_cast<int>(parse_int(key, value, 1));
    else if (key == "tp") base.tp = static_cast<int>(parse_int(key, value, 1));
    else if (key == "pp") base.pp = static_cast<int>(parse_int(key, value, 1));
    else if (key == "cp") base.cp = static_cast<int>(parse_int(key, value, 1));
    else if (key == "v") base.chunks = static_cast<int>(parse_int(key, value, 1));
    else if (key == "zero") {
      base.zero = static_cast<int>(parse_int(key, value, 0));
      MT_CHECK(base.zero <= 3, "--layout zero=" << value << ": ZeRO stages are 0 (DDP), 1, 2 and 3");
    } else if (key == "shard_group") base.shard_group = static_cast<int>(parse_int(key, value, 0));
    else if (key == "mb") base.micro_batch = parse_int(key, value, 1, int64_t{1} << 40);
    else if (key == "gb") base.global_batch = parse_int(key, value, 1, int64_t{1} << 40);
    else if (key == "sp") {
      MT_CHECK(value == "0" || value == "1" || value == "true" || value == "false",
               "--layout sp=" << value << ": use 1 or 0");
      base.sequence_parallel = value == "1" || value == "true";
    } else if (key == "recompute") {
      if (value == "none" || value == "selective" || value == "full") {
        base.recompute = value;
      } else {
        MT_CHECK(!value.empty() && value.find_first_not_of("0123456789") == std::string::npos,
                 "--layout recompute=" << value << ": use none, selective, full or a count of blocks per chunk");
        base.recompute = recompute_text({static_cast<int>(parse_int(key, value, 0))});  // 0: none
      }
    } else if (key == "schedule") {
      base.schedule = value;
    } else {
      MT_FAIL("--layout: unknown key '" << key
                                        << "'; keys: dp, tp, pp, cp, v, schedule, zero, shard_group, sp, recompute, "
                                           "mb, gb");
    }
    base.named.insert(key);
  }
  return base;
}

double Hardware::flops(const std::string& precision) const {
  if (precision == "bf16") return flops_bf16;
  if (precision == "fp16") return flops_fp16;
  return flops_fp32;
}

}  // namespace mt::plan
