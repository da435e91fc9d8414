// Eight float32 (or int32) lanes: one AVX2 register on x86-64, two NEON registers on aarch64.
//
// The 8-lane kernels (*_vec8.cpp) are written once against these types and compile to AVX2 + FMA
// on x86-64 (functions marked PDS_V8, run after use_avx2()) and to NEON on aarch64 (baseline there).
// Both have 16 such registers, so the kernels' register tiles fit either. Every operation is the
// same IEEE float32 operation on both (fma is fused on both); only the order of horizontal sums
// differs, and each kernel states its summation order per output so that a row's result does not
// depend on the other rows of a call.
// No torch headers: these files compile in seconds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"
#include "isa.h"
#include "kv_quant.h"

#if PDS_HAS_V8
#if PDS_X86
#include <immintrin.h>
#else
#include <arm_neon.h>
#endif

#define PDS_VI PDS_V8 inline __attribute__((always_inline))

namespace pds {
namespace v8 {

#if PDS_X86
struct F8 {
  __m256 v;
};
struct I8 {  // 8 int32 lanes
  __m256i v;
};
struct M8 {  // a lane mask (all ones or all zeros per lane)
  __m256 v;
};
#else
struct F8 {
  float32x4_t lo, hi;
};
struct I8 {
  int32x4_t lo, hi;
};
struct M8 {
  uint32x4_t lo, hi;
};
#endif

// ---- construction, loads and stores -------------------------------------------------------------
#if PDS_X86
PDS_VI F8 zero() { return {_mm256_setzero_ps()}; }
PDS_VI F8 set1(float x) { return {_mm256_set1_ps(x)}; }
PDS_VI F8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
PDS_VI void store(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
PDS_VI F8 load(const uint16_t* p) {  // 8 bf16, widened
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16))};
}
// bf16 of the 8 lanes, round to nearest even, NaN kept quiet (what f32_to_bf16 does)
PDS_VI __m128i to_bf16_bits(F8 a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}
PDS_VI void store(uint16_t* p, F8 a) { _mm_storeu_si128((__m128i*)p, to_bf16_bits(a)); }
// a rounded to bf16 and back: to_bf16_bits' rounding in the 32-bit lanes, the low half cleared
PDS_VI F8 round_bf16(F8 a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  return {_mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))))};
}
#else
PDS_VI F8 zero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
PDS_VI F8 set1(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
PDS_VI F8 load(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
PDS_VI void store(float* p, F8 a) {
  vst1q_f32(p, a.lo);
  vst1q_f32(p + 4, a.hi);
}
PDS_VI F8 load(const uint16_t* p) {
  const uint16x8_t h = vld1q_u16(p);
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)), vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h), 16))};
}
PDS_VI uint32x4_t to_bf16_bits4(float32x4_t a) {
  const uint32x4_t u = vreinterpretq_u32_f32(a);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb);
  const uint32x4_t is_num = vceqq_f32(a, a);
  return vshrq_n_u32(vbslq_u32(is_num, r, vorrq_u32(u, vdupq_n_u32(0x400000))), 16);
}
PDS_VI void store(uint16_t* p, F8 a) {
  vst1q_u16(p, vcombine_u16(vmovn_u32(to_bf16_bits4(a.lo)), vmovn_u32(to_bf16_bits4(a.hi))));
}
PDS_VI F8 round_bf16(F8 a) {
  return {vreinterpretq_f32_u32(vshlq_n_u32(to_bf16_bits4(a.lo), 16)),
          vreinterpretq_f32_u32(vshlq_n_u32(to_bf16_bits4(a.hi), 16))};
}
#endif

