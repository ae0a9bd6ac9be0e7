// bf16 and fp16 <-> f32 conversions (round to nearest even), for gradient compression and
// safetensors files.
#pragma once
#include <cstdint>
#include <cstring>

namespace mt {

inline uint16_t f32_to_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);  // NaN stays NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t b = uint32_t{h} << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while (!(mant & 0x400));
      bits = sign | ((127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

inline uint16_t f32_to_f16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t absb = b & 0x7fffffffu;
  if (absb > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absb >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absb < 0x38800000u) {  // subnormal or zero in fp16
    if (absb < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t mant = (absb & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(absb >> 23);  // 14 .. 24
    uint32_t v = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (v & 1))) ++v;
    return static_cast<uint16_t>(sign | v);
  }
  uint32_t v = ((absb >> 13) - (112u << 10));
  const uint32_t rem = absb & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (v & 1))) ++v;
  return static_cast<uint16_t>(sign | v);
}

// The same over n values, with the CPU's F16C instructions where it has them (half.cpp).
void f32_to_f16_n(const float* src, uint16_t* dst, int64_t n);
void f16_to_f32_n(const uint16_t* src, float* dst, int64_t n);

}  // namespace mt
