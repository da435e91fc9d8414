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
//
// 4-bit codes run the same kernels (the same sums in the same order) on panels of half the bytes,
// in output order: packed[np][k][j] (j < 32) holds the code of output j in its low nibble and of
// output j + 32 in its high nibble. MXFP4 (GPT-OSS's experts: e2m1 codes, one E8M0 scale
// 2^(e - 127) per 32 k) and int4 (compressed-tensors' pack-quantized: codes q + 8, a float scale
// per group of bk) differ only in their table of values (Codes). A code becomes its value at 2^-8
// by a table lookup: on AVX-512 16 codes at a time, each byte zero-extended to a 32-bit lane and
// looked up among 16 floats by vpermps (which reads only an index's low 4 bits: the high nibble
// needs a shift, no mask); on AVX2 8 at a time by vpermps over each half of the table, bit 3
// choosing the half; on NEON as the high byte of a float16 (every value here at 2^-8 is a float16
// with a zero low byte), one byte shuffle, then the float16 conversion. MXFP4's scales stay bytes,
// [NP, KB, 64] uint8 in output order with bk = 32: 2^(e - 127) times 256 is the float whose
// exponent field is e + 8 (exact for e <= 246, which the loader checks); int4's are FP8's floats.
#pragma once

#include <cstdint>
#include <cstring>

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

// The weights a panel holds: FP8 bytes, or 4-bit codes (MXFP4's e2m1; compressed-tensors' int4,
// stored as q + 8) in lines of half the bytes, looked up as values
enum Codes : int { kCodesFp8 = 0, kCodesE2m1 = 1, kCodesInt4 = 2 };
// int4 codes with int8 activations: int4_w4a8.cpp's quads (its own layout, not these panels);
// MXFP4's e2m1 codes in the same quads, with int8 activations
constexpr int kCodesW4A8 = 3;
constexpr int kCodesMxfp4A8 = 4;
// rows the 8-lane kernels widen each line for in registers (fp8_vec8.cpp); more take tiles over
// a block widened into a buffer
constexpr int64_t kVec8StreamRows = 3;
constexpr int64_t kFp4Line = 32;
constexpr int64_t kMxfp4Block = 32;
// each 4-bit code's value at 2^-8, as a float and as the high byte of a float16 (every value here
// at 2^-8 is a float16 with a zero low byte)
alignas(64) constexpr float kE2m1Scaled[16] = {0.f,           0.5f / 256,  1.f / 256,  1.5f / 256,
                                               2.f / 256,     3.f / 256,   4.f / 256,  6.f / 256,
                                               -0.f,          -0.5f / 256, -1.f / 256, -1.5f / 256,
                                               -2.f / 256,    -3.f / 256,  -4.f / 256, -6.f / 256};
alignas(16) constexpr uint8_t kE2m1Fp16High[16] = {0x00, 0x18, 0x1C, 0x1E, 0x20, 0x22, 0x24, 0x26,
                                                   0x80, 0x98, 0x9C, 0x9E, 0xA0, 0xA2, 0xA4, 0xA6};
alignas(64) constexpr float kInt4Scaled[16] = {-8.f / 256, -7.f / 256, -6.f / 256, -5.f / 256, -4.f / 256, -3.f / 256,
                                               -2.f / 256, -1.f / 256, 0.f,        1.f / 256,  2.f / 256,  3.f / 256,
                                               4.f / 256,  5.f / 256,  6.f / 256,  7.f / 256};
alignas(16) constexpr uint8_t kInt4Fp16High[16] = {0xA8, 0xA7, 0xA6, 0xA5, 0xA4, 0xA2, 0xA0, 0x9C,
                                                   0x00, 0x1C, 0x20, 0x22, 0x24, 0x25, 0x26, 0x27};
template <int C>
constexpr const float* code_values() {
  return C == kCodesInt4 ? kInt4Scaled : kE2m1Scaled;
}
template <int C>
constexpr const uint8_t* code_fp16_high() {
  return C == kCodesInt4 ? kInt4Fp16High : kE2m1Fp16High;
}
inline const float* code_values(int c) { return c == kCodesInt4 ? kInt4Scaled : kE2m1Scaled; }
// the code of output o (0 .. 63) of an MXFP4 line
inline int fp4_code(const uint8_t* line, int o) { return (line[o & 31] >> (4 * (o >> 5))) & 0xF; }
// the largest E8M0 byte whose scale times 256 is a finite float
constexpr int kMaxE8m0 = 246;

