// FP8 e4m3 block-scaled weights (W8A16) as the checkpoints publish them, read in place by
// linear_fp8 (fp8_linear.cpp, fp8_vec8.cpp). No torch headers: the vector kernels include it.
//
// Layout. The weight [N, K] (e4m3 bytes) is packed once in panels of 64 outputs, one 64-byte line
// per k: packed[np][k][p] = w[64 np + out_of(p)][k], shape [ceil(N/64), K, 64], zero padded. Inside
// a line, each 16-byte quarter L holds outputs 8L .. 8L+7 (its first 8 bytes) and 32+8L .. 32+8L+7
// (its last 8): interleaving a quarter's bytes with zero bytes (x86 unpack, Arm zip) gives the
// float16 words of 8 consecutive outputs from each half, so every tier widens a line with two
// shuffles, no permutation. The scales are [ceil(N/64), ceil(K/bk), 64] float32 in output order,
// times 256 (see below); padded outputs have scale 0.
//
// Widening. An e4m3 byte b shifted into a float16 (sign to bit 15, the other 7 bits to 13..7) is
// 2^-8 of its value, subnormals included, and F16C / FCVTL convert float16 to float32 exactly:
// (b << 8) as int16, shifted right arithmetically by one, bit 14 cleared. The 2^8 goes into the
// block scale (exact).
//
// Arithmetic, the same on every tier (so tiers, tile sizes and the rows of a call give the same
// bits: batch invariant): per output, per k block, part = sum over the block's k in order of
// x[k] * w(k), one fused multiply-add each, from zero; then acc = fma(part, scale, acc) over the
// blocks in order, from zero; out = acc + bias, rounded once to the output dtype.
#pragma once

#include <cstdint>

#include "isa.h"

#if PDS_X86
#include <immintrin.h>
#endif

namespace pds {

constexpr int64_t kFp8Panel = 64;
// how far ahead a one-row call prefetches its weight stream (into L2)
constexpr int64_t kFp8PrefetchBytes = 2048;

// the output (0 .. 63) of byte p of a packed line
inline int fp8_out_of(int p) { return (p & 8) ? 32 + 8 * (p >> 4) + (p & 7) : 8 * (p >> 4) + (p & 7); }

struct Fp8Args {
  const uint8_t* w;  // [NP, K, 64], the layout above
  const float* scale;  // [NP, KB, 64], times 256
  const float* x;  // [M, K], row stride x_stride
  const void* bias;  // [N] in out's dtype, or null
  void* out;  // [M, N], row stride out_stride
  int64_t M, N, K, KB, bk, x_stride, out_stride;
  bool out_bf16;
};

// rows in a block whose sums stay in a buffer while the panel's k blocks pass
constexpr int64_t kFp8RowBlock = 32;

// fp8_dequantize: panels np0 .. np1 as out[k][64 (np - np0) + o] = value * scale, float32 or bf16
struct Fp8DequantArgs {
  const uint8_t* w;  // [NP, K, 64]
  const float* scale;  // [NP, KB, 64], times 256
  void* out;  // [K, cols], row stride out_stride
  int64_t K, KB, bk, cols, out_stride;
  bool out_bf16;
};
void fp8_dequantize_panels_vec8(const Fp8DequantArgs& a, int64_t np0, int64_t np1);

// panels np0 .. np1 on the 8-lane kernels (AVX2 + F16C, NEON); wbuf: bk x 64 floats, 64-byte aligned
void linear_fp8_panels_vec8(const Fp8Args& a, int64_t np0, int64_t np1, float* wbuf);

#if PDS_X86
// a packed line -> its 64 weights at 2^-8 of their values, in output order
PDS_AVX512 inline void widen_line(const uint8_t* p, __m512 (&w)[4]) {
  const __m512i b = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
  const __m512i keep = _mm512_set1_epi16(int16_t(0xBFFF));
  const __m512i lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(z, b), 1), keep);
  const __m512i hi = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(z, b), 1), keep);
  w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(lo));
  w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1));
  w[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(hi));
  w[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1));
}

// (AMX, amx_fp8.cpp) out = x w^T (+ bias) with x in bf16 on tiles: each k block's weights widened
// once into bf16 B tiles (exact: an e4m3 value at 2^-8 is a bf16), its partial sums scaled in fp32
struct Fp8AmxArgs {
  Fp8Args f;  // x unused: xa holds it
  const uint16_t* xa;  // [round_up(M, 16), xa_stride] bf16, zero padded
  int64_t xa_stride;  // elements, >= round_up(K, 32) + 32
};
void amx_linear_fp8(const Fp8AmxArgs& a, int tile_backend);
#endif

}  // namespace pds
