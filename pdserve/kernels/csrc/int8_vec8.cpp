// w8a8_int8 matmuls on 8 lanes: linear_w8a8, the fused MoE kernel's int8 tile, and the per-row
// quantization of x, for AVX2 (vpmaddubsw / vpmaddwd, or AVX-VNNI's vpdpbusd) and NEON (widening
// multiplies, or SDOT, or I8MM's USDOT).
//
// x is stored as xq + 128 (unsigned, what vpdpbusd and USDOT take: their sums need the 128 colsum
// correction of int8_gemm.cpp). The other flavours take x back to signed first (xq = byte ^ 0x80),
// so their sums need no correction; vpmaddubsw multiplies |w| by x carrying w's sign, so its pairs
// stay within int16 (|x|, |w| <= 127). Integer sums are exact: every flavour gives the bits of the
// scalar kernel.
#include "vec8.h"
#include "vec8_kernels.h"

#include <vector>

#if PDS_HAS_V8
namespace pds {
namespace {

using Int8TileFn = void (*)(const uint32_t* const* x, int64_t KQ, const int8_t* panel, int j0, int32_t* sums);
struct Int8TileFns {  // tile<rows, lines> of one flavour (int8_tile_body.h)
  Int8TileFn r1j4, r2j2, r1j1, r2j1, r3j1, r4j1;
  bool unsigned_form;
};

#if PDS_X86
namespace avx2_dot {
#define PDS_DOT_TARGET PDS_AVX2 inline
using XB = __m256i;
struct WB {
  __m256i w, abs;
};
PDS_DOT_TARGET XB prep_x(uint32_t x4) { return _mm256_set1_epi32(int32_t(x4 ^ 0x80808080u)); }
PDS_DOT_TARGET WB prep_w(const int8_t* w) {
  const __m256i v = _mm256_load_si256((const __m256i*)w);
  return {v, _mm256_abs_epi8(v)};
}
PDS_DOT_TARGET v8::I8 dot(v8::I8 acc, XB x, WB w) {
  const __m256i pairs = _mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x, w.w));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
}
constexpr bool kUnsigned = false;
#undef PDS_DOT_TARGET
#define PDS_DOT_TARGET PDS_AVX2
#include "int8_tile_body.h"
#undef PDS_DOT_TARGET
}  // namespace avx2_dot

namespace vnni_dot {
#define PDS_DOT_TARGET PDS_AVX2_VNNI inline
using XB = __m256i;
using WB = __m256i;
PDS_DOT_TARGET XB prep_x(uint32_t x4) { return _mm256_set1_epi32(int32_t(x4)); }
PDS_DOT_TARGET WB prep_w(const int8_t* w) { return _mm256_load_si256((const __m256i*)w); }
PDS_DOT_TARGET v8::I8 dot(v8::I8 acc, XB x, WB w) { return {_mm256_dpbusd_avx_epi32(acc.v, x, w)}; }
constexpr bool kUnsigned = true;
#undef PDS_DOT_TARGET
#define PDS_DOT_TARGET PDS_AVX2_VNNI
#include "int8_tile_body.h"
#undef PDS_DOT_TARGET
}  // namespace vnni_dot

Int8TileFns pick() { return use_avx_vnni() ? vnni_dot::tiles() : avx2_dot::tiles(); }
#else
namespace neon_dot {  // Advanced SIMD only: widening multiplies and pairwise adds
#define PDS_DOT_TARGET inline
using XB = int8x16_t;
using WB = int8x16x2_t;
PDS_DOT_TARGET XB prep_x(uint32_t x4) { return vreinterpretq_s8_u32(vdupq_n_u32(x4 ^ 0x80808080u)); }
PDS_DOT_TARGET WB prep_w(const int8_t* w) { return {vld1q_s8(w), vld1q_s8(w + 16)}; }
PDS_DOT_TARGET int32x4_t dot4(int32x4_t acc, int8x16_t x, int8x16_t w) {
  // products of outputs 0-1 and 2-3 (4 k each), pairwise to 2 per output, then to 1
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x)));
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(w, x));
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
}
PDS_DOT_TARGET v8::I8 dot(v8::I8 acc, XB x, WB w) { return {dot4(acc.lo, x, w.val[0]), dot4(acc.hi, x, w.val[1])}; }
constexpr bool kUnsigned = false;
#undef PDS_DOT_TARGET
#define PDS_DOT_TARGET
#include "int8_tile_body.h"
#undef PDS_DOT_TARGET
}  // namespace neon_dot

