// What reads a checkpoint refuses, with a message that names the problem and what to do,
// and leaves the checkpoints on disk as they are: a step directory whose name disagrees
// with its meta.json's step (a copy under another name), a damaged newest one that export
// and sample would pass over, model settings that disagree with the tensor table, text
// after meta.json's object, an empty or garbled meta.json, the advice about a damaged
// checkpoint (restore it first; none earlier left), a save that cannot write its temporary
// directory, and a resume of a checkpoint at or past training.steps.
#include <signal.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train/checkpoint.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

// Byte ids 1 and 2, inside the test models' 37 ids: sample checks the prompt before it
// loads, so the damage is what it meets.
const std::string kPrompt = " --prompt \"$(printf '\\001\\002')\" --tokens 2";

const std::string kBin = MESHTRAIN_BIN;

// A one-rank run of a small GPT-2 (d_model 32, vocabulary 37) for `steps` steps, a
// checkpoint at each: d/ck/step_00000001 ... The options it trained with, without steps.
std::string saved_steps(const TempDir& d, int steps) {
  const std::string o = options("gpt2", 8, 2) + " --data.path=" + write_tokens(d, "t.bin", 3000, 37) +
                        " --checkpoint.every=1 --checkpoint.keep=0";
  train_run(d, "ck", 1, o + " --training.steps=" + std::to_string(steps));
  return o;
}

std::string step_dir(const TempDir& d, int step) { return d / ("ck/" + checkpoint_step_dir(step)); }

int run(const std::string& args, std::string* out) { return run_command(kBin + " " + args, out); }

std::string resume_cmd(const TempDir& d, const std::string& o, int steps) {
  return "train " + o + " --training.steps=" + std::to_string(steps) + " --checkpoint.dir=" + d / "ck" +
         " --checkpoint.resume=true --logging.progress=off --logging.metrics=" + d / "m.jsonl";
}

nlohmann::json read_json(const std::string& path) {
  nlohmann::json j;
  std::ifstream(path) >> j;
  return j;
}

// export, sample, info and a resume of d/ck each exit 1 with `want` in their output.
void expect_every_reader_refuses(const TempDir& d, const std::string& o, const std::string& want) {
  for (const std::string& cmd : {"checkpoint info " + d / "ck", "export --checkpoint " + d / "ck" + " --out " + d / "o.st",
                                 "sample --checkpoint " + d / "ck" + kPrompt,
                                 resume_cmd(d, o, 9) + " --checkpoint.keep=2"}) {
    std::string out;
    EXPECT_EQ(run(cmd, &out), 1) << cmd << "\n" << out;
    EXPECT_NE(out.find(want), std::string::npos) << cmd << "\n" << out;
    EXPECT_EQ(out.find("json.exception"), std::string::npos) << out;
  }
  EXPECT_FALSE(fs::exists(d / "o.st"));
}

// A copy of step 2 named step_00000007 was taken for the newest checkpoint: a resume went
// back to step 2 under its name, pruned the real steps 3 and 4 by checkpoint.keep, and
// every later resume went back to step 2. Every reader refuses it, naming both steps and
// what to do; nothing is removed.
TEST(CheckpointIntegrity, StepDirectoryNamedForAnotherStepIsRefused) {
  TempDir d;
  const std::string o = saved_steps(d, 3);
  fs::copy(step_dir(d, 2), step_dir(d, 7), fs::copy_options::recursive);
  expect_every_reader_refuses(d, o, step_dir(d, 7) + "/meta.json is misnamed: it records step 2 but its directory's "
                                                     "name says step 7");
  expect_every_reader_refuses(d, o, "Remove it (" + step_dir(d, 2) + " is there already)");
  for (int s : {1, 2, 3, 7}) EXPECT_TRUE(fs::exists(step_dir(d, s) + "/meta.json")) << s;
  std::string out;
  EXPECT_EQ(run("checkpoint info " + step_dir(d, 7), &out), 1) << out;  // given directly too
  // The real step 2 gone: renaming the copy is the advice, and then it reads.
  fs::remove_all(step_dir(d, 2));
  EXPECT_EQ(run("export --checkpoint " + step_dir(d, 7) + " --out " + d / "o.st", &out), 1) << out;
  EXPECT_NE(out.find("Rename it " + step_dir(d, 2) + ", or remove it"), std::string::npos) << out;
  fs::rename(step_dir(d, 7), step_dir(d, 2));
  EXPECT_EQ(run("checkpoint info " + d / "ck", &out), 0) << out;
  EXPECT_EQ(run(resume_cmd(d, o, 4), &out), 0) << out;
  EXPECT_NE(out.find("resumed from " + step_dir(d, 3) + " at step 3"), std::string::npos) << out;
}

