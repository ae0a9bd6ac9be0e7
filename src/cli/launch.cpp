// meshtrain launch: runs mpirun for the user and stays beside it as its parent, to turn
// signals into ones mpirun passes on. Debian's OpenMPI 4.1 mpirun ends the job on SIGTERM,
// SIGINT or SIGHUP (SIGTERM to every rank, SIGKILL a second later: odls_base_sigkill_timeout)
// and forwards SIGUSR1 and SIGUSR2 to every rank. So:
//
//   SIGTERM, SIGUSR1, SIGHUP   -> SIGUSR1 to mpirun -> every rank stops after its current
//   to launch                     step and checkpoint (train/stop.h), exit status 75
//   SIGINT (Ctrl-C)            -> SIGINT to mpirun  -> mpirun ends the job at once; launch
//                                 says so and exits 130
//   launch killed (SIGKILL)    -> SIGUSR1 to mpirun from the kernel (PR_SET_PDEATHSIG): the
//                                 job stops as above rather than train on unwatched
//
// launch exits with mpirun's status: 0, or the status of the lowest rank that exited
// non-zero; where a signal ended a rank or mpirun, it says what that leaves on disk.
//
// Start-up: mpirun passes SIGUSR1 only to the ranks it has started, and a rank that has not
// yet installed its handlers dies of it. So a stop asked before every rank of a `train` job
// is up is held: after one barrier (past every rank's handlers) each rank on launch's
// machine creates the file MESHTRAIN_LAUNCH_READY names (in a directory of launch's own),
// and the request goes out then, or kReadyWaitS after the start at the latest (where no rank
// runs on launch's machine, no file comes).
//
// Session directory: mpirun keeps its files under TMPDIR/ompi.<host>.<uid>, one directory
// that every mpirun of the user on the machine creates and the last to end removes; two
// started in the same instant can race there and one fails before any rank starts ("mkdir
// ... File exists", orte_init failed). On one machine launch points mpirun at a directory
// of its own instead (OMPI_MCA_orte_tmpdir_base, unless the user set it) and removes it
// whole afterwards, with whatever an mpirun killed hard left there. A launch killed outright
// cannot: the next launch removes the directories whose launch (host and pid in their
// `owner` file) is gone.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

