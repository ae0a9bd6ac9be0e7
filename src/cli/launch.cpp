#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

namespace mt {

int cmd_launch(const std::vector<std::string>& args, const char* self) {
  int n = 0;
  bool hostfile = false;
  std::vector<std::string> mpi_opts, rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!rest.empty() || (a.rfind("-", 0) != 0)) {  // the meshtrain command and its options
      rest.push_back(a);
      continue;
    }
    if (a == "-n" || a == "-np") {
      MT_CHECK(i + 1 < args.size(), "launch: " << a << " needs a number of ranks");
      n = std::atoi(args[++i].c_str());
      continue;
    }
    if (a == "--help" || a == "-h") {
      std::printf("usage: meshtrain launch -n N [--hostfile FILE] [other mpirun options] train [--section.key=value ...]\n"
                  "starts N ranks with mpirun; each gets OMP_NUM_THREADS = cores / ranks on the machine (at least 1)\n");
      return 0;
    }
    if (a == "--hostfile" || a == "-hostfile" || a == "--machinefile") hostfile = true;
    mpi_opts.push_back(a);
    // an mpirun option's value follows it unless it starts with '-'
    if (i + 1 < args.size() && args[i + 1].rfind("-", 0) != 0 && a.find('=') == std::string::npos &&
        a != "--oversubscribe" && a != "--allow-run-as-root" && a != "--tag-output" && a != "--report-bindings")
      mpi_opts.push_back(args[++i]);
  }
  MT_CHECK(n >= 1, "launch: give the number of ranks, e.g. meshtrain launch -n 2 train");
  MT_CHECK(!rest.empty(), "launch: give the command to run, e.g. meshtrain launch -n " << n << " train");

  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = hostfile ? 1 : std::max(1, static_cast<int>(cores) / n);
  std::vector<std::string> argv = {"mpirun", "-n", std::to_string(n), "--bind-to", "none"};
  if (!hostfile && static_cast<unsigned>(n) > cores) argv.push_back("--oversubscribe");
  if (geteuid() == 0) {
    std::fprintf(stderr, "meshtrain launch: warning: running MPI ranks as root\n");
    argv.push_back("--allow-run-as-root");
  }
  const std::string omp = std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : std::to_string(threads);
  setenv("OMP_NUM_THREADS", omp.c_str(), 1);
  for (const char* v : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY"}) argv.insert(argv.end(), {"-x", v});
  if (!std::getenv("OMP_WAIT_POLICY")) setenv("OMP_WAIT_POLICY", "passive", 1);  // ranks share cores with comm threads
  argv.insert(argv.end(), mpi_opts.begin(), mpi_opts.end());
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  argv.push_back(len > 0 ? std::string(exe, len) : std::string(self));
  argv.insert(argv.end(), rest.begin(), rest.end());

  std::vector<char*> cargv;
  for (std::string& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  execvp("mpirun", cargv.data());
  MT_FAIL("launch: cannot run mpirun (" << std::strerror(errno) << "); install Debian's openmpi-bin (scripts/setup.sh does)");
}

}  // namespace mt