// The newest step directory without meta.json: export and sample read step 2 in silence
// (training already refused it). Now they refuse it, naming it, and say how to read the
// older one; given directly, it is named as damaged (it was "no checkpoint in ...").
TEST(CheckpointIntegrity, DamagedNewestIsNotPassedOverByExportOrSample) {
  TempDir d;
  saved_steps(d, 3);
  fs::remove(step_dir(d, 3) + "/meta.json");
  std::string out;
  for (const std::string& cmd : {"export --checkpoint " + d / "ck" + " --out " + d / "o.st",
                                 "sample --checkpoint " + d / "ck" + kPrompt}) {
    EXPECT_EQ(run(cmd, &out), 1) << cmd << "\n" << out;
    EXPECT_NE(out.find(d / "ck" + " holds " + step_dir(d, 3) + " without meta.json, newer than " + step_dir(d, 2)),
              std::string::npos) << out;
    EXPECT_NE(out.find("Restore it whole (its meta.json and every shard) or remove it; or pass " + step_dir(d, 2)),
              std::string::npos) << out;
  }
  EXPECT_EQ(run("sample --checkpoint " + step_dir(d, 3) + kPrompt, &out), 1) << out;
  EXPECT_NE(out.find("checkpoint " + step_dir(d, 3) + " has no meta.json"), std::string::npos) << out;
  EXPECT_EQ(run("export --checkpoint " + step_dir(d, 2) + " --out " + d / "o.st", &out), 0) << out;
  EXPECT_TRUE(fs::exists(step_dir(d, 3) + "/shard_00000.safetensors")) << "left as it was";
}

// A meta.json without its own CRC (as an older one is read) whose model settings were
// edited: info reported d_model 64 beside tensors [37,32], export wrote wrong-shape
// weights, and with n_layer changed dropped a block. Every reader names the disagreement.
TEST(CheckpointIntegrity, ModelSettingsMustAgreeWithTheTensorTable) {
  TempDir d;
  const std::string o = saved_steps(d, 1);
  const std::string meta = step_dir(d, 1) + "/meta.json";
  nlohmann::json m = read_json(meta);
  m.erase("meta_crc32");
  const nlohmann::json legacy = m;
  m["config"]["model"]["d_model"] = 64;
  std::ofstream(meta) << m.dump(1);
  expect_every_reader_refuses(d, o, meta + " is corrupt (its model settings (model.family = \"gpt2\", n_layer = 2, "
                                           "d_model = 64");
  expect_every_reader_refuses(d, o, "make transformer.wte.weight [37,64] at offset 0, its tensor table has "
                                    "transformer.wte.weight [37,32] at offset 0");
  m = legacy;
  m["config"]["model"]["n_layer"] = 1;
  std::ofstream(meta) << m.dump(1);
  expect_every_reader_refuses(d, o, "n_layer = 1, d_model = 32");
  expect_every_reader_refuses(d, o, "make 3 units, its tensor table holds 4");
  std::ofstream(meta) << legacy.dump(1) << "\n";  // as written, less its CRC: reads
  std::string out;
  EXPECT_EQ(run("checkpoint info " + d / "ck", &out), 0) << out;
}

// Text after meta.json's object passed as intact (the CRC-32 is over the object): refused.
// What the writer ends it with (a newline) still reads; so do other whitespace.
TEST(CheckpointIntegrity, TextAfterTheMetadataObjectIsRefused) {
  TempDir d;
  const std::string o = saved_steps(d, 1);
  const std::string meta = step_dir(d, 1) + "/meta.json";
  std::string out;
  std::ifstream in(meta);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(text.back(), '\n');
  std::ofstream(meta) << text << "\n \t\n";
  EXPECT_EQ(run("checkpoint info " + d / "ck", &out), 0) << out;
  std::ofstream(meta, std::ios::app) << "GARBAGE{\n";
  expect_every_reader_refuses(d, o, meta + " is corrupt (not what meshtrain writes: 9 bytes follow its JSON object");
}

