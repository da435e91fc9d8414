// linear_fp8 on 8 lanes (AVX2 + F16C, NEON): FP8 e4m3 block-scaled weights widened in registers
// as they stream in (the layout and the arithmetic are in fp8_linear.h).
//
// A panel is taken one k block (bk lines, 8 KiB at 128) at a time, its partial sums scaled into the
// row block's sums in `acc` at the end of the block. Up to 3 rows: the lines are widened in
// registers as they stream in. More rows: the block is widened once into `wbuf` (float32, 32 KiB
// at 128, in L1) and tiles of up to 6 rows x 16 outputs run on it. 4-bit panels (MXFP4, int4): each quarter
// line's codes are looked up as their values first (fp8_linear.h), then the same.
#include "fp8_linear.h"
#include "vec8.h"

#include <algorithm>

#if PDS_HAS_V8
namespace pds {
namespace {
using namespace v8;

constexpr int kTileRows = 6;  // 12 partial sums, 2 weight vectors and a broadcast: 15 of 16 registers

#if PDS_X86
// 8 codes (in the low 4 bits of 32-bit lanes; higher bits ignored) -> their values at 2^-8: vpermps
// over each half of the table, the code's bit 3 (shifted to bit 31) choosing the half
template <int C>
PDS_VI __m256 code_values8(__m256i code) {
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(code_values<C>()), code);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(code_values<C>() + 8), code);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}
#endif

// quarter q of a packed line -> its first 8 and its last 8 weights, at 2^-8 of their values: FP8's
// 16 bytes widened through float16 (fp8_linear.h); 4-bit lines: 8 bytes (outputs 8q .. 8q + 7 low,
// 32 + 8q .. high) looked up as values (AVX2: vpermps over each half of the table;
// NEON: as float16 high bytes)
template <int C>
PDS_VI void widen_quarter(const uint8_t* line, int q, F8& first, F8& last) {
#if PDS_X86
  const __m128i z = _mm_setzero_si128();
  __m128i lo, hi;
  if constexpr (C != kCodesFp8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(line + 8 * q)));
    first.v = code_values8<C>(idx);
    last.v = code_values8<C>(_mm256_srli_epi32(idx, 4));
    return;
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * q));
    const __m128i keep = _mm_set1_epi16(int16_t(0xBFFF));
    lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(z, b), 1), keep);
    hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(z, b), 1), keep);
  }
  first.v = _mm256_cvtph_ps(lo);
  last.v = _mm256_cvtph_ps(hi);
#else
  const uint8x16_t z = vdupq_n_u8(0);
  int16x8_t lo, hi;
  if constexpr (C != kCodesFp8) {
    const uint8x8_t b = vld1_u8(line + 8 * q);
    const uint8x16_t codes = vcombine_u8(vand_u8(b, vdup_n_u8(0x0F)), vshr_n_u8(b, 4));
    const uint8x16_t high = vqtbl1q_u8(vld1q_u8(code_fp16_high<C>()), codes);
    lo = vreinterpretq_s16_u8(vzip1q_u8(z, high));
    hi = vreinterpretq_s16_u8(vzip2q_u8(z, high));
  } else {
    const uint8x16_t b = vld1q_u8(line + 16 * q);
    const int16x8_t keep = vdupq_n_s16(int16_t(0xBFFF));
    lo = vandq_s16(vshrq_n_s16(vreinterpretq_s16_u8(vzip1q_u8(z, b)), 1), keep);
    hi = vandq_s16(vshrq_n_s16(vreinterpretq_s16_u8(vzip2q_u8(z, b)), 1), keep);
  }
  const float16x8_t l = vreinterpretq_f16_s16(lo), h = vreinterpretq_f16_s16(hi);
  first = {vcvt_f32_f16(vget_low_f16(l)), vcvt_high_f32_f16(l)};
  last = {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
#endif
}

// Up to kStreamRows rows: k block kb of panel np widened in registers as it streams in, Q quarters
// of a line (2 Q chains of fused multiply-adds a row) per pass over the block, the later passes
// from L1; each widened quarter serves every row (one or two rows: half a line a pass; three: a
// quarter, to stay in 16 registers). More rows take the register tiles over a widened block.
// Measured at the AVX2 tier on Zen 4 (int4, 1536 x 2048): 2 rows 1.25x one row's time (1.5x with
// the tiles), 3 rows 1.7x (2.7x); 4 rows streamed were slower than the tiles, and so were 8 and
// 64 in groups.
constexpr int kStreamRows = int(kVec8StreamRows);

