// Pipeline schedules as data: every generated schedule checks, hand-broken ones do not (with
// messages naming rank and action), the simulator reproduces the closed forms, the text
// format round-trips and rejects malformed lines, and `meshtrain schedule` agrees with the
// simulator.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"
#include "parallel/schedule_svg.h"
#include "test_util.h"

namespace mt {
namespace {

using test::run_command;
using test::TempDir;

std::string joined(const std::vector<std::string>& problems) {
  std::string all;
  for (const std::string& p : problems) all += p + "\n";
  return all;
}

// Index of the first action of `kind` for (micro, chunk) on a rank's list; fails the test if none.
int find(const std::vector<Action>& list, Action::Kind kind, int micro, int chunk = 0) {
  for (int i = 0; i < static_cast<int>(list.size()); ++i)
    if (list[i].kind == kind && list[i].micro == micro && list[i].chunk == chunk) return i;
  ADD_FAILURE() << "no " << action_kind_name(kind) << " micro " << micro << " chunk " << chunk;
  return 0;
}

// ---- Generators and checker ----

TEST(Schedule, CheckerAcceptsEveryGeneratedSchedule) {
  int checked = 0;
  for (int P = 1; P <= 16; ++P)
    for (int v = 1; v <= 4; ++v)
      for (int m = 1; m <= 64; ++m)
        for (const std::string& name : schedule_names()) {
          if (schedule_layout_issue(name, P, v, m)) continue;
          const Schedule s = schedule_make(name, P, v, m);
          const std::vector<std::string> problems = schedule_check(s);
          ASSERT_TRUE(problems.empty()) << name << " P " << P << " v " << v << " m " << m << ":\n" << joined(problems);
          size_t compute = 0;
          for (const auto& list : s.ranks)
            compute += std::count_if(list.begin(), list.end(), [](const Action& a) { return a.is_compute(); });
          const bool split = schedule_splits_backward(name);  // F, BI and BW: three per micro-batch and stage
          ASSERT_EQ(compute, static_cast<size_t>(P * v * m * (split ? 3 : 2))) << name << " P " << P << " m " << m;
          ++checked;
        }
  // gpipe, 1f1b, zb-h1 at v = 1 and zbv at v = 2, every m; interleaved at v = 2..4, m a multiple of P.
  int interleaved = 0;
  for (int P = 1; P <= 16; ++P) interleaved += 3 * (64 / P);
  EXPECT_EQ(checked, 16 * 64 * 4 + interleaved);
}

TEST(Schedule, LayoutsTheSchedulesCannotRun) {
  auto issue = schedule_layout_issue("zbv", 4, 1, 8);
  ASSERT_TRUE(issue);
  EXPECT_EQ(issue->knob, LayoutIssue::chunks);
  EXPECT_EQ(issue->use, 2);
  issue = schedule_layout_issue("interleaved", 4, 2, 6);  // groups of P micro-batches
  ASSERT_TRUE(issue);
  EXPECT_EQ(issue->knob, LayoutIssue::microbatches);
  EXPECT_EQ(issue->use, 8);
  EXPECT_EQ(schedule_layout_issue("interleaved", 4, 2, 3)->use, 4);
  EXPECT_EQ(schedule_layout_issue("interleaved", 4, 1, 8)->knob, LayoutIssue::chunks);
  EXPECT_EQ(schedule_layout_issue("1f1b", 4, 2, 8)->use, 1);
  EXPECT_FALSE(schedule_layout_issue("zb-h1", 8, 1, 3));  // fewer micro-batches than ranks is fine
  EXPECT_THROW(schedule_layout_issue("2f2b", 4, 1, 8), Error);
  EXPECT_THROW(schedule_make("interleaved", 4, 2, 6), Error);
}

TEST(Schedule, PlacementOfChunks) {
  const PipeLayout loop{4, 2, 8, Placement::loop}, vee{4, 2, 8, Placement::vee};
  EXPECT_EQ(loop.stage(1, 1), 5);
  EXPECT_EQ(vee.stage(1, 1), 6);  // back up the ranks: rank 3 holds stages 3 and 4
  EXPECT_EQ(vee.stage(3, 1), 4);
  EXPECT_EQ(vee.stage(0, 1), 7);  // rank 0 holds the embedding and the loss
  for (const PipeLayout& L : {loop, vee})
    for (int s = 0; s < L.stages(); ++s) EXPECT_EQ(L.stage(L.rank_of(s), L.chunk_of(s)), s);
}

// 1f1b, P = 4, m = 8: the lists the broken ones start from.
Schedule base() { return schedule_make("1f1b", 4, 1, 8); }

TEST(Schedule, CheckerFindsAMissingAction) {
  Schedule s = base();
  auto& list = s.ranks[2];
  list.erase(list.begin() + find(list, Action::B, 3));
  EXPECT_NE(joined(schedule_check(s)).find("rank 2: no B (or BI and BW) micro 3 chunk 0"), std::string::npos)
      << joined(schedule_check(s));
}

TEST(Schedule, CheckerFindsADuplicatedAction) {
  Schedule s = base();
  auto& list = s.ranks[1];
  const int f = find(list, Action::F, 2);
  list.insert(list.begin() + f + 1, list[f]);
  const std::string p = joined(schedule_check(s));
  EXPECT_NE(p.find("rank 1 action " + std::to_string(f + 1) + " (F micro 2 chunk 0): repeats action " +
                   std::to_string(f)),
            std::string::npos)
      << p;
}

TEST(Schedule, CheckerFindsASendMovedAfterTheReceiveThatWaitsForIt) {
  // Rank 0 posts micro-batch 0's activations only after waiting for its gradient: rank 1
  // can never compute that gradient. Each rank's own order is still consistent.
  Schedule s = base();
  auto& list = s.ranks[0];
  const int send = find(list, Action::SEND_ACT, 0);
  const Action moved = list[send];
  list.erase(list.begin() + send);
  list.insert(list.begin() + find(list, Action::RECV_GRAD, 0) + 1, moved);
  const std::string p = joined(schedule_check(s));
  EXPECT_NE(p.find("deadlock"), std::string::npos) << p;
  EXPECT_NE(p.find("rank 0 action " + std::to_string(find(list, Action::RECV_GRAD, 0)) +
                   " (RECV_GRAD micro 0 chunk 0 from rank 1) waits forever"),
            std::string::npos)
      << p;
  EXPECT_NE(p.find("rank 1 would send it"), std::string::npos) << p;
}

TEST(Schedule, CheckerFindsASendWithoutAReceive) {
  Schedule s = base();
  auto& list = s.ranks[2];
  list.erase(list.begin() + find(list, Action::RECV_ACT, 5));
  const std::string p = joined(schedule_check(s));
  const int send = find(s.ranks[1], Action::SEND_ACT, 5);
  EXPECT_NE(p.find("rank 2: no RECV_ACT micro 5 chunk 0 from rank 1, so rank 1 action " + std::to_string(send) +
                   " (SEND_ACT micro 5 chunk 0 to rank 2) has no match"),
            std::string::npos)
      << p;
}

TEST(Schedule, CheckerFindsActionsOutOfOrderAndWrongPeers) {
  Schedule s = base();
  auto& last = s.ranks[3];
  std::swap(last[find(last, Action::F, 4)], last[find(last, Action::B, 4)]);  // the loss's backward before its forward
  s.ranks[0][find(s.ranks[0], Action::SEND_ACT, 1)].peer = 2;
  const std::string p = joined(schedule_check(s));
  EXPECT_NE(p.find("(SEND_ACT micro 1 chunk 0 to rank 2): stage 1 is on rank 1"), std::string::npos) << p;
  s.ranks[0][find(s.ranks[0], Action::SEND_ACT, 1)].peer = 1;
  const std::string q = joined(schedule_check(s));
  EXPECT_NE(q.find("(B micro 4 chunk 0): comes before F micro 4 chunk 0"), std::string::npos) << q;
}

TEST(Schedule, CheckerFindsMixedBackwardsAndTransfersWithinARank) {
  Schedule s = schedule_make("interleaved", 2, 2, 2);  // P = 1 would have no transfers at all
  Schedule one = schedule_make("interleaved", 1, 2, 2);
  one.ranks[0].push_back({Action::SEND_ACT, 0, 0, 0});  // stage 1 is on the same rank
  EXPECT_NE(joined(schedule_check(one)).find("is on this rank too"), std::string::npos);
  auto& list = s.ranks[1];
  list.insert(list.begin() + find(list, Action::B, 1, 1) + 1, {Action::BW, 1, 1, -1});
  EXPECT_NE(joined(schedule_check(s)).find("also split into BI/BW"), std::string::npos) << joined(schedule_check(s));
  s.ranks.pop_back();
  EXPECT_EQ(schedule_check(s), std::vector<std::string>{"the schedule has 1 rank lists for 2 pipeline ranks"});
}

TEST(Schedule, CheckerLimitsItsMessages) {
  Schedule s = base();
  for (auto& list : s.ranks) list.clear();
  const std::vector<std::string> p = schedule_check(s, 5);
  ASSERT_EQ(p.size(), 6u);
  EXPECT_NE(p.back().find("more problems"), std::string::npos);
}

// ---- Simulator ----

// Default costs F 1, B 2, BI 1, BW 1 (a rank's whole layers; a chunk's action 1/v of it), free transfers.
TEST(Schedule, GpipeAnd1f1bBubble) {
  for (const char* name : {"gpipe", "1f1b"})
    for (int P : {1, 2, 3, 4, 8})
      for (int m : {1, 2, 3, 4, 5, 8, 13, 32}) {
        const Simulation sim = schedule_simulate(schedule_make(name, P, 1, m));
        EXPECT_DOUBLE_EQ(sim.step_time, 3.0 * (m + P - 1)) << name << " P " << P << " m " << m;
        EXPECT_NEAR(sim.bubble, (P - 1.0) / (m + P - 1), 1e-12) << name << " P " << P << " m " << m;
      }
}

TEST(Schedule, InterleavedBubble) {
  for (int P : {2, 3, 4, 8})
    for (int v : {2, 3, 4})
      for (int m : {P, 2 * P, 3 * P}) {
        const Simulation sim = schedule_simulate(schedule_make("interleaved", P, v, m));
        EXPECT_NEAR(sim.step_time, 3.0 * (m + (P - 1.0) / v), 1e-9) << "P " << P << " v " << v << " m " << m;
        EXPECT_NEAR(sim.bubble, (P - 1.0) / (v * m + P - 1), 1e-12) << "P " << P << " v " << v << " m " << m;
      }
}

// With F, BI and BW one unit each, 1f1b's backward (B = 2) keeps each rank idle 3(P-1)
// units; zb-h1's BIs pass the gradient down in one unit per rank and its BWs fill the tail,
// leaving P-1 idle units per rank: exactly a third. Its bubble fraction is then
// (P-1)/(3m+P-1), against 1f1b's (P-1)/(m+P-1). For m < P the last BWs cannot all hide
// and it is bounded by 1f1b's instead.
TEST(Schedule, ZeroBubbleH1IsAThirdOf1f1b) {
  for (int P : {2, 3, 4, 8, 16})
    for (int m : {1, 2, P - 1, P, P + 1, 2 * P, 3 * P + 2, 64}) {
      const Simulation zb = schedule_simulate(schedule_make("zb-h1", P, 1, m));
      const Simulation one = schedule_simulate(schedule_make("1f1b", P, 1, m));
      const double idle_zb = zb.step_time - 3.0 * m, idle_1f1b = one.step_time - 3.0 * m;  // per rank
      if (m >= P) {
        EXPECT_DOUBLE_EQ(idle_zb, idle_1f1b / 3) << "P " << P << " m " << m;
        EXPECT_NEAR(zb.bubble, (P - 1.0) / (3 * m + P - 1), 1e-12) << "P " << P << " m " << m;
      }
      EXPECT_LE(zb.step_time, one.step_time) << "P " << P << " m " << m;
    }
}

// A V's last rank can start only after P-1 chunk forwards of 1/2 each, so no schedule of
// this layout ends before 3m + (P-1)/2; zbv's greedy order reaches that at P 4, m 8 and
// stays within zb-h1's step whenever m >= P.
TEST(Schedule, ZeroBubbleVNearItsBound) {
  EXPECT_DOUBLE_EQ(schedule_simulate(schedule_make("zbv", 4, 2, 8)).step_time, 3 * 8 + 1.5);
  for (int P : {2, 3, 4, 8, 16})
    for (int m : {P, P + 1, 2 * P, 3 * P + 1, 64}) {
      const Simulation v = schedule_simulate(schedule_make("zbv", P, 2, m));
      const Simulation h1 = schedule_simulate(schedule_make("zb-h1", P, 1, m));
      EXPECT_GE(v.step_time, 3 * m + (P - 1) / 2.0 - 1e-9) << "P " << P << " m " << m;
      EXPECT_LE(v.step_time, h1.step_time) << "P " << P << " m " << m;
    }
}

// Activations held (schedule_sim.h counts (micro-batch, chunk) pairs, each 1/v of a rank's layers).
TEST(Schedule, PeakActivationsInFlight) {
  const int P = 4, m = 8;
  const Simulation gpipe = schedule_simulate(schedule_make("gpipe", P, 1, m));
  const Simulation one = schedule_simulate(schedule_make("1f1b", P, 1, m));
  const Simulation zb = schedule_simulate(schedule_make("zb-h1", P, 1, m));
  const Simulation v = schedule_simulate(schedule_make("zbv", P, 2, m));
  EXPECT_EQ(gpipe.peak_in_flight, std::vector<int>(P, m));
  EXPECT_EQ(one.peak_in_flight, (std::vector<int>{4, 3, 2, 1}));  // P - r
  EXPECT_EQ(one.peak_until_weight, one.peak_in_flight);
  EXPECT_EQ(zb.peak_in_flight, one.peak_in_flight);
  EXPECT_EQ(zb.peak_until_weight, std::vector<int>(P, P));  // every rank holds 1f1b's first-rank peak
  EXPECT_EQ(v.peak_until_weight, std::vector<int>(P, 2 * P));  // P micro-batches of a rank's two chunks
  // Megatron: rank r runs 2(P-r-1) + (v-1)P warm-up forwards, then one more before its first
  // backward; at rank 0 that is P(1 + (P-1)/(Pv)) micro-batches of a rank's layers.
  for (int vv : {2, 3, 4})
    for (int mm : {P, 2 * P, 4 * P}) {
      const Simulation in = schedule_simulate(schedule_make("interleaved", P, vv, mm));
      for (int r = 0; r < P; ++r)
        EXPECT_EQ(in.peak_in_flight[r], std::min(2 * (P - r - 1) + (vv - 1) * P + 1, vv * mm))
            << "v " << vv << " m " << mm << " rank " << r;
    }
  EXPECT_EQ(schedule_simulate(schedule_make("1f1b", 8, 1, 3)).peak_in_flight[0], 3);  // never more than m
}

TEST(Schedule, StageWeightsAndTransferTimes) {
  // gpipe P 2, m 1, stage 1 three times as heavy: F 1 + F 3 + B 6 + B 2.
  ActionCosts heavy;
  heavy.stage_weight = {1, 3};
  EXPECT_DOUBLE_EQ(schedule_simulate(schedule_make("gpipe", 2, 1, 1), heavy).step_time, 12);
  // 1f1b P 2, m 1 with send 0.5 and receive 0.25: F [0,1], send [1,1.5]; rank 1 receives
  // [1.5,1.75], F [1.75,2.75], B [2.75,4.75], sends [4.75,5.25]; rank 0 receives
  // [5.25,5.5], B [5.5,7.5]. Compute 6 of 2 x 7.5.
  ActionCosts wire;
  wire.send = 0.5;
  wire.recv = 0.25;
  const Simulation sim = schedule_simulate(schedule_make("1f1b", 2, 1, 1), wire);
  EXPECT_DOUBLE_EQ(sim.step_time, 7.5);
  EXPECT_DOUBLE_EQ(sim.bubble, 1 - 6 / 15.0);
  EXPECT_DOUBLE_EQ(sim.ranks[0].back().start, 5.5);
  ActionCosts bad;
  bad.stage_weight = {1, 1, 1};
  EXPECT_THROW(schedule_simulate(schedule_make("gpipe", 2, 1, 1), bad), Error);
  Schedule broken = base();
  broken.ranks[0].pop_back();
  EXPECT_THROW(schedule_simulate(broken), Error);
}

TEST(Schedule, PictureHasEveryActionAndTheBubble) {
  const Simulation a = schedule_simulate(schedule_make("zb-h1", 4, 1, 8));
  const Simulation b = schedule_simulate(schedule_make("interleaved", 4, 2, 8));
  const std::string svg = schedule_svg({a, b});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("zb-h1: pp 4, 1 chunk per rank, 8 micro-batches; step 27, bubble 11.1%"), std::string::npos);
  EXPECT_NE(svg.find("interleaved: pp 4, 2 chunks per rank"), std::string::npos);
  size_t boxes = 0;
  for (size_t at = svg.find("<title>"); at != std::string::npos; at = svg.find("<title>", at + 1)) ++boxes;
  EXPECT_EQ(boxes, 4u * 8 * 3 + 4u * 2 * 8 * 2);  // every compute action, no zero-time transfer
  for (const char* legend : {">F</text>", ">B</text>", ">BI</text>", ">BW</text>"})
    EXPECT_NE(svg.find(legend), std::string::npos) << legend;
}

// ---- Text format ----

TEST(Schedule, TextRoundTrip) {
  TempDir d;
  for (const std::string& name : schedule_names()) {
    const Schedule s = schedule_make(name, 3, schedule_default_chunks(name), 6);
    const Schedule back = schedule_from_text(schedule_to_text(s), "mem");
    EXPECT_EQ(back.layout, s.layout) << name;
    EXPECT_EQ(back.ranks, s.ranks) << name;
    schedule_write(d / (name + ".csv"), s);
    EXPECT_EQ(schedule_read(d / (name + ".csv")).ranks, s.ranks) << name;
  }
}

TEST(Schedule, TextByHand) {
  // 1f1b at P 2, m 1, written rank 1 first, with comments and blank lines.
  const std::string text =
      "# two ranks, one micro-batch\n"
      "layout, pp=2, chunks=1, microbatches=1\n"
      "\n"
      "1,RECV_ACT,0,0,0   # the first stage's output\n"
      "1,F,0,0\n1,B,0,0\n1,SEND_GRAD,0,0,0\n"
      "0,F,0,0\n0,SEND_ACT,0,0,1\n0,RECV_GRAD,0,0,1\n0,B,0,0\n";
  const Schedule s = schedule_from_text(text, "hand.csv");
  EXPECT_EQ(s.ranks, schedule_make("1f1b", 2, 1, 1).ranks);
  EXPECT_TRUE(schedule_check(s).empty());
}

TEST(Schedule, TextRejectsMalformedLines) {
  const std::string layout = "layout,pp=2,chunks=1,microbatches=2\n";
  auto error = [](const std::string& text) {
    try {
      schedule_from_text(text, "s.csv");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("0,F,0,0\n").find("s.csv:1: the layout line must come before"), std::string::npos);
  EXPECT_NE(error("# nothing\n").find("s.csv: no layout line"), std::string::npos);
  EXPECT_NE(error("layout,pp=2\n").find("s.csv:1: the layout line needs pp, chunks and microbatches"),
            std::string::npos);
  EXPECT_NE(error("layout,pp=2,chunks=1,microbatches=2,stages=w\n").find("s.csv:1: unknown layout entry"),
            std::string::npos);
  EXPECT_NE(error(layout + layout).find("s.csv:2: a second layout line"), std::string::npos);
  EXPECT_NE(error(layout + "0,F,0,0\n0,FWD,1,0\n").find("s.csv:3: unknown kind \"FWD\""), std::string::npos);
  EXPECT_NE(error(layout + "\n0,SEND_ACT,0,0\n").find("s.csv:3: SEND_ACT needs the peer rank"), std::string::npos);
  EXPECT_NE(error(layout + "0,F,0,0,1\n").find("s.csv:2: F names no peer"), std::string::npos);
  EXPECT_NE(error(layout + "2,F,0,0\n").find("s.csv:2: rank 2 is out of range 0..1"), std::string::npos);
  EXPECT_NE(error(layout + "0,F,2,0\n").find("s.csv:2: micro 2 is out of range 0..1"), std::string::npos);
  EXPECT_NE(error(layout + "0,F,x1,0\n").find("s.csv:2: micro \"x1\" is not a whole number"), std::string::npos);
  EXPECT_NE(error(layout + "0,F,0\n").find("s.csv:2: 3 fields"), std::string::npos);
  EXPECT_NE(error(layout + "0,F,0,0,\n").find("s.csv:2: F names no peer"), std::string::npos);
  // Each count within its range, their product not (2^52 forward passes: it crashed).
  EXPECT_NE(error("layout,pp=65536,chunks=65536,microbatches=1048576\n0,F,0,0\n")
                .find("s.csv:1: pp x chunks x microbatches = 65536 x 65536 x 1048576 forward passes per step, more "
                      "than the 4194304 meshtrain schedules"),
            std::string::npos);
}

// ---- The command ----

std::string schedule_cmd(const std::string& args, int* status) {
  std::string out;
  *status = run_command(std::string(MESHTRAIN_BIN) + " schedule " + args, &out);
  return out;
}

TEST(Schedule, CommandJsonMatchesTheSimulator) {
  int status = 0;
  const std::string out = schedule_cmd("--pp 4 --microbatches 8 --schedule zb-h1 --json", &status);
  ASSERT_EQ(status, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  const Schedule s = schedule_make("zb-h1", 4, 1, 8);
  const Simulation sim = schedule_simulate(s);
  EXPECT_DOUBLE_EQ(j.at("bubble").get<double>(), sim.bubble);
  EXPECT_DOUBLE_EQ(j.at("step_time").get<double>(), sim.step_time);
  EXPECT_EQ(j.at("peak_activations").get<std::vector<int>>(), sim.peak_in_flight);
  EXPECT_EQ(j.at("peak_activations_until_bw").get<std::vector<int>>(), sim.peak_until_weight);
  ASSERT_EQ(j.at("ranks").size(), 4u);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(j["ranks"][r].size(), s.ranks[r].size());
    const nlohmann::json& last = j["ranks"][r].back();
    EXPECT_EQ(last.at("kind").get<std::string>(), action_kind_name(s.ranks[r].back().kind));
    EXPECT_DOUBLE_EQ(last.at("end").get<double>(), sim.ranks[r].back().end);
  }
}

TEST(Schedule, CommandCompares) {
  TempDir d;
  int status = 0;
  std::string out = schedule_cmd("--pp 4 --microbatches 6 --compare --json --svg " + d / "all.svg", &status);
  ASSERT_EQ(status, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  std::vector<std::string> ran;
  for (const auto& s : j.at("schedules")) ran.push_back(s.at("schedule"));
  EXPECT_EQ(ran, (std::vector<std::string>{"gpipe", "1f1b", "zb-h1", "zbv"}));
  ASSERT_EQ(j.at("not_run").size(), 1u);
  EXPECT_EQ(j["not_run"][0].at("schedule"), "interleaved");
  std::ifstream svg(d / "all.svg");
  const std::string picture((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(picture.find("zbv: pp 4, 2 chunks per rank, 6 micro-batches"), std::string::npos);
  out = schedule_cmd("--pp 4 --microbatches 8 --compare", &status);
  ASSERT_EQ(status, 0) << out;
  const size_t row = out.find("\ninterleaved ");
  ASSERT_NE(row, std::string::npos) << out;
  std::istringstream fields(out.substr(row + 1, out.find('\n', row + 1) - row - 1));
  std::string name, chunks, step, bubble;
  fields >> name >> chunks >> step >> bubble;
  EXPECT_EQ(chunks + " " + step + " " + bubble, "2 28.5 0.1579") << out;  // 3(m + (P-1)/v); (P-1)/(vm+P-1)
}

TEST(Schedule, CommandTextAndFileRoundTrip) {
  TempDir d;
  int status = 0;
  std::string out = schedule_cmd("--schedule interleaved --pp 2 --microbatches 4 --csv " + d / "s/i.csv", &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_NE(out.find("rank 0 | F0c0 F1c0 F0c1 F1c1"), std::string::npos) << out;
  EXPECT_NE(out.find("bubble 0.1111"), std::string::npos) << out;  // (P-1)/(vm+P-1) = 1/9
  out = schedule_cmd("--schedule file:" + d / "s/i.csv" + " --json", &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_NEAR(nlohmann::json::parse(out).at("bubble").get<double>(), 1 / 9.0, 1e-12);
  out = schedule_cmd("--schedule file:" + d / "s/i.csv" + " --pp 4", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("--pp 4 differs from"), std::string::npos) << out;
  // An output that is the schedule file read, or the other output: refused before it is written
  // (the file was replaced by the picture).
  std::ifstream in(d / "s/i.csv");
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  for (const std::string& flag : {" --svg ", " --csv "}) {
    out = schedule_cmd("--schedule file:" + d / "s/i.csv" + flag + d / "s/i.csv", &status);
    EXPECT_EQ(status, 1) << out;
    EXPECT_NE(out.find(flag.substr(1) + d / "s/i.csv" + " is the same file as --schedule file:" + d / "s/i.csv"),
              std::string::npos) << out;
  }
  out = schedule_cmd("--svg " + d / "s/o" + " --csv " + d / "s/o", &status);
  EXPECT_EQ(status, 1) << out;
  EXPECT_NE(out.find("are the same file"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(d / "s/o"));
  std::ifstream again(d / "s/i.csv");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(again), {}), text);
}

TEST(Schedule, CommandErrorsNameTheFlagAndAValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--schedule zbv --chunks 1", "--chunks 1: zbv runs exactly 2 chunks per rank (a V); use --chunks 2"},
      {"--schedule interleaved --pp 4 --microbatches 6", "--microbatches 6: interleaved needs a multiple of the 4 "
                                                         "pipeline ranks; use --microbatches 8"},
      {"--schedule interleaved --chunks 1", "--chunks 1: interleaved needs at least 2 chunks per rank; use --chunks 2"},
      {"--schedule 1f1b --chunks 2", "use --chunks 1"},
      {"--schedule 2f2b", "--schedule 2f2b: no such schedule"},
      {"--microbatches 0", "--microbatches 0: must be at least 1"},
      {"--costs BX=1", "--costs: \"BX=1\" is not ACTION=TIME"},
      {"--costs F=inf", "--costs: F=inf: a time must be from 0 to 1e+09"},  // the step was inf, the bubble NaN
      {"--costs F=1e308,B=1e308", "--costs: F=1e308: a time must be from 0 to 1e+09"},
      {"--costs F=1,F=2", "--costs: F is given twice"},
      {"--compare --csv x.csv", "--csv writes one schedule"},
      {"--schedule file:/nonexistent/s.csv", "cannot open the schedule file /nonexistent/s.csv"},
      // A million micro-batches: its timelines took minutes and every byte of memory.
      {"--pp 4 --microbatches 1048576 --json", "pp x chunks x micro-batches = 4 x 1 x 1048576 forward passes, more than "
                                               "the 65536 this command simulates and draws: use fewer micro-batches, chunks or pipeline ranks"},
      {"--pp 2147483647 --chunks 2147483647 --microbatches 2147483647", "2147483647 x 2147483647 x 2147483647"},
  };
  for (const auto& [args, message] : cases) {
    int status = 0;
    const std::string out = schedule_cmd(args, &status);
    EXPECT_EQ(status, 1) << args;
    EXPECT_NE(out.find(message), std::string::npos) << args << "\n" << out;
  }
}

}  // namespace
}  // namespace mt
