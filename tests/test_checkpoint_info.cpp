// meshtrain checkpoint info: every field of a fresh tp 2 x dp 2 checkpoint (JSON and
// text), a flipped byte in a shard or in meta.json (exit status 1, the file named, and a
// resume that refuses it too), a missing shard, a step directory without meta.json, and a
// directory that does not exist or holds no checkpoint. And what training checks of
// checkpoint.dir before any work (train/checkpoint_dir.h): not one step directory, no
// damaged step directory in it, and a path it can write.
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "train/checkpoint.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

int info(const std::string& args, std::string* out) {
  return run_command(std::string(MESHTRAIN_BIN) + " checkpoint info " + args, out);
}

void flip_byte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  const char c = static_cast<char>(f.get());
  f.seekp(at);
  f.put(static_cast<char>(c ^ 0x10));
}

// A tp 2 x dp 2 (ZeRO 1) run of 2 steps; its checkpoint directory.
std::string saved_run(const TempDir& d) {
  const std::string o = options("gpt2", 8, 2) + " --training.steps=2 --data.path=" + write_tokens(d, "t.bin", 3000, 37) +
                        " --parallel.tp=2 --parallel.zero=1";
  train_run(d, "ck", 4, o);
  return checkpoint_latest(d / "ck");
}

TEST(CheckpointInfo, ReportsEveryFieldOfAFreshCheckpoint) {
  TempDir d;
  const std::string dir = saved_run(d);
  ASSERT_FALSE(dir.empty());
  std::string out;
  ASSERT_EQ(info(d / "ck --json", &out), 0) << out;
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["dir"], dir);
  EXPECT_EQ(j["checkpoints"], nlohmann::json::array({"step_00000002"}));
  EXPECT_EQ(j["step"], 2);
  EXPECT_EQ(j["optimizer"]["name"], "adamw");
  EXPECT_EQ(j["optimizer"]["steps_taken"], 2);
  const auto& L = j["layout"];
  EXPECT_EQ(L["world_size"], 4);
  EXPECT_EQ(L["dp"], 2);
  EXPECT_EQ(L["tp"], 2);
  EXPECT_EQ(L["pp"], 1);
  EXPECT_EQ(L["pp_chunks"], 1);
  EXPECT_EQ(L["pp_schedule"], "1f1b");
  EXPECT_EQ(L["zero"], 1);
  EXPECT_EQ(L["sharding"], "");
  EXPECT_EQ(L["sequence_parallel"], false);
  EXPECT_FALSE(L.contains("test_fault"));
  EXPECT_EQ(j["batch"], nlohmann::json({{"global_batch", 8}, {"micro_batch", 2}, {"micro_batches_per_step", 2},
                                        {"seq_len", 16}}));
  // The precision and the optimizer's settings (a resume's mismatch message points here).
  EXPECT_EQ(j["precision"], nlohmann::json({{"precision", "fp32"}, {"grad_dtype", "fp32"}, {"device", "cpu"}}));
  EXPECT_EQ(j["optim"]["lr"], 3e-3);
  EXPECT_EQ(j["optim"]["name"], "adamw");
  // The model and its units, against the layout the model configuration gives.
  ModelConfig m;
  m.n_layer = 2, m.n_head = 4, m.d_model = 32, m.vocab_size = 37, m.seq_len = 16;
  const std::vector<Unit> layout = model_layout(m);
  int64_t parameters = 0;
  for (const Unit& u : layout) parameters += u.numel;
  EXPECT_EQ(j["model"]["family"], "gpt2");
  EXPECT_EQ(j["model"]["n_layer"], 2);
  EXPECT_EQ(j["model"]["d_model"], 32);
  EXPECT_EQ(j["model"]["ff_dim"], 128);
  EXPECT_EQ(j["model"]["parameters"], parameters);
  ASSERT_EQ(j["units"].size(), layout.size());
  for (size_t u = 0; u < layout.size(); ++u) {
    const auto& ju = j["units"][u];
    EXPECT_EQ(ju["name"], layout[u].name);
    EXPECT_EQ(ju["elements"], layout[u].numel);
    EXPECT_EQ(ju["bytes"], 4 * layout[u].numel);
    ASSERT_EQ(ju["params"].size(), layout[u].params.size());
    for (size_t p = 0; p < layout[u].params.size(); ++p) {
      EXPECT_EQ(ju["params"][p]["name"], layout[u].params[p].name);
      EXPECT_EQ(ju["params"][p]["shape"], nlohmann::json(layout[u].params[p].shape));
      EXPECT_EQ(ju["params"][p]["elements"], layout[u].params[p].numel());
    }
  }
  // Every element saved once: the parameters, and AdamW's two moments of each.
  EXPECT_EQ(j["totals"]["params"]["elements"], parameters);
  EXPECT_EQ(j["totals"]["params"]["bytes"], 4 * parameters);
  EXPECT_EQ(j["totals"]["optimizer_state"]["tensors"], nlohmann::json({{"adam_m", parameters}, {"adam_v", parameters}}));
  EXPECT_EQ(j["totals"]["optimizer_state"]["bytes"], 8 * parameters);
  // Data: 2 steps of 8 sequences of 16 tokens read, from 3000 / 16 = 187 per epoch.
  EXPECT_EQ(j["data"]["path"], d / "t.bin");
  EXPECT_EQ(j["data"]["sequences_read"], 16);
  EXPECT_EQ(j["data"]["tokens_read"], 256);
  EXPECT_EQ(j["data"]["sequences_per_epoch"], 187);
  EXPECT_EQ(j["data"]["epoch"], 0);
  // meta.json and one shard per rank (each tp x dp rank writes its own ranges), all intact.
  ASSERT_EQ(j["files"].size(), 5u);
  EXPECT_EQ(j["files"][0]["name"], "meta.json");
  for (int r = 0; r < 4; ++r) {
    const auto& f = j["files"][r + 1];
    EXPECT_EQ(f["rank"], r);
    EXPECT_EQ(f["status"], "ok");
    EXPECT_EQ(f["bytes"], fs::file_size(dir + "/" + f["name"].get<std::string>()));
  }
  EXPECT_EQ(j["intact"], true);
  // The text form says the same, a step directory given directly included.
  ASSERT_EQ(info(dir, &out), 0) << out;
  for (const std::string& want : std::vector<std::string>{"step        2; optimizer adamw, 2 steps taken", "4 ranks: dp 2 x tp 2 x pp 1",
                                  "transformer.h.1.mlp.c_fc.weight", "params " + std::to_string(parameters) + " elements",
                                  "shard_00003.safetensors", "epoch 0 of 187 sequences",
                                  "precision   fp32, gradients fp32, trained on cpu", "optim       "})
    EXPECT_NE(out.find(want), std::string::npos) << want << "\n" << out;
  EXPECT_EQ(out.find("corrupt"), std::string::npos) << out;
}

