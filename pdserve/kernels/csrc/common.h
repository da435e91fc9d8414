// Shared helpers of pdserve's CPU kernels that use torch: tensor access, and the AVX-512 vector
// helpers (a 16-lane exp, bf16 loads and stores). It includes ATen's tensor class, its thread pool
// and the few factory functions the kernels call, not <torch/extension.h> (the whole C++ front end
// and pybind11: 26 s of parsing per file against about 2 s); the files that talk to Python include
// torch's pybind11 glue themselves. What dispatches where is in isa.h; bf16 scalars in bf16.h;
// the 8-lane AVX2 / NEON helpers in vec8.h.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "isa.h"

#if PDS_X86
#include <immintrin.h>
#endif

namespace pds {

// Raw element pointer of a float32 or bfloat16 tensor (bf16 as uint16_t).
template <typename T>
inline T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

#if PDS_X86
// 16 bf16 (256 bits) -> 16 fp32
PDS_AVX512 inline __m512 bf16x16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <typename T>
PDS_AVX512 inline __m512 load16(const T* p, __mmask16 m);
template <>
PDS_AVX512 inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <>
PDS_AVX512 inline __m512 load16<uint16_t>(const uint16_t* p, __mmask16 m) {
  return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

// fp32 -> bf16 with round to nearest even (NaN quietened), without needing avx512_bf16.
PDS_AVX512 inline __m256i f32x16_to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

template <typename T>
PDS_AVX512 inline void store16(T* p, __m512 v, __mmask16 m);
template <>
PDS_AVX512 inline void store16<float>(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
template <>
PDS_AVX512 inline void store16<uint16_t>(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, f32x16_to_bf16(v));
}

// exp(x) for fp32 lanes, relative error ~2 ulp over the range where exp is finite; inputs below
// -87.3 give 0 (as softmax needs), above 88.7 give +inf.
PDS_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3365447505f);
  const __m512 hi = _mm512_set1_ps(88.7228391117f);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  // x = n ln2 + r, |r| <= ln2 / 2
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  // Cephes polynomial for exp(r)
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(~under, out);
}

PDS_AVX512 inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
}
#endif

}  // namespace pds
