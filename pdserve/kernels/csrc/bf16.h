// bfloat16 as uint16_t: conversions and loads/stores of float32 or bf16 elements as float.
// No torch headers (the vector kernels include it).
#pragma once

#include <cstdint>
#include <cstring>

namespace pds {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch does (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <typename T>
inline float load_f32(const T* p);
template <>
inline float load_f32<float>(const float* p) { return *p; }
template <>
inline float load_f32<uint16_t>(const uint16_t* p) { return bf16_to_f32(*p); }

template <typename T>
inline void store_f32(T* p, float v);
template <>
inline void store_f32<float>(float* p, float v) { *p = v; }
template <>
inline void store_f32<uint16_t>(uint16_t* p, float v) { *p = f32_to_bf16(v); }

// round a float32 value to the element type T and back (identity for float)
template <typename T>
inline float round_to(float v);
template <>
inline float round_to<float>(float v) { return v; }
template <>
inline float round_to<uint16_t>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

}  // namespace pds