namespace sdot_dot {  // SDOT (dotprod)
#define PDS_DOT_TARGET PDS_NEON_DOT inline
using XB = int8x16_t;
using WB = int8x16x2_t;
PDS_DOT_TARGET XB prep_x(uint32_t x4) { return vreinterpretq_s8_u32(vdupq_n_u32(x4 ^ 0x80808080u)); }
PDS_DOT_TARGET WB prep_w(const int8_t* w) { return {vld1q_s8(w), vld1q_s8(w + 16)}; }
PDS_DOT_TARGET v8::I8 dot(v8::I8 acc, XB x, WB w) {
  return {vdotq_s32(acc.lo, w.val[0], x), vdotq_s32(acc.hi, w.val[1], x)};
}
constexpr bool kUnsigned = false;
#undef PDS_DOT_TARGET
#define PDS_DOT_TARGET PDS_NEON_DOT
#include "int8_tile_body.h"
#undef PDS_DOT_TARGET
}  // namespace sdot_dot

namespace usdot_dot {  // USDOT (i8mm): unsigned x times signed w, as vpdpbusd
#define PDS_DOT_TARGET PDS_NEON_I8MM inline
using XB = uint8x16_t;
using WB = int8x16x2_t;
PDS_DOT_TARGET XB prep_x(uint32_t x4) { return vreinterpretq_u8_u32(vdupq_n_u32(x4)); }
PDS_DOT_TARGET WB prep_w(const int8_t* w) { return {vld1q_s8(w), vld1q_s8(w + 16)}; }
PDS_DOT_TARGET v8::I8 dot(v8::I8 acc, XB x, WB w) {
  return {vusdotq_s32(acc.lo, x, w.val[0]), vusdotq_s32(acc.hi, x, w.val[1])};
}
constexpr bool kUnsigned = true;
#undef PDS_DOT_TARGET
#define PDS_DOT_TARGET PDS_NEON_I8MM
#include "int8_tile_body.h"
#undef PDS_DOT_TARGET
}  // namespace usdot_dot

Int8TileFns pick() {
  return use_i8mm() ? usdot_dot::tiles() : use_dotprod() ? sdot_dot::tiles() : neon_dot::tiles();
}
#endif

// `rows` rows of x (pointers to their 4-byte groups) against `lines` (1 or 4) lines of 16 outputs
// from line j0 of a panel: the int32 sums, sums[r][16 j0 ...] (row stride 64)
void int8_sums(const Int8TileFns& f, const uint32_t* const* x, int rows, int64_t KQ, const int8_t* panel, int j0,
               int lines, int32_t* sums) {
  const Int8TileFn one_line[5] = {nullptr, f.r1j1, f.r2j1, f.r3j1, f.r4j1};
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int n = std::min(4, rows - r0);
    if (lines == 4 && n == 1) {
      f.r1j4(x + r0, KQ, panel, 0, sums + r0 * 64);
    } else if (lines == 4 && n == 2) {
      f.r2j2(x + r0, KQ, panel, 0, sums + r0 * 64);
      f.r2j2(x + r0, KQ, panel, 2, sums + r0 * 64);
    } else {
      for (int j = j0; j < j0 + lines; ++j) one_line[n](x + r0, KQ, panel, j, sums + r0 * 64);
    }
  }
}

template <typename T>
PDS_V8 void finish_rows(const Int8Args& a, const Int8TileFns& f, const int32_t* sums, int64_t m0, int rows,
                        int64_t np, int j0, int lines) {
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const v8::F8 xs = v8::set1(a.x_scale[m]);
    for (int64_t c = 2 * j0; c < 2 * (j0 + lines); ++c) {
      const int64_t n0 = np * 64 + c * 8;
      if (n0 >= a.N) break;
      v8::I8 s = v8::iload(sums + r * 64 + c * 8);
      if (f.unsigned_form) s = v8::isub(s, v8::ishl7(v8::iload(a.colsum + n0)));
      v8::F8 v = v8::mul(v8::mul(v8::to_float(s), xs), v8::load(a.w_scale + n0));
      if (a.bias) v = v8::add(v, v8::load_upto(static_cast<const T*>(a.bias) + n0, a.N - n0));
      v8::store_upto(static_cast<T*>(a.out) + m * a.out_stride + n0, v, a.N - n0);
    }
  }
}

void finish(const Int8Args& a, const Int8TileFns& f, const int32_t* sums, int64_t m0, int rows, int64_t np, int j0,
            int lines) {
  if (a.out_bf16)
    finish_rows<uint16_t>(a, f, sums, m0, rows, np, j0, lines);
  else
    finish_rows<float>(a, f, sums, m0, rows, np, j0, lines);
}

