// Hardware profiles (plan/hardware.h): the built-in table against the published figures,
// profile files read and written, the errors a bad file gives, and `meshtrain bench profile`
// writing a file the planner reads.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "ops/gemm_bf16.h"
#include "plan/hardware.h"
#include "test_util.h"

namespace mt::plan {
namespace {

using test::error_of;

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void expect_same(const Hardware& a, const Hardware& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.gpu, b.gpu);
  EXPECT_EQ(a.flops_fp32, b.flops_fp32);
  EXPECT_EQ(a.flops_bf16, b.flops_bf16);
  EXPECT_EQ(a.flops_fp16, b.flops_fp16);
  EXPECT_EQ(a.mem_bytes, b.mem_bytes);
  EXPECT_EQ(a.mem_bw, b.mem_bw);
  EXPECT_EQ(a.intra_node_bw, b.intra_node_bw);
  EXPECT_EQ(a.inter_node_bw, b.inter_node_bw);
  EXPECT_EQ(a.latency_s, b.latency_s);
  EXPECT_EQ(a.efficiency, b.efficiency);
}

// The published figures (../shared/reference/published-figures.md, Hardware, Megatron-LM
// and torchtitan sections) and the vendor's datasheet values the table lacks.
TEST(PlanHardware, BuiltinsHoldThePublishedFigures) {
  EXPECT_EQ(hardware_builtin_names(), (std::vector<std::string>{"a100-40gb", "a100-80gb", "h100", "h200"}));
  struct Row {
    const char* name;
    double fp32, bf16, mem, bw, nvlink, net;
  };
  const Row rows[] = {
      {"a100-40gb", 19.5e12, 312e12, 40e9, 1.555e12, 300e9, 25e9},
      {"a100-80gb", 19.5e12, 312e12, 80e9, 2.0e12, 300e9, 25e9},
      {"h100", 67e12, 989e12, 80e9, 3.35e12, 450e9, 50e9},
      {"h200", 67e12, 989e12, 141e9, 4.8e12, 450e9, 50e9},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.name);
    const Hardware h = hardware_get(r.name);
    EXPECT_EQ(h.name, r.name);
    EXPECT_TRUE(h.gpu);
    EXPECT_DOUBLE_EQ(h.flops_fp32, r.fp32);
    EXPECT_DOUBLE_EQ(h.flops_bf16, r.bf16);
    EXPECT_DOUBLE_EQ(h.flops_fp16, r.bf16);  // dense fp16 = dense bf16 on these GPUs
    EXPECT_DOUBLE_EQ(h.mem_bytes, r.mem);
    EXPECT_DOUBLE_EQ(h.mem_bw, r.bw);
    EXPECT_DOUBLE_EQ(h.intra_node_bw, r.nvlink);
    EXPECT_DOUBLE_EQ(h.inter_node_bw, r.net);
    EXPECT_GT(h.latency_s, 1e-6);  // a few microseconds
    EXPECT_LT(h.latency_s, 1e-5);
    EXPECT_GT(h.efficiency, 0);
    EXPECT_LE(h.efficiency, 1);
    EXPECT_DOUBLE_EQ(h.flops("bf16"), r.bf16);
    EXPECT_DOUBLE_EQ(h.flops("fp32"), r.fp32);
  }
}

TEST(PlanHardware, AliasesNameTheBuiltins) {
  EXPECT_EQ(hardware_get("a100").name, "a100-80gb");
  EXPECT_EQ(hardware_get("A100-SXM").name, "a100-80gb");
  EXPECT_EQ(hardware_get("a100_40gb").name, "a100-40gb");
  EXPECT_EQ(hardware_get("H100").name, "h100");
  EXPECT_EQ(hardware_get("h100-sxm").name, "h100");
  EXPECT_EQ(hardware_get("h200-sxm").name, "h200");
}

