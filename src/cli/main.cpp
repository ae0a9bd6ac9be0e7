// The meshtrain command.
//
//   meshtrain train [--config FILE.toml] [--section.key=value ...]   train a model
//   meshtrain launch -n N [mpirun options] train ...                 the same on N ranks
//   meshtrain prepare --input text.txt --out tokens.bin [...]        text -> token file
//   meshtrain export --checkpoint DIR --out model.safetensors        Hugging Face weights
//   meshtrain sample --checkpoint DIR [--prompt TEXT] [...]          generate text
//   meshtrain bench comm [...]                                       collective bandwidth
//   meshtrain bench profile [--out FILE.toml] [--seconds S]          this machine as a hardware profile
//   meshtrain schedule --pp 4 --microbatches 8 --schedule zb-h1      pipeline schedule: bubble, picture
//   meshtrain plan --config m.toml --gpus 64 --hardware h100         layouts ranked by predicted step time
//   meshtrain checkpoint info DIR [--json]                          what a checkpoint holds; CRC checks
//
// Started by mpirun or srun (or `meshtrain launch`), train and bench run as ranks of one
// job: rank 0 prints, the others speak only to report errors.
//
// Exit status: 0 done; 1 an error (the message names it); 75 (kExitStopped) train stopped
// early by SIGTERM or SIGUSR1 after writing a checkpoint: rerun with checkpoint.resume=true.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "cli/commands.h"                     // cmd_launch, cmd_bench_comm, cmd_bench_profile, cmd_schedule, cmd_checkpoint
#include "comm/mpi_comm.h"                    // MpiRuntime, mpi_launched
#include "core/error.h"                       // mt::Error: every user-facing failure
#include "core/machine.h"                     // threads_per_rank
#include "data/token_file.h"                  // token_file_write
#include "data/tokenizer.h"                   // tokenizer_make, sentencepiece_train
#include "nn/hf.h"                            // hf_export
#include "ops/gemm.h"                         // blas_use_the_cpus_kernels
#include "train/checkpoint.h"                 // checkpoint_latest, checkpoint_load
#include "train/config.h"                     // config_load, config_keys
#include "train/metrics.h"                    // output_parent_create
#include "train/sample.h"                     // sample_text
#include "train/start_checks.h"               // output_paths_check
#include "train/stop.h"                       // stop_signals_install, kExitStopped
#include "train/trainer.h"                    // train

namespace {

// Parses `train`'s options into a configuration; train() resolves its layout.
mt::Config train_config(const std::vector<std::string>& args, bool* help) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *help = true;
      return {};
    }
    MT_CHECK(a.rfind("--", 0) == 0, "unexpected argument \"" << a << "\"; options look like --training.steps=100");
    std::string body = a.substr(2);
    std::string value;
    size_t eq = body.find('=');
    if (eq == std::string::npos) {
      MT_CHECK(i + 1 < args.size(), "option --" << body << " needs a value: --" << body << "=VALUE");
      value = args[++i];
    } else {
      value = body.substr(eq + 1);
      body = body.substr(0, eq);
    }
    // A second file would replace the first's keys silently (or half of them): one file.
    MT_CHECK(body != "config" || config_path.empty(),
             "--config given twice (" << config_path << " and " << value << "): train reads one configuration "
                                      << "file; merge them into one, or give the second's keys as --section.key=value");
    if (body == "config") config_path = value;
    else overrides.push_back(body + "=" + value);
  }
  return mt::config_load(config_path, overrides);
}

// A default as written: 1e-05, not the float's 9.999999747378752e-06.
std::string default_text(const nlohmann::json& v) {
  if (!v.is_number_float()) return v.dump();
  char num[32];
  std::snprintf(num, sizeof num, "%g", v.get<double>());
  return num;
}

void print_train_help() {
  std::printf("usage: meshtrain train [--config FILE.toml] [--section.key=value ...]\n\nkeys (defaults):\n");
  mt::Config llama;
  llama.model.family = "llama";
  const nlohmann::json j = mt::config_to_json(mt::Config{}), jl = mt::config_to_json(llama);
  for (const std::string& k : mt::config_keys()) {
    std::string sec = k.substr(0, k.find('.')), key = k.substr(k.find('.') + 1);
    std::string shown = default_text(j[sec][key]);
    // A default that follows model.family (model.tie_embeddings) is shown for each family.
    if (k != "model.family" && jl[sec][key] != j[sec][key])
      shown = "family default: gpt2 " + shown + ", llama " + default_text(jl[sec][key]);
    std::printf("  %-34s %s\n", k.c_str(), shown.c_str());
  }
}