namespace mt {

namespace {

static_assert(std::atomic<pid_t>::is_always_lock_free);  // read in a signal handler
static_assert(std::atomic<bool>::is_always_lock_free);
std::atomic<pid_t> g_mpirun{0};
std::atomic<bool> g_stop_asked{false};  // SIGTERM or SIGUSR1 not yet passed on (the wait loop does)

constexpr double kReadyWaitS = 30;
constexpr int kHandled[] = {SIGTERM, SIGUSR1, SIGHUP, SIGINT};
constexpr char kReadyEnv[] = "MESHTRAIN_LAUNCH_READY", kHostEnv[] = "MESHTRAIN_LAUNCH_HOST";

std::atomic<bool> g_interrupted{false};  // SIGINT passed on

void on_signal(int sig) {
  const pid_t pid = g_mpirun.load();
  if (pid <= 0) return;
  if (sig == SIGINT) kill(pid, SIGINT), g_interrupted = true;
  else g_stop_asked = true;
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// The directories of earlier launches on this machine in `tmp` that are gone (killed
// outright): this user's, with an owner file naming this host and a process that no longer
// exists. One without the file (being made, or another's) is left.
void remove_abandoned(const std::string& tmp) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string host = host_name();
  for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path d = it->path();
    struct stat st {};
    if (d.filename().string().rfind("meshtrain-launch-", 0) != 0 || lstat(d.c_str(), &st) != 0 ||
        !S_ISDIR(st.st_mode) || st.st_uid != geteuid())
      continue;
    std::ifstream owner(d / "owner");
    std::string owner_host;
    long pid = 0;
    if (!(owner >> owner_host >> pid) || owner_host != host || pid <= 0) continue;
    if (kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) {
      std::error_code rm;
      fs::remove_all(d, rm);
    }
  }
}

// A fresh directory only launch's user can write (so no other user's file or link can
// stand in for the ranks' ready file or mpirun's session), removed whole when launch ends;
// its owner file (host, launch's pid) lets a later launch remove it if this one is killed.
struct LaunchDir {
  std::string dir;
  LaunchDir() {
    const char* env = std::getenv("TMPDIR");
    const std::string tmp = env && *env ? env : "/tmp";
    remove_abandoned(tmp);
    dir = tmp + "/meshtrain-launch-XXXXXX";
    MT_CHECK(mkdtemp(dir.data()), "launch: cannot create a directory " << dir << " (" << std::strerror(errno)
                                                                       << "); set TMPDIR to a writable directory");
    std::ofstream(dir + "/owner") << host_name() << " " << getpid() << "\n";
  }
  ~LaunchDir() {
    std::error_code ec;  // a failure leaves a directory in TMPDIR behind, nothing else
    std::filesystem::remove_all(dir, ec);
  }
};

// Waits for mpirun `pid` to exit, passing stop requests on as SIGUSR1 once the ranks are up
// (ready_file empty: at once).
void wait_forwarding(pid_t pid, const std::string& ready_file) {
  const auto start = std::chrono::steady_clock::now();
  bool ready = ready_file.empty(), held_noted = false;
  for (;;) {
    siginfo_t info;
    info.si_pid = 0;
    if (waitid(P_PID, pid, &info, WEXITED | WNOWAIT | WNOHANG) == 0) {
      if (info.si_pid == pid) return;
    } else {
      MT_CHECK(errno == EINTR, "launch: cannot wait for mpirun: " << std::strerror(errno));
    }
    if (!ready) {
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      ready = access(ready_file.c_str(), F_OK) == 0 || waited.count() > kReadyWaitS;
    }
    if (ready && g_stop_asked.exchange(false)) {
      std::fprintf(stderr, "meshtrain launch: asking every rank to stop after its current step (sent to mpirun as "
                           "SIGUSR1)\n");
      kill(pid, SIGUSR1);
    } else if (!ready && g_stop_asked && !held_noted) {
      std::fprintf(stderr, "meshtrain launch: the ranks are starting; the stop goes to them once they are up\n");
      held_noted = true;
    }
    const timespec tick{0, 20'000'000};  // a signal cuts it short
    nanosleep(&tick, nullptr);
  }
}

// Starts mpirun with argv, its signal mask `mask` and default actions for the signals
// launch handles; it gets SIGUSR1 if launch dies first (a stop, as above). Returns its pid.
pid_t start_mpirun(std::vector<std::string>& argv, const sigset_t& mask) {
  std::vector<char*> cargv;
  for (std::string& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  int report[2];  // the child's exec error, if any; closed on a successful exec
  MT_CHECK(pipe2(report, O_CLOEXEC) == 0, "launch: cannot create a pipe: " << std::strerror(errno));
  const pid_t parent = getpid(), pid = fork();
  MT_CHECK(pid >= 0, "launch: cannot start mpirun: " << std::strerror(errno));
  if (pid == 0) {  // the child: only async-signal-safe calls until exec
    close(report[0]);
    prctl(PR_SET_PDEATHSIG, SIGUSR1);
    if (getppid() != parent) kill(getpid(), SIGUSR1);  // launch already gone
    for (int sig : kHandled) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &mask, nullptr);
    execvp("mpirun", cargv.data());
    const int err = errno;
    (void)!write(report[1], &err, sizeof err);
    _exit(127);
  }
  close(report[1]);
  int err = 0;
  ssize_t got;
  while ((got = read(report[0], &err, sizeof err)) < 0 && errno == EINTR) {
  }
  close(report[0]);
  if (got == static_cast<ssize_t>(sizeof err)) {
    waitpid(pid, nullptr, 0);
    MT_CHECK(false, "launch: cannot run mpirun (" << std::strerror(err)
                                                  << "); install Debian's openmpi-bin (scripts/setup.sh does)");
  }
  return pid;
}

// What a job ended by a signal leaves: launch says it, since a rank killed hard says nothing.
void say_how_it_ended(int status) {
  if (g_interrupted)
    std::fprintf(stderr, "meshtrain launch: interrupted (SIGINT): mpirun ended the job at once. Checkpoints written "
                         "before stay intact (a save cut short leaves only a .tmp- directory, removed at the next "
                         "start); resume with --checkpoint.resume=true\n");
  else if (status > 128)
    std::fprintf(stderr, "meshtrain launch: the job ended by signal %d (%s) of a rank or mpirun. Checkpoints "
                         "written before stay intact; resume with --checkpoint.resume=true\n",
                 status - 128, strsignal(status - 128));
}

// Runs mpirun with argv, forwarding signals as described above; returns its exit status
// (128 + the signal if a signal ended it, as shells report; 130 after SIGINT).
int mpirun_forwarding(std::vector<std::string>& argv, const std::string& ready_file) {
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : kHandled) sigaddset(&block, sig);
  // Blocked until mpirun's pid is known and the handlers are in place: a signal arriving
  // meanwhile waits and is forwarded then. mpirun starts with the old mask and defaults.
  sigprocmask(SIG_BLOCK, &block, &old);
  pid_t pid = 0;
  try {
    pid = start_mpirun(argv, old);
  } catch (...) {
    sigprocmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  g_mpirun = pid;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int sig : kHandled) sigaction(sig, &sa, nullptr);
  sigprocmask(SIG_SETMASK, &old, nullptr);
  wait_forwarding(pid, ready_file);
  g_mpirun = 0;  // before reaping it: until then its pid cannot be another process's
  int status = 0;
  waitpid(pid, &status, 0);
  status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  say_how_it_ended(status);
  return g_interrupted ? 128 + SIGINT : status;
}

}  // namespace