// A flipped byte in a shard: exit status 1, the file named as corrupt, what to do; the
// JSON says which. A resumed run refuses the same shard. Then a missing shard.
TEST(CheckpointInfo, CorruptOrMissingShardIsNamed) {
  TempDir d;
  const std::string dir = saved_run(d);
  const std::string shard = dir + "/shard_00002.safetensors";
  flip_byte(shard, static_cast<std::streamoff>(fs::file_size(shard) / 2));
  std::string out;
  EXPECT_EQ(info(d / "ck", &out), 1) << out;
  EXPECT_NE(out.find("error: checkpoint " + dir + " is damaged: " + shard + " is corrupt: CRC-32"), std::string::npos)
      << out;
  EXPECT_NE(out.find("delete " + dir), std::string::npos) << out;
  EXPECT_EQ(run_command("{ " + std::string(MESHTRAIN_BIN) + " checkpoint info " + d / "ck" + " --json 2>/dev/null; }", &out),
            1);  // the JSON alone
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["intact"], false);
  for (const auto& f : j["files"]) EXPECT_EQ(f["status"], f["name"] == "shard_00002.safetensors" ? "damaged" : "ok") << f;
  // Training refuses it too, naming the same file.
  const std::string o = options("gpt2", 8, 2) + " --training.steps=3 --data.path=" + d / "t.bin";
  EXPECT_NE(run_command(std::string(MESHTRAIN_BIN) + " train " + o + " --checkpoint.dir=" + d / "ck" +
                            " --checkpoint.resume=true --logging.progress=off",
                        &out),
            0);
  EXPECT_NE(out.find(shard + " is corrupt"), std::string::npos) << out;

  fs::remove(dir + "/shard_00001.safetensors");
  EXPECT_EQ(info(d / "ck", &out), 1);
  EXPECT_NE(out.find(dir + "/shard_00001.safetensors is missing"), std::string::npos) << out;
}

