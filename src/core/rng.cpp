#include "core/rng.h"

#include <cmath>

namespace mt {

void Philox::block(uint64_t stream, uint64_t index, uint32_t out[4]) const {
  uint32_t c0 = static_cast<uint32_t>(index), c1 = static_cast<uint32_t>(index >> 32);
  uint32_t c2 = static_cast<uint32_t>(stream), c3 = static_cast<uint32_t>(stream >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t{0xD2511F53u} * c0;
    uint64_t p1 = uint64_t{0xCD9E8D57u} * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = static_cast<uint32_t>(p1);
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

double Philox::uniform(uint64_t stream, uint64_t index) const {
  uint32_t r[4];
  block(stream, index, r);
  uint64_t bits = (uint64_t{r[0]} << 21) ^ r[1];  // 53 random bits
  return static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) * 0x1.0p-53;
}

double Philox::normal(uint64_t stream, uint64_t index) const {
  uint32_t r[4];
  block(stream, index, r);
  // Box-Muller on two 32-bit uniforms; u1 in (0, 1] so the log is finite.
  double u1 = (static_cast<double>(r[0]) + 1.0) * 0x1.0p-32;
  double u2 = static_cast<double>(r[1]) * 0x1.0p-32;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t stream_id(const char* name) {
  uint64_t h = 1469598103934665603ull;
  for (const char* p = name; *p; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  return h;
}

}  // namespace mt