// Runs train or bench as one rank of a job (or alone).
int run_as_rank(const std::string& cmd, const std::vector<std::string>& args, int* argc, char*** argv) {
  if (cmd == "train") mt::stop_signals_install();  // SIGTERM, SIGUSR1: stop after the current step
  std::optional<mt::MpiRuntime> mpi;
  std::unique_ptr<mt::Communicator> world;
  try {
    if (mt::mpi_launched()) {
      mpi.emplace(argc, argv);
      world = mpi->world();
    } else {
      world = mt::comm_local();
    }
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "meshtrain: error: %s\n", e.what());
    return 1;
  }
  // Threads where OMP_NUM_THREADS does not say (mpirun or srun started the ranks, or launch
  // across machines): this machine's CPUs shared among the job's ranks on it.
  if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(mt::threads_per_rank(world->ranks_on_node()));
  if (cmd == "train") mt::launch_ready_announce(*world);  // launch may pass stop requests on now
  const bool lead = world->rank() == 0;
  mt::Config cfg;
  if (cmd == "train") {
    // Configuration errors, said once by rank 0. The ranks read the same files and usually
    // reach the same verdict; where they do not (a relative path in different working
    // directories), they agree on the lowest rank's, so none waits in a collective. train()
    // checks the layout, checkpoint.dir and the outputs before any work in the same way.
    std::string problem;
    bool help = false;
    try {
      cfg = train_config(args, &help);
    } catch (const std::exception& e) {
      problem = e.what();
    }
    problem = mt::first_problem(*world, problem);
    if (!problem.empty()) {
      if (lead) std::fprintf(stderr, "meshtrain: error: %s\n", problem.c_str());
      return 1;
    }
    if (help) {
      if (lead) print_train_help();
      return 0;
    }
  }
  // From here on a failure may be one rank's alone: it names its rank and ends the job;
  // one the ranks agreed on (AgreedError) is said once.
  try {
    if (cmd == "train") {
      if (lead) mt::stop_notes_enable();
      return mt::train(cfg, *world).stopped_by ? mt::kExitStopped : 0;
    }
    if (!args.empty() && args[0] == "profile") return mt::cmd_bench_profile({args.begin() + 1, args.end()}, *world);
    if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
      if (lead)
        std::printf("usage: meshtrain launch -n N bench comm [--help]     collective bandwidth between the ranks\n"
                    "       meshtrain bench profile --out FILE.toml [--help]  this machine's hardware profile\n"
                    "step benchmarks (against PyTorch) are the scripts in bench/\n");
      return 0;
    }
    MT_CHECK(!args.empty() && args[0] == "comm",
             "bench: the benchmarks are `comm` (meshtrain launch -n 2 bench comm) and `profile` (meshtrain bench "
             "profile --out FILE.toml); step benchmarks are in bench/");
    return mt::cmd_bench_comm({args.begin() + 1, args.end()}, *world);
  } catch (const mt::AgreedError& e) {
    if (lead) std::fprintf(stderr, "meshtrain: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    if (world->size() > 1) {
      std::fprintf(stderr, "meshtrain: rank %d: error: %s\n", world->rank(), e.what());
      std::fflush(stderr);
      world->abort_job(1);
    }
    std::fprintf(stderr, "meshtrain: error: %s\n", e.what());
    return 1;
  }
}

