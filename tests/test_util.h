// Helpers shared by the tests: temporary directories, tiny configs, running the command.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/token_file.h"
#include "train/config.h"

namespace mt::test {

// The message of the mt::Error that fn throws ("" when it throws none).
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A fresh directory under /tmp, removed when the object goes.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/meshtrain-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// Random tokens in [0, vocab) written as a token file.
inline std::string write_tokens(const TempDir& d, const std::string& name, int64_t n, int vocab, uint64_t seed = 7) {
  Philox rng{seed};
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng.uniform(3, i) * vocab);
  token_file_write(d / name, t);
  return d / name;
}

// A tiny configuration that trains in well under a second.
inline Config tiny_config(const std::string& family, const std::string& tokens) {
  Config c;
  config_set(c, "model.family", family);
  c.model.n_layer = 2;
  c.model.n_head = 4;
  c.model.n_kv_head = family == "llama" ? 2 : 0;
  c.model.d_model = 16;
  c.model.vocab_size = 37;
  c.model.seq_len = 9;
  c.data.path = tokens;
  c.data.val_fraction = 0.1;  // exercise the held-out tail
  c.training.global_batch = 4;
  c.training.micro_batch = 2;
  c.training.steps = 6;
  c.training.val_every = 0;
  c.training.val_batches = 1;
  c.optim.lr = 1e-2;
  c.logging.progress = "off";
  c.logging.every = 1000;
  return c;
}

// Runs a shell command, returning its exit status and (stdout + stderr).
inline int run_command(const std::string& cmd, std::string* output) {
  std::string full = cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  if (output) *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// mpirun started directly (as root, more ranks than cores), its session directory under d
// as meshtrain launch gives each of its mpiruns one (cli/launch.cpp): mpiruns started at
// once can race on the shared /tmp/ompi.<host>.<uid>.
inline std::string mpirun_in(const TempDir& d) {
  return "env OMPI_MCA_orte_tmpdir_base=" + d / "mpirun" + " mpirun --oversubscribe --allow-run-as-root";
}

// The JSON lines of a metrics file that describe optimizer steps.
inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> lines;
  std::string l;
  while (std::getline(f, l)) lines.push_back(l);
  return lines;
}

}  // namespace mt::test