template <int C, int R, int Q>
PDS_V8 void row_block(const Fp8Args& a, int64_t np, int64_t kb, int64_t m0, float* acc) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  const int64_t k0 = kb * a.bk, k1 = std::min(a.K, k0 + a.bk);
  const uint8_t* block = a.w + (np * a.K + k0) * lb;
  const float* x = a.x + m0 * a.x_stride;
  alignas(32) float sbuf[kFp8Panel];
  const float* s = block_scales(a, np, kb, sbuf);
  for (int h = 0; h < 4 / Q; ++h) {
    F8 part[R][Q][2];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < Q; ++q) part[r][q][0] = part[r][q][1] = zero();
    for (int64_t k = k0; k < k1; ++k) {
      const uint8_t* line = block + (k - k0) * lb;
      if (h == 0) prefetch(line + kFp8PrefetchBytes);  // the first pass streams the block
      F8 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = set1(x[r * a.x_stride + k]);
      for (int q = 0; q < Q; ++q) {
        F8 first, last;
        widen_quarter<C>(line, Q * h + q, first, last);
        for (int r = 0; r < R; ++r) {
          part[r][q][0] = fma(xv[r], first, part[r][q][0]);
          part[r][q][1] = fma(xv[r], last, part[r][q][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float* row = acc + r * kFp8Panel;
      for (int q = 0; q < Q; ++q) {
        const int o = 8 * (Q * h + q);
        store(row + o, fma(part[r][q][0], load(s + o), load(row + o)));
        store(row + 32 + o, fma(part[r][q][1], load(s + 32 + o), load(row + 32 + o)));
      }
    }
  }
}

template <int C>
PDS_V8 void stream_rows(const Fp8Args& a, int64_t np, int64_t kb, int64_t m0, int64_t rows, float* acc) {
  static_assert(kStreamRows == 3, "stream_rows instantiates 1..3 rows");
  switch (rows) {
    case 1: return row_block<C, 1, 2>(a, np, kb, m0, acc);
    case 2: return row_block<C, 2, 2>(a, np, kb, m0, acc);
    default: return row_block<C, 3, 1>(a, np, kb, m0, acc);
  }
}

// k block kb of panel np -> wbuf [bk][64] float32 in output order (2^-8 of the values)
template <int C>
PDS_V8 void widen_block(const Fp8Args& a, int64_t np, int64_t kb, float* wbuf) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  const int64_t k0 = kb * a.bk, k1 = std::min(a.K, k0 + a.bk);
  const uint8_t* block = a.w + (np * a.K + k0) * lb;
  for (int64_t k = k0; k < k1; ++k) {
    float* dst = wbuf + (k - k0) * kFp8Panel;
    for (int q = 0; q < 4; ++q) {
      F8 first, last;
      widen_quarter<C>(block + (k - k0) * lb, q, first, last);
      store(dst + 8 * q, first);
      store(dst + 32 + 8 * q, last);
    }
  }
}

// rows m0 .. m0 + R (acc rows r0 ..) x outputs 16 j .. 16 j + 16 of k block kb, from the widened
// block
template <int R>
PDS_V8 void tile(const Fp8Args& a, int64_t kb, const float* scales, const float* wbuf, int j, int64_t m0, float* acc,
                 int64_t r0) {
  const int64_t k0 = kb * a.bk, k1 = std::min(a.K, k0 + a.bk);
  const float* x = a.x + m0 * a.x_stride;
  F8 part[R][2];
  for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = zero();
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = wbuf + (k - k0) * kFp8Panel + 16 * j;
    const F8 w0 = load(w), w1 = load(w + 8);
    for (int r = 0; r < R; ++r) {
      const F8 xv = set1(x[r * a.x_stride + k]);
      part[r][0] = fma(xv, w0, part[r][0]);
      part[r][1] = fma(xv, w1, part[r][1]);
    }
  }
  const float* s = scales + 16 * j;
  const F8 s0 = load(s), s1 = load(s + 8);
  for (int r = 0; r < R; ++r) {
    float* row = acc + (r0 + r) * kFp8Panel + 16 * j;
    store(row, fma(part[r][0], s0, load(row)));
    store(row + 8, fma(part[r][1], s1, load(row + 8)));
  }
}

using Tile = void (*)(const Fp8Args&, int64_t, const float*, const float*, int, int64_t, float*, int64_t);
constexpr Tile kTiles[kTileRows + 1] = {nullptr, &tile<1>, &tile<2>, &tile<3>, &tile<4>, &tile<5>, &tile<6>};