// meshtrain prepare: every option is checked before the (possibly long) tokenizer training,
// and the text must be a readable regular file with at least one token: fopen opens a
// directory, whose read fails, which would write an empty token file. tokenizer_given: the
// command line named --tokenizer, which --train-tokenizer would replace by the model it trains.
void run_prepare(const std::string& input, const std::string& out, const std::string& val_out, std::string tokenizer,
                 bool tokenizer_given, std::string sp_prefix, double val_fraction, int sp_vocab) {
  MT_CHECK(!tokenizer_given || sp_vocab == 0,
           "--tokenizer " << tokenizer << " and --train-tokenizer " << sp_vocab << " cannot go together: "
                          << "--train-tokenizer trains a new SentencePiece model and tokenizes with it. Drop "
                          << "--train-tokenizer (and --tokenizer-prefix) to tokenize with " << tokenizer
                          << ", or drop --tokenizer to train a new model");
  MT_CHECK(sp_vocab == 0 || (sp_vocab >= 260 && sp_vocab <= (1 << 24)),
           "--train-tokenizer " << sp_vocab << " must be a vocabulary size from 260 (256 byte pieces, <unk>, <s>, </s> "
                                << "and one merged piece) to 16777216");
  MT_CHECK(sp_prefix.empty() || sp_vocab > 0, "--tokenizer-prefix " << sp_prefix << " needs --train-tokenizer N (the "
                                              << "vocabulary size of the model to train), or leave it out");
  std::error_code ec;
  MT_CHECK(std::filesystem::is_regular_file(input, ec),
           "--input " << input << " is " << (std::filesystem::exists(input, ec) ? "not a regular file" : "not there")
                      << ": give the path of a UTF-8 text file");
  MT_CHECK(val_fraction >= 0 && val_fraction < 1, "--val-fraction " << val_fraction << " must be in [0, 1)");
  MT_CHECK(val_fraction == 0 || !val_out.empty(), "--val-fraction needs --val-out FILE");
  MT_CHECK(val_out.empty() || val_fraction > 0, "--val-out " << val_out << " needs --val-fraction F (the tail of "
                                                << "the tokens to write there, e.g. 0.05); or leave out --val-out");
  if (sp_vocab > 0 && sp_prefix.empty()) sp_prefix = out + ".spm";
  MT_CHECK(sp_prefix.empty() || sp_prefix.back() != '/',
           "--tokenizer-prefix " << sp_prefix << " names a directory; give a path and a name for the model's two "
                                 << "files, e.g. " << sp_prefix << "tok (tok.model, tok.vocab)");
  // The token files are written beside and renamed into place, the tokenizer's by SentencePiece:
  // none may be a device, FIFO or directory, and each is tried before the tokenizer trains.
  const std::string out_file = mt::output_replaceable(out, "--out");
  const std::string val_file = val_out.empty() ? "" : mt::output_replaceable(val_out, "--val-out");
  if (sp_vocab > 0)
    for (const char* ext : {".model", ".vocab"}) mt::output_replaceable(sp_prefix + ext, "--tokenizer-prefix");
  // No output may replace the text, the tokenizer or another output (the text would be
  // read, then replaced by its tokens).
  std::vector<mt::NamedPath> outputs = {{"--out", out, ""}, {"--val-out", val_out, ""}};
  if (sp_vocab > 0)
    for (const char* ext : {".model", ".vocab"}) outputs.push_back({"--tokenizer-prefix", sp_prefix, sp_prefix + ext});
  mt::output_paths_check(outputs, {{"--input", input, ""}, {"--tokenizer", tokenizer == "byte" ? "" : tokenizer, ""}});
  mt::output_try(out_file, "--out");
  if (!val_file.empty()) mt::output_try(val_file, "--val-out");
  if (sp_vocab > 0) {
    mt::output_parent_create(sp_prefix, "--tokenizer-prefix");
    mt::sentencepiece_train(input, sp_prefix, sp_vocab);
    tokenizer = sp_prefix + ".model";
  }
  std::unique_ptr<mt::Tokenizer> tok;
  try {
    tok = mt::tokenizer_make(tokenizer);
  } catch (const mt::Error& e) {
    MT_FAIL((sp_vocab > 0 ? "the trained tokenizer: " : "--tokenizer " + tokenizer + ": ") << e.what());
  }
  if (sp_vocab > 0) {  // a small text supports fewer pieces than asked: the model's own count
    std::printf("trained SentencePiece model %s (vocabulary %d", tokenizer.c_str(), tok->vocab_size());
    if (tok->vocab_size() < sp_vocab)
      std::printf(", fewer than the %d asked: the text supports no more pieces", sp_vocab);
    std::printf(")\n");
  }
  FILE* f = std::fopen(input.c_str(), "rb");
  MT_CHECK(f, "cannot open --input " << input << ": " << std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f);
  std::fclose(f);
  MT_CHECK(!failed, "cannot read --input " << input << ": " << std::strerror(errno));
  std::vector<int32_t> ids = tok->encode(text);
  MT_CHECK(!ids.empty(), "--input " << input << " holds no text (0 tokens); give a text file to tokenize");
  if (val_fraction > 0) {
    const size_t n_val = static_cast<size_t>(static_cast<double>(ids.size()) * val_fraction);
    MT_CHECK(n_val > 0, "--val-fraction " << val_fraction << " of the " << ids.size() << " tokens of " << input
                                          << " holds out none; use a larger --val-fraction or a longer --input");
    std::vector<int32_t> val(ids.end() - static_cast<std::ptrdiff_t>(n_val), ids.end());
    ids.resize(ids.size() - n_val);
    mt::token_file_write(val_file, val);
    std::printf("wrote %zu validation token%s to %s\n", val.size(), val.size() == 1 ? "" : "s", val_out.c_str());
  }
  mt::token_file_write(out_file, ids);
  std::printf("wrote %zu token%s to %s (vocabulary %d: set model.vocab_size >= %d)\n", ids.size(),
              ids.size() == 1 ? "" : "s", out.c_str(), tok->vocab_size(), tok->vocab_size());
}