// An empty, cut short or garbled meta.json is named in meshtrain's words, with the position
// where it helps and what to do; the JSON library's text does not show.
TEST(CheckpointIntegrity, UnreadableMetadataIsNamedInMeshtrainsWords) {
  TempDir d;
  const std::string o = saved_steps(d, 1);
  const std::string meta = step_dir(d, 1) + "/meta.json";
  std::ifstream in(meta);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& [content, want] : std::vector<std::pair<std::string, std::string>>{
           {"", "is corrupt (empty)"},
           {text.substr(0, 100), "is corrupt (cut short: its 100 bytes end inside its JSON object)"},
           {"{\n \"format\": x}", "is corrupt (not valid JSON (at line 2, column 12))"}}) {
    std::ofstream(meta) << content;
    expect_every_reader_refuses(d, o, meta + " " + want);
    expect_every_reader_refuses(d, o, "restore the file from a copy");
  }
}

// A missing shard of the only checkpoint: training said to delete it (nothing earlier is
// left). Now training says what checkpoint info says: restore the file first, and that a
// deletion starts from step 0; export and sample say the same without speaking of
// resuming. With an earlier checkpoint, they name it.
TEST(CheckpointIntegrity, DamagedCheckpointAdviceSaysRestoreFirst) {
  TempDir d;
  const std::string o = saved_steps(d, 2);
  const std::string shard = step_dir(d, 2) + "/shard_00000.safetensors";
  fs::rename(shard, d / "kept.safetensors");
  std::string out;
  EXPECT_EQ(run(resume_cmd(d, o, 4), &out), 1) << out;
  EXPECT_NE(out.find("checkpoint file " + shard + " is missing: the checkpoint is incomplete; restore the file from a "
                     "copy, or delete " + step_dir(d, 2) + " so that checkpoint.resume=true continues from " +
                     step_dir(d, 1) + " (check it with meshtrain checkpoint info " + step_dir(d, 1) + ")"),
            std::string::npos) << out;
  for (const std::string& cmd : {"export --checkpoint " + d / "ck" + " --out " + d / "o.st",
                                 "sample --checkpoint " + d / "ck" + kPrompt}) {
    EXPECT_EQ(run(cmd, &out), 1) << cmd << "\n" << out;
    EXPECT_NE(out.find("checkpoint shard " + shard + " is missing: the checkpoint is incomplete; restore the file from "
                       "a copy, or pass --checkpoint " + step_dir(d, 1) + ", the checkpoint before it"),
              std::string::npos) << out;
    EXPECT_EQ(out.find("resume"), std::string::npos) << out;
  }
  fs::remove_all(step_dir(d, 1));  // now the only one
  EXPECT_EQ(run(resume_cmd(d, o, 4), &out), 1) << out;
  EXPECT_NE(out.find("restore the file from a copy, or delete " + step_dir(d, 2) + " so that checkpoint.resume=true "
                     "continues from step 0 (no earlier checkpoint is left)"),
            std::string::npos) << out;
  EXPECT_EQ(run("export --checkpoint " + d / "ck" + " --out " + d / "o.st", &out), 1) << out;
  EXPECT_NE(out.find("is missing: the checkpoint is incomplete; restore the file from a copy (no earlier checkpoint "
                     "is left beside it)"),
            std::string::npos) << out;
  // A corrupt shard (found as it loads): the same advice, each command's own.
  fs::rename(d / "kept.safetensors", shard);
  std::fstream(shard, std::ios::in | std::ios::out | std::ios::binary).seekp(200).put('\x7f');
  EXPECT_EQ(run("sample --checkpoint " + d / "ck" + kPrompt, &out), 1) << out;
  EXPECT_NE(out.find("checkpoint shard " + shard + " is corrupt: CRC-32"), std::string::npos) << out;
  EXPECT_NE(out.find("restore the file from a copy (no earlier checkpoint is left beside it)"), std::string::npos) << out;
  // A resume finds it as it loads too (the check before work covers presence and size): its
  // advice is the resume's, not export's.
  EXPECT_EQ(run(resume_cmd(d, o, 4), &out), 1) << out;
  EXPECT_NE(out.find("checkpoint shard " + shard + " is corrupt: CRC-32"), std::string::npos) << out;
  EXPECT_NE(out.find("so that checkpoint.resume=true continues from step 0 (no earlier checkpoint is left)"),
            std::string::npos) << out;
  EXPECT_EQ(out.find("pass --checkpoint"), std::string::npos) << out;
}