// quantized KV elements (kv_quant.h), widened to float32 (the scales are the caller's)
#if PDS_X86
PDS_VI F8 load(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
PDS_VI F8 load(const Fp8E4M3* p) {  // as float16 at 2^-8 of the value, then * 256
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i f16 = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7));
  return {_mm256_mul_ps(_mm256_cvtph_ps(f16), _mm256_set1_ps(256.f))};
}
PDS_VI F8 load(const Fp8E5M2* p) {  // the top byte of a float16
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_slli_epi16(h, 8))};
}
#else
PDS_VI F8 load(const int8_t* p) {
  const int16x8_t w = vmovl_s8(vld1_s8(p));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))};
}
template <typename T>
PDS_VI F8 load_fp8(const T* p) {  // the scalar conversion (a fallback platform)
  alignas(32) float f[8];
  for (int j = 0; j < 8; ++j) f[j] = load_f32(p + j);
  return load(static_cast<const float*>(f));
}
PDS_VI F8 load(const Fp8E4M3* p) { return load_fp8(p); }
PDS_VI F8 load(const Fp8E5M2* p) { return load_fp8(p); }
#endif

template <typename T>
PDS_VI F8 round_to(F8 a);
template <>
PDS_VI F8 round_to<float>(F8 a) { return a; }
template <>
PDS_VI F8 round_to<uint16_t>(F8 a) { return round_bf16(a); }

// the first n (< 8) elements; the rest of the lanes are zero
template <typename T>
PDS_VI F8 load_n(const T* p, int64_t n) {
  alignas(32) T buf[8] = {};
  std::memcpy(buf, p, size_t(n) * sizeof(T));
  return load(buf);
}
template <typename T>
PDS_VI void store_n(T* p, F8 a, int64_t n) {
  alignas(32) T buf[8];
  store(buf, a);
  std::memcpy(p, buf, size_t(n) * sizeof(T));
}
// n >= 8: a whole vector, else the first n
template <typename T>
PDS_VI F8 load_upto(const T* p, int64_t n) { return n >= 8 ? load(p) : load_n(p, n); }
template <typename T>
PDS_VI void store_upto(T* p, F8 a, int64_t n) {
  if (n >= 8)
    store(p, a);
  else
    store_n(p, a, n);
}