template <typename T>
PDS_V8 void store_rows(const Fp8Args& a, int64_t np, int64_t m0, int64_t rows, const float* acc) {
  const int64_t n0 = np * kFp8Panel, nn = std::min<int64_t>(kFp8Panel, a.N - n0);
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t r = 0; r < rows; ++r) {
    T* out = static_cast<T*>(a.out) + (m0 + r) * a.out_stride + n0;
    for (int64_t o = 0; o < nn; o += 8) {
      const F8 b = bias ? load_upto(bias + n0 + o, nn - o) : zero();
      store_upto(out + o, add(load(acc + r * kFp8Panel + o), b), nn - o);
    }
  }
}

template <int C>
PDS_V8 void panels(const Fp8Args& a, int64_t np0, int64_t np1, float* wbuf) {
  alignas(64) float acc[kFp8RowBlock * kFp8Panel], sbuf[kFp8Panel];
  for (int64_t np = np0; np < np1; ++np)
    for (int64_t m0 = 0; m0 < a.M; m0 += kFp8RowBlock) {
      const int64_t rows = std::min(kFp8RowBlock, a.M - m0);
      std::fill(acc, acc + rows * kFp8Panel, 0.f);
      for (int64_t kb = 0; kb < a.KB; ++kb) {
        if (rows <= kStreamRows) {
          stream_rows<C>(a, np, kb, m0, rows, acc);
          continue;
        }
        widen_block<C>(a, np, kb, wbuf);
        const float* scales = block_scales(a, np, kb, sbuf);
        // tiles as even as can be: 8 rows are 4 + 4, not 6 + 2
        const int64_t n_tiles = (rows + kTileRows - 1) / kTileRows;
        for (int j = 0; j < 4; ++j)
          for (int64_t t = 0, r = 0; t < n_tiles; ++t) {
            const int64_t tr = rows / n_tiles + (t < rows % n_tiles);
            kTiles[tr](a, kb, scales, wbuf, j, m0 + r, acc, r);
            r += tr;
          }
      }
      if (a.out_bf16)
        store_rows<uint16_t>(a, np, m0, rows, acc);
      else
        store_rows<float>(a, np, m0, rows, acc);
    }
}

template <int C>
PDS_V8 void dequantize(const Fp8DequantArgs& a, int64_t np0, int64_t np1) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  alignas(32) float line[kFp8Panel], sbuf[kFp8Panel];
  for (int64_t np = np0; np < np1; ++np) {
    const int64_t c0 = np * kFp8Panel, nc = std::min<int64_t>(kFp8Panel, a.cols - c0);
    const float* s = block_scales(a, np, 0, sbuf);
    for (int64_t k = 0, kb = 0, next = a.bk; k < a.K; ++k) {
      if (k == next) ++kb, next += a.bk, s = block_scales(a, np, kb, sbuf);
      const uint8_t* src = a.w + (np * a.K + k) * lb;
      for (int q = 0; q < 4; ++q) {
        F8 first, last;
        widen_quarter<C>(src, q, first, last);
        store(line + 8 * q, mul(first, load(s + 8 * q)));
        store(line + 32 + 8 * q, mul(last, load(s + 32 + 8 * q)));
      }
      if (a.out_bf16) {
        uint16_t* dst = static_cast<uint16_t*>(a.out) + k * a.out_stride + c0;
        for (int64_t o = 0; o < nc; o += 8) store_upto(dst + o, load(line + o), nc - o);
      } else {
        float* dst = static_cast<float*>(a.out) + k * a.out_stride + c0;
        for (int64_t o = 0; o < nc; o += 8) store_upto(dst + o, load(line + o), nc - o);
      }
    }
  }
}

}  // namespace

void linear_fp8_panels_vec8(const Fp8Args& a, int64_t np0, int64_t np1, float* wbuf) {
  if (a.codes == kCodesE2m1) return panels<kCodesE2m1>(a, np0, np1, wbuf);
  if (a.codes == kCodesInt4) return panels<kCodesInt4>(a, np0, np1, wbuf);
  panels<kCodesFp8>(a, np0, np1, wbuf);
}

void fp8_dequantize_panels_vec8(const Fp8DequantArgs& a, int64_t np0, int64_t np1) {
  if (a.codes == kCodesE2m1) return dequantize<kCodesE2m1>(a, np0, np1);
  if (a.codes == kCodesInt4) return dequantize<kCodesInt4>(a, np0, np1);
  dequantize<kCodesFp8>(a, np0, np1);
}

}  // namespace pds
#endif  // PDS_HAS_V8