TEST(PlanHardware, TomlRoundTripIsExact) {
  test::TempDir d;
  std::vector<Hardware> all;
  for (const std::string& n : hardware_builtin_names()) all.push_back(hardware_get(n));
  Hardware odd;  // values that need all 17 digits, a zero latency, a name to escape
  odd.name = "lab \"box\" \\ 2";
  odd.gpu = false;
  odd.flops_fp32 = 1.2345678901234567e11;
  odd.flops_bf16 = 1.0 / 3.0 * 1e12;
  odd.flops_fp16 = 7e6 / 3.0;
  odd.mem_bytes = 25276026880;
  odd.mem_bw = 3.3e10 + 0.1;
  odd.intra_node_bw = 2.0 / 3.0 * 1e10;
  odd.inter_node_bw = 1e4 / 3.0;
  odd.latency_s = 0;
  odd.efficiency = 0.1 + 0.2;
  all.push_back(odd);
  for (const Hardware& h : all) {
    SCOPED_TRACE(h.name);
    const std::string path = d / "p.toml";
    write_file(path, hardware_to_toml(h));
    expect_same(hardware_read(path), h);
    expect_same(hardware_get(path), h);
  }
  // Notes are comments: the file reads the same with them.
  HardwareNotes notes;
  notes.header = {"measured somewhere"};
  notes.field["mem_bw"] = "a STREAM triad\nsecond line";
  write_file(d / "n.toml", hardware_to_toml(odd, notes));
  expect_same(hardware_read(d / "n.toml"), odd);
  EXPECT_NE(read_text(d / "n.toml").find("#   second line"), std::string::npos);
}

// configs/hardware_example.toml, the README's example, is the h100 profile under another name.
TEST(PlanHardware, ExampleFileReads) {
  Hardware h = hardware_get(std::string(MESHTRAIN_SOURCE_DIR) + "/configs/hardware_example.toml");
  EXPECT_EQ(h.name, "my-h100-cluster");
  h.name = "h100";
  expect_same(h, hardware_get("h100"));
}

// Every field is required; its absence names the field, the file and what it holds.
TEST(PlanHardware, MissingFieldIsNamed) {
  test::TempDir d;
  const std::string full = hardware_to_toml(hardware_get("h100"));
  const std::vector<std::pair<std::string, std::string>> fields = {
      {"name", "string"},          {"gpu", "true or false"},      {"flops_fp32", "FLOP/s"},
      {"flops_bf16", "FLOP/s"},    {"flops_fp16", "FLOP/s"},      {"mem_bytes", "bytes"},
      {"mem_bw", "bytes/s"},       {"intra_node_bw", "bytes/s"},  {"inter_node_bw", "bytes/s"},
      {"latency_s", "seconds"},    {"efficiency", "fraction"}};
  for (const auto& [field, unit] : fields) {
    SCOPED_TRACE(field);
    std::istringstream in(full);
    std::string text;
    for (std::string l; std::getline(in, l);)
      if (l.rfind(field + " =", 0) != 0) text += l + "\n";
    ASSERT_NE(text.size(), full.size());
    const std::string path = d / ("missing_" + field + ".toml");
    write_file(path, text);
    const std::string e = error_of([&] { hardware_read(path); });
    EXPECT_NE(e.find("[hardware]." + field + " is missing"), std::string::npos) << e;
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find(unit), std::string::npos) << e;
  }
}

// A value of the wrong type or out of range names the field, the file, the value and the unit.
TEST(PlanHardware, BadValueIsNamed) {
  test::TempDir d;
  const std::string full = hardware_to_toml(hardware_get("a100"));
  struct Case {
    std::string field, value, shown, unit;
  };
  const Case cases[] = {
      {"flops_fp32", "\"fast\"", "\"fast\"", "FLOP/s"}, {"mem_bytes", "-1", "-1", "bytes"},
      {"mem_bw", "0", "0", "bytes/s"},                  {"latency_s", "-1e-6", "-1e-06", "seconds"},
      {"efficiency", "1.5", "1.5", "from 1e-4 to 1"},    {"gpu", "1", "1", "true or false"},
      {"name", "\"\"", "\"\"", "string"},               {"inter_node_bw", "[1, 2]", "an array", "bytes/s"},
      // Finite and positive, but past any device: the planner's times went inf and nan, and
      // its text cut off the unit.
      {"flops_bf16", "1e-300", "1e-300", "from 1e6 to 1e18, FLOP/s"},
      {"latency_s", "1e300", "1e+300", "from 0 to 10, seconds"},
      {"mem_bytes", "1e300", "1e+300", "from 1e6 to 1e15, bytes"},
      {"mem_bw", "1e16", "1e+16", "from 1e3 to 1e15, bytes/s"},
      {"efficiency", "1e-300", "1e-300", "from 1e-4 to 1"},
      {"flops_fp32", "inf", "inf", "FLOP/s"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field + " = " + c.value);
    std::istringstream in(full);
    std::string text;
    for (std::string l; std::getline(in, l);) text += (l.rfind(c.field + " =", 0) == 0 ? c.field + " = " + c.value : l) + "\n";
    const std::string path = d / ("bad_" + c.field + ".toml");
    write_file(path, text);
    const std::string e = error_of([&] { hardware_read(path); });
    EXPECT_NE(e.find("bad value " + c.shown + " for [hardware]." + c.field), std::string::npos) << e;
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find(c.unit), std::string::npos) << e;
  }
}