inline float e8m0_times_256(uint8_t e) {
  const uint32_t bits = uint32_t(e + 8) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Fp8Args {
  const uint8_t* w;  // [NP, K, 64], the layout above ([NP, K, 32] codes when fp4)
  const float* scale;  // [NP, KB, 64], times 256 (unused when fp4)
  const float* x;  // [M, K], row stride x_stride
  const void* bias;  // [N] in out's dtype, or null
  void* out;  // [M, N], row stride out_stride
  int64_t M, N, K, KB, bk, x_stride, out_stride;
  bool out_bf16;
  int codes = kCodesFp8;  // Codes: what the panels hold
  const uint8_t* e8m0 = nullptr;  // [NP, KB, 64] MXFP4's scales (else `scale`)
};

inline int64_t line_bytes(int codes) { return codes == kCodesFp8 ? kFp8Panel : kFp4Line; }

// the 64 scales (times 256) of k block kb of panel np: float ones in place, E8M0 bytes decoded into
// buf
inline const float* block_scales(const Fp8Args& a, int64_t np, int64_t kb, float* buf) {
  if (!a.e8m0) return a.scale + (np * a.KB + kb) * kFp8Panel;
  const uint8_t* e = a.e8m0 + (np * a.KB + kb) * kFp8Panel;
  for (int o = 0; o < kFp8Panel; ++o) buf[o] = e8m0_times_256(e[o]);
  return buf;
}

// rows in a block whose sums stay in a buffer while the panel's k blocks pass
constexpr int64_t kFp8RowBlock = 32;

// fp8_dequantize: panels np0 .. np1 as out[k][64 (np - np0) + o] = value * scale, float32 or bf16
struct Fp8DequantArgs {
  const uint8_t* w;  // [NP, K, 64] ([NP, K, 32] codes when fp4)
  const float* scale;  // [NP, KB, 64], times 256 (unused when fp4)
  void* out;  // [K, cols], row stride out_stride
  int64_t K, KB, bk, cols, out_stride;
  bool out_bf16;
  int codes = kCodesFp8;
  const uint8_t* e8m0 = nullptr;  // [NP, KB, 64] MXFP4's scales (else `scale`)
};

inline const float* block_scales(const Fp8DequantArgs& a, int64_t np, int64_t kb, float* buf) {
  const Fp8Args f{a.w, a.scale, nullptr, nullptr, nullptr, 0, 0, a.K, a.KB, a.bk, 0, 0, false, a.codes, a.e8m0};
  return block_scales(f, np, kb, buf);
}
void fp8_dequantize_panels_vec8(const Fp8DequantArgs& a, int64_t np0, int64_t np1);

// panels np0 .. np1 on the 8-lane kernels (AVX2 + F16C, NEON); wbuf: bk x 64 floats, 64-byte aligned
void linear_fp8_panels_vec8(const Fp8Args& a, int64_t np0, int64_t np1, float* wbuf);

#if PDS_X86
// a line's 64 e4m3 bytes -> its 64 weights at 2^-8 of their values, in output order
PDS_AVX512 inline void widen_bytes(const __m512i b, __m512 (&w)[4]) {
  const __m512i z = _mm512_setzero_si512();
  const __m512i keep = _mm512_set1_epi16(int16_t(0xBFFF));
  const __m512i lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(z, b), 1), keep);
  const __m512i hi = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(z, b), 1), keep);
  w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(lo));
  w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1));
  w[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(hi));
  w[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1));
}

// a 4-bit line's 32 bytes -> its 64 weights at 2^-8 of their values, in output order
template <int C>
PDS_AVX512 inline void widen_fp4_line(const uint8_t* p, __m512 (&w)[4]) {
  const __m512 table = _mm512_load_ps(code_values<C>());
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  w[0] = _mm512_permutexvar_ps(lo, table);
  w[1] = _mm512_permutexvar_ps(hi, table);
  w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), table);
  w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(hi, 4), table);
}

// a packed line (FP8 or 4-bit codes) -> its 64 weights at 2^-8 of their values, in output order
template <int C>
PDS_AVX512 inline void widen_line(const uint8_t* p, __m512 (&w)[4]) {
  if constexpr (C != kCodesFp8)
    widen_fp4_line<C>(p, w);
  else
    widen_bytes(_mm512_loadu_si512(p), w);
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
