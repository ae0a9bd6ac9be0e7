#include "train/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace mt {

void output_parent_create(const std::string& path, const std::string& key) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MT_CHECK(!ec, "cannot create the directory " << dir.string() << " of " << key << " file " << path << ": "
                                               << ec.message() << "; choose another " << key);
}

MetricsLog::MetricsLog(const std::string& path, const std::string& progress, int64_t every, bool enabled)
    : path_(path), every_(every), enabled_(enabled) {
  if (!enabled) return;
  live_ = progress == "on" || (progress == "auto" && isatty(fileno(stderr)));
}

void MetricsLog::open(bool fresh) {
  if (!enabled_ || path_.empty() || file_) return;
  output_parent_create(path_, "logging.metrics");
  file_ = std::fopen(path_.c_str(), fresh ? "w" : "a");
  MT_CHECK(file_, "cannot open logging.metrics file " << path_ << ": " << std::strerror(errno)
                                                       << "; choose another logging.metrics");
}

MetricsLog::~MetricsLog() {
  if (line_open_) std::fputc('\n', stderr);
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const nlohmann::json& j) {
  if (!file_) return;
  std::string s = j.dump();
  std::fprintf(file_, "%s\n", s.c_str());
  std::fflush(file_);
}

static std::string format_duration(double s) {
  char buf[32];
  if (!(s < 3.6e8)) return ">100000h";  // training.steps may be up to 2^63 - 1: no int overflow
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(s / 60) % 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%.0fs", s);
  return buf;
}

void MetricsLog::progress(int64_t step, int64_t total, double loss, double lr, double tokens_per_s, double eta_s) {
  if (!enabled_) return;
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %lld/%lld | loss %.4f | lr %.2e | %.1fk tok/s | eta %s",
                static_cast<long long>(step + 1), static_cast<long long>(total), loss, lr, tokens_per_s / 1000.0,
                format_duration(eta_s).c_str());
  if (live_) {
    int done = total ? static_cast<int>(20 * (step + 1) / total) : 20;
    std::fprintf(stderr, "\r\033[K[%s%s] %s", std::string(done, '#').c_str(), std::string(20 - done, '.').c_str(), buf);
    std::fflush(stderr);
    line_open_ = true;
  } else if ((step + 1) % every_ == 0 || step + 1 == total || step == 0) {
    std::printf("%s\n", buf);
    std::fflush(stdout);
  }
}

void MetricsLog::status(const std::string& what) {
  if (!enabled_ || !live_) return;
  std::fprintf(stderr, "\r\033[K%s", what.c_str());
  std::fflush(stderr);
  line_open_ = true;
}

void MetricsLog::message(const std::string& line) {
  if (!enabled_) return;
  if (line_open_) {
    std::fprintf(stderr, "\r\033[K");
    line_open_ = false;
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

nlohmann::json memory_json(const MemStats& s) {
  nlohmann::json j;
  for (int i = 0; i < kNumMemTags; ++i) {
    j[std::string("mem_") + memtag_name(static_cast<MemTag>(i))] = s.peak[i];
  }
  j["mem_peak"] = s.peak_total;
  return j;
}

std::string memory_summary(const MemStats& s) {
  std::string r;
  for (int i = 0; i < kNumMemTags; ++i) {
    if (static_cast<MemTag>(i) == MemTag::other && !s.peak[i]) continue;
    r += std::string(memtag_name(static_cast<MemTag>(i))) + " " + format_bytes(s.peak[i]) + ", ";
  }
  return r + "total " + format_bytes(s.peak_total);
}

}  // namespace mt