TEST(PlanHardware, UnknownFieldsAndShapesAreErrors) {
  test::TempDir d;
  const std::string full = hardware_to_toml(hardware_get("h200"));
  write_file(d / "extra.toml", full + "flops_int8 = 1.9e15\n");
  std::string e = error_of([&] { hardware_read(d / "extra.toml"); });
  EXPECT_NE(e.find("unknown field [hardware].flops_int8"), std::string::npos) << e;
  EXPECT_NE(e.find(d / "extra.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("inter_node_bw"), std::string::npos) << e;  // lists the fields

  write_file(d / "section.toml", full + "[network]\nbw = 1\n");
  e = error_of([&] { hardware_read(d / "section.toml"); });
  EXPECT_NE(e.find("unknown top-level key \"network\""), std::string::npos) << e;

  write_file(d / "none.toml", "name = \"x\"\n");
  e = error_of([&] { hardware_read(d / "none.toml"); });
  EXPECT_NE(e.find("unknown top-level key \"name\""), std::string::npos) << e;
  write_file(d / "empty.toml", "");
  e = error_of([&] { hardware_read(d / "empty.toml"); });
  EXPECT_NE(e.find("no [hardware] table"), std::string::npos) << e;

  write_file(d / "syntax.toml", "[hardware]\nname = \n");
  e = error_of([&] { hardware_read(d / "syntax.toml"); });
  EXPECT_NE(e.find(d / "syntax.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
}

TEST(PlanHardware, UnknownNameListsTheBuiltins) {
  const std::string e = error_of([] { hardware_get("tpu-v5"); });
  EXPECT_NE(e.find("unknown hardware \"tpu-v5\""), std::string::npos) << e;
  for (const std::string& n : hardware_builtin_names()) EXPECT_NE(e.find(n), std::string::npos) << e;
  EXPECT_NE(e.find("FILE.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("bench profile"), std::string::npos) << e;

  const std::string f = error_of([] { hardware_get("/nonexistent/box.toml"); });
  EXPECT_NE(f.find("cannot read hardware profile /nonexistent/box.toml"), std::string::npos) << f;
  EXPECT_NE(f.find("h100"), std::string::npos) << f;  // and what else works
}

// Sanity bounds only: speeds differ from machine to machine.
void expect_plausible(const Hardware& h) {
  EXPECT_FALSE(h.gpu);
  EXPECT_EQ(h.name.rfind("cpu-", 0), 0u) << h.name;
  EXPECT_GT(h.flops_fp32, 1e8);  // 0.1 GFLOP/s .. 100 TFLOP/s per rank
  EXPECT_LT(h.flops_fp32, 1e14);
  EXPECT_GE(h.flops_bf16, h.flops_fp32 / 100);
  EXPECT_EQ(h.flops_fp16, h.flops_fp32);
  EXPECT_GT(h.mem_bytes, 1e8);
  EXPECT_LT(h.mem_bytes, 1e14);
  EXPECT_GT(h.mem_bw, 1e8);
  EXPECT_LT(h.mem_bw, 1e13);
  EXPECT_GT(h.intra_node_bw, 1e7);
  EXPECT_LT(h.intra_node_bw, 1e13);
  EXPECT_EQ(h.inter_node_bw, h.intra_node_bw);  // one machine: not measured
  EXPECT_GT(h.latency_s, 0);
  EXPECT_LT(h.latency_s, 0.1);
  EXPECT_GT(h.efficiency, 0.001);
  EXPECT_LE(h.efficiency, 1);
}

// The profile's header comments as one line each: "# " lines wrap at 100 columns wherever
// the CPU's name and the kernels' description end.
std::string unwrapped(const std::string& text) {
  std::string s = text;
  for (size_t at = 0; (at = s.find("\n# ", at)) != std::string::npos;)
    if (at + 3 < s.size() && s[at + 3] != ' ') s.replace(at, 3, " ");
    else at += 3;
  return s;
}

TEST(PlanHardware, BenchProfileWritesAProfile) {
  test::TempDir d;
  const std::string path = d / "sub/profile.toml";
  std::string out;
  const int rc = test::run_command(std::string(MESHTRAIN_BIN) + " bench profile --seconds 1 --out " + path, &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("measuring fp32 matrix products"), std::string::npos) << out;
  EXPECT_NE(out.find("wrote " + path), std::string::npos) << out;
  const Hardware h = hardware_read(path);
  expect_plausible(h);
  const std::string text = read_text(path);
  EXPECT_NE(unwrapped(text).find("1 rank on 1 machine"), std::string::npos) << text;
  EXPECT_NE(text.find("#   estimated: one rank on the machine"), std::string::npos) << text;
  EXPECT_NE(text.find("#   not measured: all ranks are on one machine"), std::string::npos) << text;
  EXPECT_NE(text.find("#   measured: forward + backward of gpt2"), std::string::npos) << text;
  // bf16's rate: where meshtrain's bf16 kernel runs (ops/gemm_bf16.h), a bf16 step's over
  // efficiency, the kernel's peak beside it; elsewhere fp32's.
  for (const char* want : bf16_gemm_available()
                              ? std::vector<const char*>{"#   measured: a bf16 forward + backward",
                                                         "#   The products alone: meshtrain's AVX512_BF16 kernel"}
                              : std::vector<const char*>{"#   not measured, fp32's rate: bf16 runs fp32 products"})
    EXPECT_NE(text.find(want), std::string::npos) << want << " in\n" << text;

  // --out - prints the profile on stdout (progress on stderr).
  std::string printed;
  ASSERT_EQ(test::run_command("{ " + std::string(MESHTRAIN_BIN) + " bench profile --seconds 0.1 --out - 2>/dev/null > " +
                                  d / "stdout.toml; }",
                              &printed),
            0) << printed;
  expect_plausible(hardware_read(d / "stdout.toml"));
}

// efficiency from a step's rate: below the products' rate, the fraction of it; above (the
// products timed in a slow spell), flops_fp32 raised to the step's rate, with the
// precisions that copy fp32's rate and not the one with a kernel of its own; either way
// flops_fp32 x efficiency is the step's rate.
TEST(PlanHardware, EfficiencyKeepsTheStepsRate) {
  Hardware h;
  h.flops_fp32 = h.flops_fp16 = 100e9, h.flops_bf16 = 300e9;
  EXPECT_FALSE(set_efficiency(h, 80e9));
  EXPECT_EQ(h.flops_fp32, 100e9);
  EXPECT_DOUBLE_EQ(h.efficiency, 0.8);
  EXPECT_TRUE(set_efficiency(h, 120e9));
  EXPECT_EQ(h.flops_fp32, 120e9);
  EXPECT_EQ(h.flops_fp16, 120e9);
  EXPECT_EQ(h.flops_bf16, 300e9);
  EXPECT_EQ(h.efficiency, 1);
  h.flops_bf16 = h.flops_fp32;  // no bf16 kernel: fp32's rate
  EXPECT_TRUE(set_efficiency(h, 150e9));
  EXPECT_EQ(h.flops_bf16, 150e9);
  EXPECT_EQ(h.flops_fp32 * h.efficiency, 150e9);
}

TEST(PlanHardware, BenchProfileUnderTwoRanks) {
  test::TempDir d;
  const std::string path = d / "profile2.toml";
  std::string out;
  const int rc = test::run_command(
      "OMP_NUM_THREADS=1 " + std::string(MESHTRAIN_BIN) + " launch -n 2 bench profile --seconds 1 --out " + path, &out);
  ASSERT_EQ(rc, 0) << out;
  const Hardware h = hardware_read(path);
  expect_plausible(h);
  const std::string text = read_text(path);
  EXPECT_NE(unwrapped(text).find("2 ranks on 1 machine"), std::string::npos) << text;
  EXPECT_NE(text.find("#   measured: allreduce bus bandwidth"), std::string::npos) << text;
  EXPECT_NE(text.find("2 ranks on it"), std::string::npos) << text;  // memory per rank
}

TEST(PlanHardware, BenchProfileRefusesBadOptions) {
  std::string out;
  EXPECT_NE(test::run_command(std::string(MESHTRAIN_BIN) + " bench profile --seconds soon", &out), 0);
  EXPECT_NE(out.find("--seconds soon"), std::string::npos) << out;
  // an unknown option is an error like any other: named, with the usage, exit status 1
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " bench profile --frobnicate 1", &out), 1);
  EXPECT_NE(out.find("error: bench profile: unknown option --frobnicate\nusage:"), std::string::npos) << out;
  EXPECT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " bench profile --help", &out), 0);
  EXPECT_NE(out.find("--seconds"), std::string::npos) << out;
}

}  // namespace
}  // namespace mt::plan