constexpr int64_t kRowBlock = 256;  // rows per pass: their quantized x stays in L2

template <typename T>
PDS_V8 void quantize(const T* x, int64_t stride, int64_t M, int64_t K, int64_t K4, uint8_t* xq, float* scale) {
  using namespace v8;
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * stride;
    F8 amax = zero();
    for (int64_t k = 0; k < K; k += 8) amax = max(amax, abs(load_upto(row + k, K - k)));
    const float mx = reduce_max(amax);
    const float s = mx > 0.f ? mx / 127.f : 1.f;
    scale[m] = s;
    const F8 inv = set1(1.f / s), lo = set1(-127.f), hi = set1(127.f);
    uint8_t* q = xq + m * K4;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) store_u8_plus128(q + k, min(max(round_even(mul(load(row + k), inv)), lo), hi));
    if (k < K) {
      alignas(32) uint8_t tail[8];
      store_u8_plus128(tail, min(max(round_even(mul(load_n(row + k, K - k), inv)), lo), hi));
      std::memcpy(q + k, tail, size_t(K - k));
      k = K;
    }
    std::memset(q + K, 128, size_t(K4 - K));
  }
}

}  // namespace

void linear_w8a8_panels_vec8(const Int8Args& a, int64_t np0, int64_t np1) {
  const Int8TileFns f = pick();
  alignas(32) int32_t sums[4 * 64];
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(a.xq);
  if (a.M <= 2) {  // one pass, the weight streamed from memory
    const uint32_t* rows[2] = {x32, x32 + a.KQ};
    for (int64_t np = np0; np < np1; ++np) {
      const int8_t* panel = a.w + np * a.KQ * 256;
      int8_sums(f, rows, int(a.M), a.KQ, panel, 0, 4, sums);
      finish(a, f, sums, 0, int(a.M), np, 0, 4);
    }
    return;
  }
  // 4-row tiles over one line of a panel at a time (the line's KQ x 64 bytes stay in L1)
  for (int64_t mb = 0; mb < a.M; mb += kRowBlock) {
    const int64_t m1 = std::min(a.M, mb + kRowBlock);
    for (int64_t np = np0; np < np1; ++np) {
      const int8_t* panel = a.w + np * a.KQ * 256;
      for (int j = 0; j < 4 && np * 64 + 16 * j < a.N; ++j)
        for (int64_t m0 = mb; m0 < m1; m0 += 4) {
          const int rows = int(std::min<int64_t>(4, m1 - m0));
          const uint32_t* xr[4];
          for (int r = 0; r < rows; ++r) xr[r] = x32 + (m0 + r) * a.KQ;
          int8_sums(f, xr, rows, a.KQ, panel, j, 1, sums);
          finish(a, f, sums, m0, rows, np, j, 1);
        }
    }
  }
}

// The fused MoE kernel's tile: res [rows][64] = (sums corrected) * (x_scale * w_scale)
void moe_tile_int8_vec8(const MoeTile& t) {
  const Int8TileFns f = pick();
  alignas(32) int32_t sums[kMoeTileRows * 64];
  for (int r0 = 0; r0 < t.rows; r0 += 4) {
    const int rows = std::min(4, t.rows - r0);
    int8_sums(f, t.xr + r0, rows, t.KS, reinterpret_cast<const int8_t*>(t.panel), 0, 4, sums + r0 * 64);
  }
  for (int r = 0; r < t.rows; ++r)
    for (int o = 0; o < 64; ++o) {
      const int32_t s = sums[r * 64 + o] - (f.unsigned_form ? 128 * t.colsum[o] : 0);
      t.res[r * 64 + o] = float(s) * (t.xs[r] * t.w_scale[o]);
    }
}

template <typename T>
void quantize_rows_vec8(const T* x, int64_t stride, int64_t M, int64_t K, int64_t K4, uint8_t* xq, float* scale) {
  quantize(x, stride, M, K, K4, xq, scale);
}
template void quantize_rows_vec8<float>(const float*, int64_t, int64_t, int64_t, int64_t, uint8_t*, float*);
template void quantize_rows_vec8<uint16_t>(const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint8_t*, float*);

void moe_quantize_row_vec8(const uint16_t* x, int64_t K, int64_t K4, uint8_t* q, float* scale) {
  quantize(x, K, 1, K, K4, q, scale);
}

}  // namespace pds
#endif