// meta.json records its own CRC-32: a changed digit (here the optimizer's step count, which
// would still parse) is found by info and by a resumed run.
TEST(CheckpointInfo, CorruptMetadataIsNamed) {
  TempDir d;
  const std::string dir = saved_run(d);
  std::string text;
  {
    std::ifstream f(dir + "/meta.json");
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  const size_t at = text.find("\"steps_taken\": 2");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 400);
  flip_byte(dir + "/meta.json", static_cast<std::streamoff>(at + 15));  // '2' -> '"'
  std::string out;
  EXPECT_EQ(info(d / "ck", &out), 1) << out;
  EXPECT_NE(out.find(dir + "/meta.json is corrupt"), std::string::npos) << out;
  // A digit changed into another digit: still valid JSON, caught by the CRC.
  flip_byte(dir + "/meta.json", static_cast<std::streamoff>(at + 15));
  std::fstream(dir + "/meta.json", std::ios::in | std::ios::out).seekp(at + 15).put('3');
  EXPECT_EQ(info(d / "ck", &out), 1) << out;
  EXPECT_NE(out.find(dir + "/meta.json is corrupt (its CRC-32 differs from the one it records)"), std::string::npos)
      << out;
  const std::string o = options("gpt2", 8, 2) + " --training.steps=3 --data.path=" + d / "t.bin";
  EXPECT_NE(run_command(std::string(MESHTRAIN_BIN) + " train " + o + " --checkpoint.dir=" + d / "ck" +
                            " --checkpoint.resume=true --logging.progress=off",
                        &out),
            0);
  EXPECT_NE(out.find(dir + "/meta.json is corrupt"), std::string::npos) << out;
}