// meshtrain export: checkpoint (a directory, or checkpoint.dir: its latest) to a safetensors
// file, or to model.safetensors and config.json in a directory (one there, or asked for
// with a final /).
void run_export(const std::string& ckpt, const std::string& exp_out) {
  std::error_code ec;
  MT_CHECK(!exp_out.empty(), "--out is empty; give the path of the safetensors file to write, or a directory");
  const bool to_dir = std::filesystem::is_directory(exp_out, ec) || exp_out.back() == '/';
  const std::filesystem::path file =
      to_dir ? std::filesystem::path(exp_out) / "model.safetensors" : std::filesystem::path(exp_out);
  MT_CHECK(!std::filesystem::is_directory(file, ec),  // before the parameters are read: the rename would fail
           "--out " << exp_out << ": " << file.string() << " is a directory; give the path of the safetensors "
                    << "file to write, or a directory to write it into");
  // Not into a checkpoint, the one read or another: its shards and meta.json are its state.
  std::vector<mt::NamedPath> outputs = {{"--out", exp_out, file.string()}};
  if (to_dir) outputs.push_back({"--out", exp_out, (file.parent_path() / "config.json").string()});
  mt::output_paths_check(outputs, {{"--checkpoint", ckpt, ""}});
  // Both written beside and renamed into place: neither may be a device, FIFO or directory,
  // and both are tried before the parameters are read.
  const std::string file_out = mt::output_replaceable(file.string(), "--out");
  const std::filesystem::path json = to_dir ? mt::output_replaceable((file.parent_path() / "config.json").string(), "--out") : "";
  const std::string dir = mt::checkpoint_given(ckpt, "pass a checkpoint directory or checkpoint.dir");
  mt::output_try(file_out, "--out");
  if (to_dir) mt::output_try(json.string(), "--out");
  mt::Config cfg = mt::checkpoint_config(dir);
  const std::vector<mt::Unit> layout = mt::model_layout(cfg.model);
  // Streams unit by unit: only one unit's parameters are in memory at a time.
  std::vector<float> buf;
  auto fetch = [&](int u) -> const float* {
    buf.assign(layout[u].numel, 0.0f);
    mt::checkpoint_load(dir, cfg.model, {{layout[u].name, 0, layout[u].numel, {{"params", buf.data()}}}});
    return buf.data();
  };
  mt::hf_export(cfg.model, layout, fetch, file_out);
  if (to_dir) {  // written beside, then renamed into place, as the safetensors file is
    const std::filesystem::path tmp = json.string() + ".tmp";
    std::ofstream(tmp) << mt::hf_config_json(cfg.model);
    std::filesystem::rename(tmp, json, ec);
    std::error_code gone;
    if (ec) std::filesystem::remove(tmp, gone);
    MT_CHECK(!ec, "--out " << exp_out << ": cannot write " << json.string() << ": " << ec.message());
  }
  std::printf("exported %s to %s%s\n", dir.c_str(), file.string().c_str(), to_dir ? " and config.json" : "");
}