// ---- arithmetic ---------------------------------------------------------------------------------
#if PDS_X86
PDS_VI F8 add(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
PDS_VI F8 sub(F8 a, F8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
PDS_VI F8 mul(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
PDS_VI F8 div(F8 a, F8 b) { return {_mm256_div_ps(a.v, b.v)}; }
PDS_VI F8 fma(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a b + c, one rounding
PDS_VI F8 fnma(F8 a, F8 b, F8 c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
PDS_VI F8 max(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }
PDS_VI F8 min(F8 a, F8 b) { return {_mm256_min_ps(a.v, b.v)}; }
PDS_VI F8 abs(F8 a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
PDS_VI F8 round_even(F8 a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
PDS_VI I8 to_int(F8 a) { return {_mm256_cvtps_epi32(a.v)}; }  // a already integral
PDS_VI F8 to_float(I8 a) { return {_mm256_cvtepi32_ps(a.v)}; }
PDS_VI float lane0(F8 a) { return _mm256_cvtss_f32(a.v); }
// lanes in pairs, then quads, then halves: ((0+1)+(2+3))+((4+5)+(6+7))... as a fixed tree
PDS_VI float reduce_add(F8 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));  // i + (i+4)
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (0,4)+(2,6), (1,5)+(3,7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
PDS_VI float reduce_max(F8 a) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
// r[j] = reduce_add(v[j]) for 8 vectors at once, each in reduce_add's order
PDS_VI F8 reduce_add8(const F8* v) {
  // i + (i+4) of each: lanes of the 128-bit halves added first, as reduce_add does
  __m128 h[8];
  for (int j = 0; j < 8; ++j) h[j] = _mm_add_ps(_mm256_castps256_ps128(v[j].v), _mm256_extractf128_ps(v[j].v, 1));
  // then (s0 + s2), (s1 + s3), then the two: s = [s0 s1 s2 s3] -> (s0+s2) + (s1+s3)
  __m128 r[2];
  for (int g = 0; g < 2; ++g) {
    const __m128 a = h[4 * g], b = h[4 * g + 1], c = h[4 * g + 2], d = h[4 * g + 3];
    // t_x = [x0+x2, x1+x3] for a, b, c, d
    const __m128 ab = _mm_add_ps(_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const __m128 cd = _mm_add_ps(_mm_unpacklo_ps(c, d), _mm_unpackhi_ps(c, d));
    // (a0+a2)+(a1+a3), (b0+b2)+(b1+b3), ...
    r[g] = _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab));
  }
  return {_mm256_set_m128(r[1], r[0])};
}
#else
PDS_VI F8 add(F8 a, F8 b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
PDS_VI F8 sub(F8 a, F8 b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
PDS_VI F8 mul(F8 a, F8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
PDS_VI F8 div(F8 a, F8 b) { return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
PDS_VI F8 fma(F8 a, F8 b, F8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
PDS_VI F8 fnma(F8 a, F8 b, F8 c) { return {vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)}; }
PDS_VI F8 max(F8 a, F8 b) { return {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)}; }
PDS_VI F8 min(F8 a, F8 b) { return {vminq_f32(a.lo, b.lo), vminq_f32(a.hi, b.hi)}; }
PDS_VI F8 abs(F8 a) { return {vabsq_f32(a.lo), vabsq_f32(a.hi)}; }
PDS_VI F8 round_even(F8 a) { return {vrndnq_f32(a.lo), vrndnq_f32(a.hi)}; }
PDS_VI I8 to_int(F8 a) { return {vcvtnq_s32_f32(a.lo), vcvtnq_s32_f32(a.hi)}; }
PDS_VI F8 to_float(I8 a) { return {vcvtq_f32_s32(a.lo), vcvtq_f32_s32(a.hi)}; }
PDS_VI float lane0(F8 a) { return vgetq_lane_f32(a.lo, 0); }
// the same tree as the AVX2 version: i + (i+4), then (0+2), (1+3), then the two
PDS_VI float reduce_add(F8 a) {
  const float32x4_t s = vaddq_f32(a.lo, a.hi);
  const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
  return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}
PDS_VI float reduce_max(F8 a) { return vmaxvq_f32(vmaxq_f32(a.lo, a.hi)); }
PDS_VI F8 reduce_add8(const F8* v) {
  float r[8];
  for (int j = 0; j < 8; ++j) r[j] = reduce_add(v[j]);
  return load(r);
}
#endif

// ---- lane masks ---------------------------------------------------------------------------------
#if PDS_X86
// lanes i < n (0 <= n <= 8) whose value first + i is in [lo, hi]
PDS_VI M8 range_mask(int32_t first, int32_t lo, int32_t hi, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(first), lane);
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), pos);
  const __m256i above = _mm256_cmpgt_epi32(pos, _mm256_set1_epi32(hi));
  const __m256i past = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(int32_t(n) - 1));
  return {_mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(_mm256_or_si256(below, above), past),
                                                  _mm256_set1_epi32(-1)))};
}
PDS_VI F8 select(M8 m, F8 yes, F8 no) { return {_mm256_blendv_ps(no.v, yes.v, m.v)}; }
PDS_VI bool any(M8 m) { return _mm256_movemask_ps(m.v) != 0; }
#else
PDS_VI M8 range_mask(int32_t first, int32_t lo, int32_t hi, int64_t n) {
  static const int32_t kLane[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32x4_t l0 = vld1q_s32(kLane), l1 = vld1q_s32(kLane + 4);
  const int32x4_t f = vdupq_n_s32(first), vlo = vdupq_n_s32(lo), vhi = vdupq_n_s32(hi), vn = vdupq_n_s32(int32_t(n));
  const int32x4_t p0 = vaddq_s32(f, l0), p1 = vaddq_s32(f, l1);
  const uint32x4_t m0 = vandq_u32(vandq_u32(vcgeq_s32(p0, vlo), vcleq_s32(p0, vhi)), vcltq_s32(l0, vn));
  const uint32x4_t m1 = vandq_u32(vandq_u32(vcgeq_s32(p1, vlo), vcleq_s32(p1, vhi)), vcltq_s32(l1, vn));
  return {m0, m1};
}
PDS_VI F8 select(M8 m, F8 yes, F8 no) { return {vbslq_f32(m.lo, yes.lo, no.lo), vbslq_f32(m.hi, yes.hi, no.hi)}; }
PDS_VI bool any(M8 m) { return vmaxvq_u32(vorrq_u32(m.lo, m.hi)) != 0; }
#endif

// ---- exp ----------------------------------------------------------------------------------------
// exp(x) for float32 lanes, relative error ~2 ulp where exp is finite (the AVX-512 exp16's
// polynomial); inputs below -87.3 give 0, as softmax needs; above 88 the value at 88.
PDS_VI F8 exp(F8 x) {
  const F8 lo = set1(-87.3365447505f), hi = set1(88.0f);  // hi: n stays <= 127
#if PDS_X86
  const M8 under{_mm256_cmp_ps(x.v, lo.v, _CMP_LT_OQ)};
#else
  const M8 under{vcltq_f32(x.lo, lo.lo), vcltq_f32(x.hi, lo.hi)};
#endif
  x = min(max(x, lo), hi);
  // x = n ln2 + r, |r| <= ln2 / 2
  const F8 n = round_even(mul(x, set1(1.44269504088896341f)));
  F8 r = fnma(n, set1(0.693359375f), x);
  r = fnma(n, set1(-2.12194440e-4f), r);
  F8 p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, set1(1.0f)));
  // p * 2^n, n in [-126, 127]: n added to the exponent field
#if PDS_X86
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  const F8 out{_mm256_mul_ps(p.v, _mm256_castsi256_ps(e))};
#else
  const int32x4_t e0 = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.lo), vdupq_n_s32(127)), 23);
  const int32x4_t e1 = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.hi), vdupq_n_s32(127)), 23);
  const F8 out{vmulq_f32(p.lo, vreinterpretq_f32_s32(e0)), vmulq_f32(p.hi, vreinterpretq_f32_s32(e1))};