// A meta.json without a CRC of its own (an older checkpoint's, or one edited) that parses
// but holds a field of the wrong kind: info, a resume and export name the field (they
// stopped with a library's "internal error: type must be number" or read a range from
// element -1), and a configuration value meshtrain refuses is named as the file's.
TEST(CheckpointInfo, MetadataFieldsOfTheWrongKindAreNamed) {
  TempDir d;
  const std::string dir = saved_run(d);
  nlohmann::json meta;
  std::ifstream(dir + "/meta.json") >> meta;
  meta.erase("meta_crc32");
  const std::string o = options("gpt2", 8, 2) + " --training.steps=3 --data.path=" + d / "t.bin";
  const std::string resume = std::string(MESHTRAIN_BIN) + " train " + o + " --checkpoint.dir=" + d / "ck" +
                             " --checkpoint.resume=true --logging.progress=off";
  const std::string exp = std::string(MESHTRAIN_BIN) + " export --checkpoint " + d / "ck" + " --out " + d / "o.safetensors";
  for (const auto& [edit, want] : std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>>{
           {[](nlohmann::json& m) { m["shards"][0]["ranges"][0]["begin"] = -1; },
            "is corrupt (it has shards[0].ranges[0].begin = -1, not an element index)"},
           {[](nlohmann::json& m) { m["config"]["parallel"] = 257; },
            "is corrupt (it has config.parallel = 257, not an object of keys)"},
           {[](nlohmann::json& m) { m["optimizer"].erase("steps_taken"); }, "is corrupt (it has no optimizer.steps_taken)"},
           {[](nlohmann::json& m) { m["units"][1]["params"][0]["shape"] = {"a"}; },
            "is corrupt (it has units[1].params[0].shape = [\"a\"], not a list of sizes)"},
           {[](nlohmann::json& m) { m["units"][1]["params"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40}; },
            "is corrupt (it has units[1].params[0].shape = [1099511627776,1099511627776] at offset 0, past its "
            "unit's"},  // info multiplied the sizes past int64
           {[](nlohmann::json& m) { m["config"]["parallel"].erase("dp"); },  // info divided by it
            "is corrupt (it records parallel.dp = 0 and training.micro_batch = 2, not the layout a run resolved)"},
           {[](nlohmann::json& m) { m["shards"][0]["file"] = "../t.bin"; },
            "is corrupt (it has shards[0].file = \"../t.bin\", not a file name)"},
           // found by fuzzing: longer than a file name can be ("internal error: filesystem
           // error: File name too long"), and a NUL (the file system would read a shorter name)
           {[](nlohmann::json& m) { m["shards"][0]["file"] = std::string(300, 'a'); },
            "is corrupt (it has shards[0].file = \"" + std::string(36, 'a') + "..., not a file name)"},
           {[](nlohmann::json& m) { m["shards"][0]["file"] = std::string("shard_00000.safetensors\0x", 25); },
            "is corrupt (it has shards[0].file = \"shard_00000.safetensors\\u0000x\", not a file name)"},
           {[](nlohmann::json& m) { m["shards"][0]["file"] = ".."; },
            "is corrupt (it has shards[0].file = \"..\", not a file name)"}}) {
    nlohmann::json m = meta;
    edit(m);
    std::ofstream(dir + "/meta.json") << m.dump(1);
    std::string out;
    EXPECT_EQ(info(d / "ck", &out), 1) << out;
    EXPECT_NE(out.find(dir + "/meta.json " + want), std::string::npos) << out;
    for (const std::string& cmd : {resume, exp}) {
      EXPECT_EQ(run_command(cmd, &out), 1) << cmd << "\n" << out;
      EXPECT_NE(out.find(dir + "/meta.json " + want), std::string::npos) << cmd << "\n" << out;
      EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
    }
  }
  nlohmann::json m = meta;
  m["config"]["model"]["n_layer"] = "x";
  std::ofstream(dir + "/meta.json") << m.dump(1);
  std::string out;
  EXPECT_EQ(run_command(exp, &out), 1) << out;
  EXPECT_NE(out.find(dir + "/meta.json records a configuration this meshtrain does not take (bad value \"x\" for "
                              "model.n_layer"),
            std::string::npos)
      << out;
  // A model shape of the right kind that no model has (found by fuzzing: sample sized its
  // positions by seq_len = -1 and stopped with "internal error: vector::reserve").
  m = meta;
  m["config"]["model"]["seq_len"] = -1;
  std::ofstream(dir + "/meta.json") << m.dump(1);
  const std::string sample = std::string(MESHTRAIN_BIN) + " sample --checkpoint " + d / "ck" + " --prompt ab";
  for (const std::string& cmd : {sample, exp, resume}) {
    EXPECT_EQ(run_command(cmd, &out), 1) << cmd << "\n" << out;
    EXPECT_NE(out.find(dir + "/meta.json records a configuration this meshtrain does not take (model.seq_len = -1 "
                                "must be from 1 to 16777216)"),
              std::string::npos)
        << cmd << "\n" << out;
  }
  std::ofstream(dir + "/meta.json") << meta.dump(1);  // its fields as written, no CRC: an older checkpoint reads
  EXPECT_EQ(info(d / "ck", &out), 0) << out;
}