int cmd_launch(const std::vector<std::string>& args, const char* self) {
  int n = 0;
  bool hostfile = false, other_hosts = false;
  std::vector<std::string> mpi_opts, rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!rest.empty() || args[i].rfind("-", 0) != 0) {  // the meshtrain command and its options
      rest.push_back(args[i]);
      continue;
    }
    // An option's value: after '=' (passed to mpirun as the next argument: Open MPI 4 takes
    // no --option=value), or the next argument.
    std::string a = args[i], v;
    bool has_value = false;
    if (const size_t eq = a.find('='); eq != std::string::npos) v = a.substr(eq + 1), a.resize(eq), has_value = true;
    if (a == "-n" || a == "-np") {
      MT_CHECK(has_value || i + 1 < args.size(), "launch: " << a << " needs a number of ranks");
      if (!has_value) v = args[++i];
      char* end = nullptr;
      errno = 0;
      const long ranks = std::strtol(v.c_str(), &end, 10);
      MT_CHECK(end != v.c_str() && *end == '\0' && errno == 0 && ranks >= 1 && ranks <= INT_MAX,
               "launch: " << a << " " << v << " is not a number of ranks; give a whole number from 1, "
                          << "e.g. meshtrain launch -n 2 train");
      n = static_cast<int>(ranks);
      continue;
    }
    if (a == "--help" || a == "-h") {
      std::printf("usage: meshtrain launch -n N [--hostfile FILE] [other mpirun options] train [--section.key=value ...]\n"
                  "starts N ranks with mpirun; each takes its machine's cores / the ranks on it as threads (at least\n"
                  "1), unless OMP_NUM_THREADS or training.threads says\n"
                  "SIGTERM, SIGUSR1 or SIGHUP to launch: every rank stops after its current step and saves a\n"
                  "checkpoint (exit status 75), as when launch itself is killed; SIGINT (Ctrl-C): the job ends at\n"
                  "once (exit status 130)\n");
      return 0;
    }
    // an mpirun option's value follows it unless it starts with '-'
    const bool flag = a == "--oversubscribe" || a == "--allow-run-as-root" || a == "--tag-output" ||
                      a == "--report-bindings";
    if (!has_value && !flag && i + 1 < args.size() && args[i + 1].rfind("-", 0) != 0) v = args[++i], has_value = true;
    other_hosts = other_hosts || a == "--host" || a == "-host" || a == "-H";
    if (a == "--hostfile" || a == "-hostfile" || a == "--machinefile" || a == "-machinefile") {
      hostfile = other_hosts = true;
      // mpirun's own refusal of a missing file ends in "an internal error ... should be reported"
      MT_CHECK(has_value && !v.empty(), "launch: " << a << " needs a file of host names");
      MT_CHECK(std::filesystem::is_regular_file(v) && access(v.c_str(), R_OK) == 0,
               "launch: " << a << " " << v << " is not a readable file; give mpirun's host file (one host "
                          << "per line, e.g. 'node1 slots=8')");
    }
    mpi_opts.push_back(a);
    if (has_value) mpi_opts.push_back(v);
  }
  MT_CHECK(n >= 1, "launch: give the number of ranks, e.g. meshtrain launch -n 2 train");
  MT_CHECK(!rest.empty(), "launch: give the command to run, e.g. meshtrain launch -n " << n << " train");
  // Checked here, not by every rank after mpirun started them all.
  MT_CHECK(rest[0] == "train" || rest[0] == "bench", "launch: \"" << rest[0] << "\" is not a command launch runs; "
                                                     << "use train or bench, e.g. meshtrain launch -n " << n
                                                     << " train");

  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::string> argv = {"mpirun", "-n", std::to_string(n), "--bind-to", "none"};
  if (!hostfile && static_cast<unsigned>(n) > cores) argv.push_back("--oversubscribe");
  if (geteuid() == 0) {
    std::fprintf(stderr, "meshtrain launch: warning: running MPI ranks as root\n");
    argv.push_back("--allow-run-as-root");
  }
  // Each rank takes its threads from the ranks on its machine (cli/main.cpp) unless the user
  // set OMP_NUM_THREADS, which goes to every machine.
  if (std::getenv("OMP_NUM_THREADS")) argv.insert(argv.end(), {"-x", "OMP_NUM_THREADS"});
  if (!std::getenv("OMP_WAIT_POLICY")) setenv("OMP_WAIT_POLICY", "passive", 1);  // ranks share cores with comm threads
  argv.insert(argv.end(), {"-x", "OMP_WAIT_POLICY"});
  const LaunchDir own;
  // Where ranks start on other machines, this directory is not there; mpirun would make one
  // on each and leave it.
  if (!other_hosts && !std::getenv("OMPI_MCA_orte_tmpdir_base")) setenv("OMPI_MCA_orte_tmpdir_base", own.dir.c_str(), 1);
  const bool train = rest[0] == "train";  // the one command that installs stop handlers
  const std::string ready_file = train ? own.dir + "/ready" : "";
  if (train) {
    setenv(kReadyEnv, ready_file.c_str(), 1);
    setenv(kHostEnv, host_name().c_str(), 1);
    for (const char* v : {kReadyEnv, kHostEnv}) argv.insert(argv.end(), {"-x", v});
  }
  argv.insert(argv.end(), mpi_opts.begin(), mpi_opts.end());
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  argv.push_back(len > 0 ? std::string(exe, len) : std::string(self));
  argv.insert(argv.end(), rest.begin(), rest.end());
  return mpirun_forwarding(argv, ready_file);
}

void launch_ready_announce(Communicator& world) {
  const char *path = std::getenv(kReadyEnv), *host = std::getenv(kHostEnv);
  if (!path || !host) return;  // not started by launch
  world.barrier();  // every rank is past stop_signals_install
  if (host_name() != host) return;
  const int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd >= 0) close(fd);
}

}  // namespace mt