#endif
  return select(under, zero(), out);
}

// ---- bf16 pairs ---------------------------------------------------------------------------------
// 8 pairs (w[2i], w[2i+1]) of bf16 (32 bytes) -> the 8 first and the 8 second elements in float32
PDS_VI void load_pairs(const uint16_t* p, F8& first, F8& second) {
#if PDS_X86
  const __m256i w = _mm256_loadu_si256((const __m256i*)p);
  first.v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  second.v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
#else
  const uint32x4_t w0 = vld1q_u32((const uint32_t*)p), w1 = vld1q_u32((const uint32_t*)p + 4);
  const uint32x4_t hi = vdupq_n_u32(0xffff0000u);
  first = {vreinterpretq_f32_u32(vshlq_n_u32(w0, 16)), vreinterpretq_f32_u32(vshlq_n_u32(w1, 16))};
  second = {vreinterpretq_f32_u32(vandq_u32(w0, hi)), vreinterpretq_f32_u32(vandq_u32(w1, hi))};
#endif
}

// the pair (x[2 kp], x[2 kp + 1]) of a row, broadcast: from float32 (one load each) or bf16 pairs
PDS_VI void pair_of(const float* x, int64_t kp, F8& x0, F8& x1) {
  x0 = set1(x[2 * kp]);
  x1 = set1(x[2 * kp + 1]);
}
PDS_VI void pair_of(const uint32_t* x, int64_t kp, F8& x0, F8& x1) {
  const uint32_t pair = x[kp];
  x0 = set1(bf16_to_f32(uint16_t(pair)));
  x1 = set1(bf16_to_f32(uint16_t(pair >> 16)));
}