// The files' checksum: zlib's CRC-32 (the check value of "123456789"), computed 8 bytes at
// a time, against the bit-by-bit definition at every alignment and tail length, and
// continued across pieces.
TEST(CheckpointInfo, Crc32IsZlibs) {
  EXPECT_EQ(crc32_update(0, "123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32_update(0, "", 0), 0u);
  const auto bitwise = [](const uint8_t* p, size_t n) {
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; ++i) {
      c ^= p[i];
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    return ~c;
  };
  std::vector<uint8_t> buf(1000);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  for (size_t off = 0; off < 8; ++off)
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{15}, size_t{64}, size_t{991}}) {
      EXPECT_EQ(crc32_update(0, buf.data() + off, n), bitwise(buf.data() + off, n)) << off << " " << n;
      const size_t cut = n / 3;
      EXPECT_EQ(crc32_update(crc32_update(0, buf.data() + off, cut), buf.data() + off + cut, n - cut),
                bitwise(buf.data() + off, n));
    }
}

TEST(CheckpointInfo, MissingDirectoryIsAClearError) {
  TempDir d;
  std::string out;
  EXPECT_EQ(info(d / "nothing", &out), 1);
  EXPECT_NE(out.find("error: checkpoint info: " + d / "nothing" + " does not exist"), std::string::npos) << out;
  fs::create_directories(d / "empty/.tmp-step_00000004");  // an interrupted save is no checkpoint
  EXPECT_EQ(info(d / "empty", &out), 1);
  EXPECT_NE(out.find(d / "empty" + " holds no checkpoint"), std::string::npos) << out;
  EXPECT_NE(info("", &out), 0);  // the directory is required
}

// One-rank runs of a small GPT-2: the options without training.steps.
std::string small_options(const TempDir& d) {
  const std::string data = d / "small.bin";
  if (!fs::exists(data)) write_tokens(d, "small.bin", 3000, 37);
  return options("gpt2", 8, 2) + " --data.path=" + data;
}

// checkpoint.dir set to one step directory (it holds meta.json) is refused on every rank
// before any work, naming its parent as the value to use; nothing is written inside it.
// (It used to be taken as the run's directory: new checkpoints nested inside it, every
// resume back at its step.) Commands that read one checkpoint still take it. A resumed
// run's last line names the checkpoint it wrote.
TEST(CheckpointDir, OneStepDirectoryIsRefusedForTraining) {
  TempDir d;
  const std::string o = small_options(d);
  train_run(d, "run", 1, o + " --training.steps=2");
  const std::string step = d / "run/step_00000002";
  ASSERT_TRUE(fs::exists(step + "/meta.json"));
  const std::string cmd = std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o + " --training.steps=3";
  const std::string use = "Set checkpoint.dir = " + d / "run" + " (";
  expect_refused(cmd, {{" --checkpoint.resume=true --checkpoint.dir=" + step, "checkpoint.dir = " + step +
                                                                                  " is itself one checkpoint"},
                       {" --checkpoint.resume=true --checkpoint.dir=" + step, use},
                       {" --checkpoint.resume=true --checkpoint.dir=" + step + "/", use},
                       {" --checkpoint.dir=" + step, use},
                       // and the run's own directory, without resuming: said once, not by each rank
                       {" --checkpoint.dir=" + d / "run", "already holds checkpoints of another run"}});
  EXPECT_EQ(std::distance(fs::directory_iterator(step), fs::directory_iterator()), 2) << "meta.json and one shard";
  std::string out;
  EXPECT_EQ(info(step, &out), 0) << out;
  // Given as ".", from inside it: the parent named is the real one. A step directory
  // without meta.json (damaged, elsewhere) is refused as one checkpoint too.
  expect_refused("cd " + step + " && " + MESHTRAIN_BIN + " train " + o + " --training.steps=3",
                 {{" --checkpoint.resume=true --checkpoint.dir=.", use}});
  fs::create_directories(d / "other/step_00000009");
  expect_refused(cmd, {{" --checkpoint.resume=true --checkpoint.dir=" + d / "other/step_00000009",
                        "Set checkpoint.dir = " + d / "other" + " ("}});
  // A checkpoint under another name (a copy kept aside): its parent holds no step_
  // directory to resume, so the advice is to move it into one, which then resumes.
  fs::copy(step, d / "snap", fs::copy_options::recursive);
  expect_refused(cmd, {{" --checkpoint.resume=true --checkpoint.dir=" + d / "snap",
                        "move it to " + d / "snap_run/step_00000002" + " and set checkpoint.dir = " + d / "snap_run"}});
  fs::create_directories(d / "snap_run");
  fs::rename(d / "snap", d / "snap_run/step_00000002");
  const RunResult moved = train_run(d, "snap_run", 1, o + " --training.steps=3 --checkpoint.resume=true");
  EXPECT_NE(moved.output.find("resumed from " + d / "snap_run/step_00000002" + " at step 2"), std::string::npos)
      << moved.output;
  const RunResult r = train_run(d, "run", 1, o + " --training.steps=3 --checkpoint.resume=true");
  EXPECT_NE(r.output.find("resumed from " + step + " at step 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checkpoint: " + d / "run/step_00000003"), std::string::npos) << r.output;
}

