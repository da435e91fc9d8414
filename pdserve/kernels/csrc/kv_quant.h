// Quantized KV cache elements (pdserve/engine/kv_quant.py): int8 (a scale per K/V row), fp8
// e4m3fn / e5m2 (a scale per layer). The attention kernels read them as float32 with the loads
// below and apply the scales outside the dot products: a score is (q . k_raw) * k_scale(row), a
// value row's weight p * v_scale(row), so the inner loops only widen bytes.
//
// fp8 to float32 goes through the float16 bit pattern, which the hardware converts exactly
// (F16C; float16 subnormal inputs too, whatever the denormals mode): e5m2 is the top byte of a
// float16; e4m3 (bias 7) put in a float16 (bias 15) reads 2^-8 of its value, subnormals
// included, and is multiplied back by 256 (exact). e4m3fn's NaN (0x7f / 0xff) is never stored
// (quantization clamps to +-448).
//
// No torch headers: the vector kernels include it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "isa.h"

namespace pds {

struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

// whether elements of type T carry scales (the kernels' quantized paths)
template <typename T>
constexpr bool kQuantKV = false;
template <>
constexpr bool kQuantKV<int8_t> = true;
template <>
constexpr bool kQuantKV<Fp8E4M3> = true;
template <>
constexpr bool kQuantKV<Fp8E5M2> = true;

inline float fp8_e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 0x7;
  const float mag = e == 0 ? float(m) * (1.f / 512.f) : std::ldexp(1.f + float(m) / 8.f, e - 7);
  return (b & 0x80) ? -mag : mag;
}
inline float fp8_e5m2_to_f32(uint8_t b) {
  const int e = (b >> 2) & 0x1f, m = b & 0x3;
  const float mag = e == 0 ? float(m) * (1.f / 65536.f) : std::ldexp(1.f + float(m) / 4.f, e - 15);
  return (b & 0x80) ? -mag : mag;
}

template <>
inline float load_f32<int8_t>(const int8_t* p) { return float(*p); }
template <>
inline float load_f32<Fp8E4M3>(const Fp8E4M3* p) { return fp8_e4m3_to_f32(p->bits); }
template <>
inline float load_f32<Fp8E5M2>(const Fp8E5M2* p) { return fp8_e5m2_to_f32(p->bits); }

// The element type of a cache whose kernel is not templated on it (the bf16 flash kernel).
enum class KVKind : int { kPlain = 0, kInt8, kFp8E4M3, kFp8E5M2 };

// What dequantizes one layer's K and V in a kernel call: per-row scales ([rows] float32, the
// pool's [pages, kv_heads, page_size] scales, indexed like the rows) or one scale each.
struct KVScales {
  const float* k_rows = nullptr;
  const float* v_rows = nullptr;
  float k = 1.f, v = 1.f;
  float k_at(int64_t row) const { return k_rows ? k_rows[row] : k; }
  float v_at(int64_t row) const { return v_rows ? v_rows[row] : v; }
};

}  // namespace pds

#if PDS_X86
#include <immintrin.h>
namespace pds {
// 16 float16 bit patterns of fp8 bytes (zero-extended to 16 bits): e4m3 at 2^-8 of its value
PDS_AVX512 inline __m256i fp8_e4m3_as_f16(__m256i h) {
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
  return _mm256_or_si256(sign, mag);
}

template <typename T>
PDS_AVX512 inline __m512 load16(const T* p, __mmask16 m);
template <>
PDS_AVX512 inline __m512 load16<int8_t>(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
template <>
PDS_AVX512 inline __m512 load16<Fp8E4M3>(const Fp8E4M3* p, __mmask16 m) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  return _mm512_mul_ps(_mm512_cvtph_ps(fp8_e4m3_as_f16(h)), _mm512_set1_ps(256.f));
}
template <>
PDS_AVX512 inline __m512 load16<Fp8E5M2>(const Fp8E5M2* p, __mmask16 m) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
}
}  // namespace pds
#endif