// A save whose temporary directory cannot be written says so, naming the path and the
// reason, on every rank. Here: a file size limit of 0 (as a full disk, the nonce write
// fails: it was unchecked, and rank 0 then said it could not see the directory it made),
// and a path too long for the filesystem (as a read-only one, creating the temporary
// directory fails: it was the library's "filesystem error: cannot create directories").
TEST(CheckpointIntegrity, SaveThatCannotWriteItsDirectorySaysWhy) {
  TempDir d;
  Config cfg;
  cfg.model.n_layer = 1, cfg.model.n_head = 2, cfg.model.d_model = 8, cfg.model.vocab_size = 16, cfg.model.seq_len = 8;
  const std::vector<Unit> layout = model_layout(cfg.model);
  std::vector<std::vector<float>> w;
  std::vector<CheckpointSlice> slices;
  for (const Unit& u : layout) w.emplace_back(u.numel, 0.5f);
  for (size_t u = 0; u < layout.size(); ++u) slices.push_back({layout[u].name, 0, layout[u].numel, {{"params", w[u].data()}}});
  std::unique_ptr<Communicator> world = comm_local();
  auto save = [&](const std::string& root) -> std::string {
    try {
      checkpoint_save(root, 1, cfg, layout, slices, {}, *world, 0);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  ASSERT_EQ(save(d / "ck"), "");  // saves as it is
  EXPECT_EQ(checkpoint_latest(d / "ck"), d / "ck/step_00000001");

  rlimit was{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &was), 0);
  rlimit none = was;
  none.rlim_cur = 0;
  sighandler_t handler = signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails (EFBIG) instead
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &none), 0);
  const std::string full = save(d / "full");
  setrlimit(RLIMIT_FSIZE, &was);
  signal(SIGXFSZ, handler);
  EXPECT_NE(full.find("cannot write " + d / "full/.tmp-step_00000001" + "/nonce in checkpoint.dir = " + d / "full" +
                      ": File too large; make it writable (or free space) and run again with checkpoint.resume=true"),
            std::string::npos) << full;

  std::string root = d.path;  // one below PATH_MAX, so that the temporary directory's path is past it
  while (root.size() < 4080) root += "/" + std::string(std::min<size_t>(200, 4080 - root.size() - 1), 'a');
  const std::string long_path = save(root);
  EXPECT_NE(long_path.find("cannot create " + root + "/.tmp-step_00000001 in checkpoint.dir = " + root +
                           ": File name too long; make it writable"),
            std::string::npos) << long_path.substr(long_path.size() - 200);
  EXPECT_EQ(long_path.find("filesystem error"), std::string::npos);
}

// Resuming a step-3 checkpoint with training.steps = 2 exited 0, "trained 0 steps", with a
// note that the schedule now runs to step 2 and a validation labelled step 2. Past the
// checkpoint's step it is refused, saying to raise training.steps; at it, the run is
// complete: said, exit 0, no step trained and nothing written.
TEST(CheckpointIntegrity, ResumeAtOrPastTrainingStepsIsSaid) {
  TempDir d;
  const std::string o = saved_steps(d, 3) + " --training.val_every=1";
  std::string out;
  EXPECT_EQ(run(resume_cmd(d, o, 2), &out), 1) << out;
  EXPECT_NE(out.find("checkpoint " + step_dir(d, 3) + " is at step 3, past training.steps = 2: a resumed run continues "
                     "it and cannot go back. Set training.steps above 3 to train further"),
            std::string::npos) << out;
  EXPECT_EQ(out.find("schedule now runs"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d / "m.jsonl"));
  EXPECT_EQ(run(resume_cmd(d, o, 3), &out), 0) << out;
  EXPECT_NE(out.find("checkpoint " + step_dir(d, 3) + " is at step 3 = training.steps: the run is complete and trains "
                     "no step; set training.steps above 3 to train further"),
            std::string::npos) << out;
  for (const std::string& l : read_lines(d / "m.jsonl"))
    EXPECT_FALSE(nlohmann::json::parse(l).contains("loss") && !nlohmann::json::parse(l).contains("event")) << l;
  EXPECT_FALSE(fs::exists(step_dir(d, 4)));
}

}  // namespace