// A checkpoint.dir the filesystem cannot resolve (a symlink loop) is named with the reason,
// once, on every rank; one that is not the same directory on every rank (each rank started
// in its own working directory, a relative path) is found before any work by the probe
// file every rank reads back, not at the first save.
TEST(CheckpointDir, UnresolvableOrUnsharedDirectoryIsRefusedBeforeAnyWork) {
  TempDir d;
  const std::string o = small_options(d) + " --training.steps=2";
  fs::create_symlink(d / "loop", d / "loop");
  expect_refused(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o,
                 {{" --checkpoint.dir=" + d / "loop", "checkpoint.dir = " + d / "loop" + ": Too many levels"}});
  fs::create_directories(d / "a");
  fs::create_directories(d / "b");
  // (expect_refused adds --logging.progress=off to the last rank's options: every rank gets it)
  const std::string rank = std::string(MESHTRAIN_BIN) + " train " + o + " --checkpoint.dir=ck --logging.progress=off";
  expect_refused(mpirun_in(d) + " -n 1 -wdir " + d / "a" + " " + rank + " : -n 1 -wdir " +
                     d / "b" + " " + rank,
                 {{"", "rank 1: cannot see the file rank 0 wrote in checkpoint.dir = ck: it must be one directory "
                       "shared by all ranks"}});
  EXPECT_FALSE(fs::exists(d / "a/ck/.meshtrain-write-probe")) << "the probe is removed";
  // A verdict only one rank reaches (a damaged checkpoint only rank 1 sees): every rank
  // stops with that rank's message, none is left waiting in a collective.
  fs::create_directories(d / "b/ck/step_00000003");
  expect_refused(mpirun_in(d) + " -n 1 -wdir " + d / "a" + " " + rank + " : -n 1 -wdir " +
                     d / "b" + " " + rank,
                 {{"", "rank 1: checkpoint.dir ck holds ck/step_00000003 without meta.json"}});
}

