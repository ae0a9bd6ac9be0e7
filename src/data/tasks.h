// The built-in generated dataset: lines of small symbolic tasks a tiny byte-level model
// (~1M parameters, e.g. 4 layers, d_model 128, seq_len 128) visibly learns within a few
// hundred steps on two cores. Used when data.path is empty; encoded with the byte tokenizer.
//
// Task mix (share of lines):
//   copy  20%  "copy xyz=xyz\n"       3-6 lowercase letters, repeated
//   rev   30%  "rev abcde=edcba\n"    3-6 lowercase letters, reversed
//   sort  25%  "sort 31415=11345\n"   3-6 digits, sorted ascending
//   add   25%  "add 23+58=81\n"       two numbers 0-99, their decimal sum
// The answer is everything after '=' up to and including the newline.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

// n_lines task lines generated from seed (deterministic: line i depends only on (seed, i)).
std::string tasks_generate(uint64_t seed, int64_t n_lines);

// For one sequence of inputs/targets [T] (byte tokens), marks with 1 the targets that are
// answer characters: after the '=' of the current line, up to and including the newline.
// Position t is an answer position when inputs[0..t] holds an '=' after its last '\n' (or
// end-of-text id 256). Positions before the window's first '\n' whose line start is not
// visible count only if an '=' is visible; otherwise they are 0. These are the positions
// whose greedy accuracy measures whether the model solved the task.
void tasks_answer_mask(const int32_t* inputs, const int32_t* targets, int T, uint8_t* mask);

// Entropy in nats of the byte frequencies of text: the loss of a model that predicts only
// byte frequencies, a baseline to print beside the validation loss. 0 for empty text.
double tasks_unigram_entropy(const std::string& text);

}  // namespace mt