// CLI11's words for a command line it cannot take, in meshtrain's: "Could not convert:
// --top = x" says what --top takes; "--input: 1 required TEXT missing" that it needs a value.
std::string parse_error_text(const CLI::App& app, const CLI::ParseError& e) {
  std::string text = e.what();
  std::smatch m;
  if (std::regex_match(text, m, std::regex(R"(Could not convert: (\S+) = (.*))"))) {
    std::string kind = "a value of its kind";
    for (const CLI::App* sub : app.get_subcommands()) {
      if (const CLI::Option* opt = sub->get_option_no_throw(m[1].str())) {
        const std::string type = opt->get_type_name();
        kind = type == "INT" ? "an integer in the option's range" : type == "UINT" ? "an integer of at least 0 in the "
             "option's range" : type == "FLOAT" ? "a number" : kind;
      }
    }
    return m[1].str() + " " + m[2].str() + " is not " + kind;
  }
  if (std::regex_match(text, m, std::regex(R"((\S+): \d+ required \S+ missing)"))) return m[1].str() + " needs a value";
  if (std::regex_match(text, m, std::regex(R"((\S+): At Most 1 required but received (\d+))")))
    return m[1].str() + " is given " + m[2].str() + " times; give it once";
  // "The following argument was not expected: x" goes on after "error: ", in lower case.
  const auto c = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  if (text.size() > 1 && std::isupper(c(0)) && std::islower(c(1))) text[0] = static_cast<char>(std::tolower(c(0)));
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  mt::blas_use_the_cpus_kernels(argv);  // before any thread or MPI starts
  try {
    const std::string cmd = argc >= 2 ? argv[1] : "";
    if (cmd == "train" || cmd == "bench") return run_as_rank(cmd, std::vector<std::string>(argv + 2, argv + argc), &argc, &argv);
    if (cmd == "launch") return mt::cmd_launch(std::vector<std::string>(argv + 2, argv + argc), argv[0]);

    CLI::App app{"meshtrain: train transformer language models (see README.md)"};
    app.require_subcommand(1);
    app.add_subcommand("train", "train a model: meshtrain train [--config FILE.toml] [--section.key=value ...]");
    app.add_subcommand("launch", "run on N ranks: meshtrain launch -n N [mpirun options] train ...");
    app.add_subcommand("bench", "meshtrain launch -n N bench comm | profile: collective bandwidth; this machine's "
                              "hardware profile");

    auto* prep = app.add_subcommand("prepare", "tokenize a text file into a token file");
    std::string input, out = "tokens.bin", val_out, tokenizer = "byte", sp_prefix;
    double val_fraction = 0;
    int sp_vocab = 0;
    prep->add_option("--input", input, "UTF-8 text file")->required();
    prep->add_option("--out", out, "token file to write")->capture_default_str();
    prep->add_option("--tokenizer", tokenizer, "byte, or a SentencePiece .model file")->capture_default_str();
    prep->add_option("--train-tokenizer", sp_vocab, "first train a SentencePiece model with this vocabulary size");
    prep->add_option("--tokenizer-prefix", sp_prefix, "where the trained model goes (<prefix>.model)");
    prep->add_option("--val-fraction", val_fraction, "tail of the tokens to write to --val-out instead");
    prep->add_option("--val-out", val_out, "validation token file");

    auto* exp = app.add_subcommand("export", "write a checkpoint's parameters as a Hugging Face safetensors file");
    std::string ckpt, exp_out;
    exp->add_option("--checkpoint", ckpt, "checkpoint directory (or checkpoint.dir: the latest)")->required();
    exp->add_option("--out", exp_out,
                    "safetensors file to write, or a directory (existing, or written with a final /) to get "
                    "model.safetensors and config.json for transformers' from_pretrained")
        ->required();

    auto* smp = app.add_subcommand("sample", "generate text from a checkpoint");
    mt::SampleOptions so;
    smp->add_option("--checkpoint", so.checkpoint, "checkpoint directory (or checkpoint.dir: the latest)")->required();
    smp->add_option("--prompt", so.prompt, "text to continue");
    smp->add_option("--tokens", so.max_tokens, "tokens to generate")->capture_default_str();
    smp->add_option("--temperature", so.temperature, "0 for greedy")->capture_default_str();
    smp->add_option("--top-k", so.top_k, "sample among the k likeliest (0: all)")->capture_default_str();
    smp->add_option("--top-p", so.top_p,
                    "then among the fewest of those whose probabilities sum to at least p (1: all of them)")
        ->capture_default_str();
    // CLI11 takes -5 for an unsigned option as 2^64 - 5, and more than 2^64 - 1 without a word
    const CLI::Validator seed_range(
        [](std::string& v) -> std::string {
          char* end = nullptr;
          errno = 0;
          std::strtoull(v.c_str(), &end, 10);
          const bool whole = !v.empty() && std::isdigit(static_cast<unsigned char>(v[0])) && *end == '\0';
          return whole && errno == 0 ? "" : v + " is not a whole number from 0 to 18446744073709551615";
        },
        "0..2^64-1");
    smp->add_option("--seed", so.seed, "the sampler's seed: the same seed, the same text")
        ->check(seed_range)
        ->capture_default_str();
    smp->add_option("--tokenizer", so.tokenizer, "byte or a .model file (default: the checkpoint's)");
    smp->add_option("--samples", so.samples, "continuations drawn side by side, printed when all are done")
        ->capture_default_str();

    auto* sched = app.add_subcommand("schedule", "simulate a pipeline schedule: timeline, bubble, activations held");
    mt::ScheduleOptions sched_opts;
    mt::schedule_options_add(sched, &sched_opts);

    auto* ckpt_cmd = app.add_subcommand("checkpoint", "inspect a checkpoint: meshtrain checkpoint info DIR [--json]");
    mt::CheckpointOptions ckpt_opts;
    mt::checkpoint_options_add(ckpt_cmd, &ckpt_opts);

    auto* plan_cmd = app.add_subcommand("plan", "memory, bytes and step time of layouts on a cluster; the one to use");
    mt::PlanOptions plan_opts;
    mt::plan_options_add(plan_cmd, &plan_opts);

    // CLI11 says only "A subcommand is required" for a word it does not know: name it.
    std::string names;
    bool known = cmd.empty() || cmd[0] == '-';
    const std::vector<CLI::App*> commands = app.get_subcommands([](CLI::App*) { return true; });
    for (size_t i = 0; i < commands.size(); ++i) {
      const std::string& name = commands[i]->get_name();
      names += (i == 0 ? "" : i + 1 == commands.size() ? " and " : ", ") + name;
      known = known || name == cmd;
    }
    MT_CHECK(known, "\"" << cmd << "\" is not a meshtrain command; the commands are " << names << " (meshtrain --help)");
    MT_CHECK(cmd != "checkpoint" || argc < 3 || argv[2][0] == '-' || std::string(argv[2]) == "info",
             "checkpoint: \"" << argv[2] << "\" is not a checkpoint command; use meshtrain checkpoint info DIR [--json]");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return app.exit(e);  // --help
      MT_FAIL(parse_error_text(app, e) << "; see meshtrain " << cmd << (cmd == "checkpoint" ? " info" : "") << " --help");
    }

    if (prep->parsed()) {
      run_prepare(input, out, val_out, tokenizer, prep->count("--tokenizer") > 0, sp_prefix, val_fraction, sp_vocab);
    } else if (exp->parsed()) {
      run_export(ckpt, exp_out);
    } else if (smp->parsed()) {
      mt::SampleStats st;
      const std::vector<std::string> texts = mt::sample_text(
          so,
          [](const std::string& piece) {  // one sample: shown as it is generated
            std::fwrite(piece.data(), 1, piece.size(), stdout);
            std::fflush(stdout);
          },
          &st);
      for (size_t i = 0; i < texts.size() && texts.size() > 1; ++i) {
        std::printf("%s--- sample %zu of %zu ---\n", i ? "\n" : "", i + 1, texts.size());
        std::fwrite(texts[i].data(), 1, texts[i].size(), stdout);
      }
      std::printf("\n");
      std::fflush(stdout);
      std::fprintf(stderr, "%s\n", mt::sample_summary(st).c_str());  // after the text, apart from it
    } else if (sched->parsed()) {
      return mt::cmd_schedule(sched_opts);
    } else if (ckpt_cmd->parsed()) {
      return mt::cmd_checkpoint(ckpt_opts);
    } else if (plan_cmd->parsed()) {
      return mt::cmd_plan(plan_opts);
    }
    return 0;
  } catch (const mt::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "meshtrain: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "meshtrain: internal error: %s\n", e.what());
    return 2;
  }
}