// A checkpoint.dir that cannot be made (a path under a regular file) stops the run before
// any work, on every rank, with one message naming the key and the path; nothing is
// trained (it used to be found at the first save).
TEST(CheckpointDir, UnwritableDirectoryStopsTheRunBeforeAnyWork) {
  TempDir d;
  std::ofstream(d / "afile") << "a file where a directory should be";
  const std::string ck = d / "afile/ckpt";
  const std::string o = small_options(d) + " --training.steps=2 --logging.metrics=" + d / "m.jsonl";
  expect_refused(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o,
                 {{" --checkpoint.dir=" + ck, "cannot create checkpoint.dir = " + ck + ": Not a directory"}});
  expect_refused(std::string(MESHTRAIN_BIN) + " train " + o,
                 {{" --checkpoint.dir=" + ck, "choose another checkpoint.dir"}});
  for (const std::string& l : read_lines(d / "m.jsonl")) ADD_FAILURE() << "a step ran: " << l;
}

// A step directory without meta.json (here: step 3's shards, its meta.json lost) is a
// damaged checkpoint, never passed over for an older one: checkpoint info reports it like
// a missing file (exit status 1, what to do), and training refuses the directory, naming
// it, rather than resume from step 2 and later overwrite it. What a killed save leaves
// (.tmp-step_N) is not damaged: the next start removes it.
TEST(CheckpointDir, StepDirectoryWithoutMetadataIsDamaged) {
  TempDir d;
  const std::string o = small_options(d) + " --checkpoint.every=1 --checkpoint.keep=0";
  train_run(d, "run", 1, o + " --training.steps=3");
  const std::string step1 = d / "run/step_00000001", step2 = d / "run/step_00000002", step3 = d / "run/step_00000003";
  fs::remove(step3 + "/meta.json");
  fs::create_directories(d / "run/.tmp-step_00000004");
  std::string out;
  for (const std::string& arg : {d / "run", step3}) {
    EXPECT_EQ(info(arg, &out), 1) << out;
    EXPECT_NE(out.find("error: checkpoint " + step3 + " is damaged: " + step3 + "/meta.json is missing"),
              std::string::npos) << out;
    EXPECT_NE(out.find("delete " + step3 + " so that checkpoint.resume=true continues from " + step2), std::string::npos)
        << out;
  }
  EXPECT_EQ(run_command("{ " + std::string(MESHTRAIN_BIN) + " checkpoint info " + d / "run" + " --json 2>/dev/null; }", &out),
            1);
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["dir"], step3);
  EXPECT_EQ(j["files"][0]["status"], "damaged");
  EXPECT_EQ(j["checkpoints"], nlohmann::json::array({"step_00000001", "step_00000002"}));

  const std::string cmd = std::string(MESHTRAIN_BIN) + " train " + o + " --training.steps=5 --checkpoint.dir=" + d / "run";
  expect_refused(cmd, {{" --checkpoint.resume=true", step3 + " without meta.json"},
                       {" --checkpoint.resume=true", "restore it whole (its meta.json and every shard) or remove it"},
                       {"", step3 + " without meta.json"}});
  EXPECT_TRUE(fs::exists(step3 + "/shard_00000.safetensors")) << "left as it was";

  // Removed: the run resumes from step 2 and removes the interrupted save's leftover.
  fs::remove_all(step3);
  const RunResult r = train_run(d, "run", 1, o + " --training.steps=5 --checkpoint.resume=true");
  EXPECT_NE(r.output.find("resumed from " + step2), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("removed " + d / "run/.tmp-step_00000004"), std::string::npos) << r.output;
  // An older damaged one beside an intact newest: the newest is reported, the older named.
  fs::remove(step1 + "/meta.json");
  EXPECT_EQ(info(d / "run", &out), 1) << out;
  EXPECT_NE(out.find("damaged     step_00000001 (no meta.json)"), std::string::npos) << out;
  EXPECT_NE(out.find(step1 + "/meta.json is missing"), std::string::npos) << out;
  EXPECT_EQ(out.find("corrupt"), std::string::npos) << out;
  // Training goes on from the newest: nothing newer than it is lost.
  const RunResult on = train_run(d, "run", 1, o + " --training.steps=6 --checkpoint.resume=true");
  EXPECT_NE(on.output.find("resumed from " + d / "run/step_00000005"), std::string::npos) << on.output;
}

}  // namespace
