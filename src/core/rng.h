// Counter-based random numbers (Philox-4x32-10). A value is a pure function of
// (seed, stream, index), so a parameter element initialised by its global index gets
// the same value whatever layout holds it, and a resumed run needs no saved RNG state.
#pragma once
#include <cstdint>

namespace mt {

struct Philox {
  uint64_t seed;
  // Four 32-bit random words for the 128-bit counter (stream, index).
  void block(uint64_t stream, uint64_t index, uint32_t out[4]) const;
  // A uniform float in [0, 1) and a standard normal, both determined by (stream, index).
  double uniform(uint64_t stream, uint64_t index) const;
  double normal(uint64_t stream, uint64_t index) const;
};

// A stable 64-bit stream id from a name (FNV-1a), e.g. a parameter's Hugging Face name.
uint64_t stream_id(const char* name);

}  // namespace mt