// a hint to bring the 64 bytes at p into the cache ahead of a read (L2 and up, as the AVX-512
// kernels do)
PDS_VI void prefetch(const void* p) {
#if PDS_X86
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// acc[r][2 j + h] += x_r . w over the k pairs kp0 .. kp1 of a panel in the VNNI-16x2 layout
// (gemv.cpp: 128 bf16 per pair step, 16 outputs x 2 k per line): outputs 16 (j0 + j) + 8 h .. + 8
// of the panel, rows x[r] (float32, or bf16 pairs as uint32). Per output, k then k + 1, one FMA
// each, in order. Prefetch: whole pair steps ahead, far enough that a pass doing a quarter of a
// step's work still hides memory latency (the pass that streams the panel).
template <int R, int J, bool Prefetch, typename XT>
PDS_VI void pair_panel_tile(const XT* const* x, const uint16_t* panel, int64_t kp0, int64_t kp1, int j0,
                            F8 (&acc)[R][2 * J]) {
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const uint16_t* step = panel + kp * 128 + j0 * 32;
    if (Prefetch)  // bf16 elements ahead: 32 steps (8 KiB) for one line per step, 16 for more
      for (int l = 0; l < 4; ++l) prefetch(panel + kp * 128 + (J == 1 ? 4096 : 3072) + l * 32);
    if (J == 1) {  // up to 4 rows: the line's 4 vectors stay, one broadcast of x at a time
      F8 f0, s0, f1, s1;
      load_pairs(step, f0, s0);
      load_pairs(step + 16, f1, s1);
      for (int r = 0; r < R; ++r) {
        F8 x0, x1;
        pair_of(x[r], kp, x0, x1);
        acc[r][0] = fma(x1, s0, fma(x0, f0, acc[r][0]));
        acc[r][1] = fma(x1, s1, fma(x0, f1, acc[r][1]));
      }
      continue;
    }
    F8 x0[R], x1[R];
    for (int r = 0; r < R; ++r) pair_of(x[r], kp, x0[r], x1[r]);
    for (int c = 0; c < 2 * J; ++c) {
      F8 first, second;
      load_pairs(step + c * 16, first, second);
      for (int r = 0; r < R; ++r) acc[r][c] = fma(x1[r], second, fma(x0[r], first, acc[r][c]));
    }
  }
}

// ---- int32 lanes --------------------------------------------------------------------------------
#if PDS_X86
PDS_VI I8 izero() { return {_mm256_setzero_si256()}; }
PDS_VI I8 iload(const int32_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
PDS_VI void istore(int32_t* p, I8 a) { _mm256_storeu_si256((__m256i*)p, a.v); }
PDS_VI I8 iadd(I8 a, I8 b) { return {_mm256_add_epi32(a.v, b.v)}; }
PDS_VI I8 isub(I8 a, I8 b) { return {_mm256_sub_epi32(a.v, b.v)}; }
PDS_VI I8 ishl7(I8 a) { return {_mm256_slli_epi32(a.v, 7)}; }
#else
PDS_VI I8 izero() { return {vdupq_n_s32(0), vdupq_n_s32(0)}; }
PDS_VI I8 iload(const int32_t* p) { return {vld1q_s32(p), vld1q_s32(p + 4)}; }
PDS_VI void istore(int32_t* p, I8 a) {
  vst1q_s32(p, a.lo);
  vst1q_s32(p + 4, a.hi);
}
PDS_VI I8 iadd(I8 a, I8 b) { return {vaddq_s32(a.lo, b.lo), vaddq_s32(a.hi, b.hi)}; }
PDS_VI I8 isub(I8 a, I8 b) { return {vsubq_s32(a.lo, b.lo), vsubq_s32(a.hi, b.hi)}; }
PDS_VI I8 ishl7(I8 a) { return {vshlq_n_s32(a.lo, 7), vshlq_n_s32(a.hi, 7)}; }
#endif

// 8 floats already integral and in [-127, 127], plus 128, as bytes (the int8 kernels' x + 128)
PDS_VI void store_u8_plus128(uint8_t* p, F8 a) {
  alignas(32) int32_t v[8];
  istore(v, to_int(a));
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v[i] + 128);
}

}  // namespace v8
}  // namespace pds
#endif  // PDS_HAS_V8
