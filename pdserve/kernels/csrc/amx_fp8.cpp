// linear_fp8 on AMX tiles (bf16 x): FP8 e4m3 block-scaled weights (fp8_linear.h) multiplied by
// TDPBF16PS without a resident bf16 copy.
//
// Per panel (64 outputs) and k block (one scale per output): the block's lines are widened once
// into B tiles in L1, 32 k (16 pairs) x 16 outputs a tile, 4 tiles a 32-k step. An e4m3 value at
// 2^-8 (what the float16 widening gives) is a bf16 exactly, so the tiles hold the weights as they
// are: each pair is the high halves of two widened float32 (no rounding). Every 16-row block of x
// (bf16 A tiles) runs the block's steps into 4 fp32 accumulator tiles, which are then scaled into
// the rows' sums (acc = fma(part, scale, acc), as the other tiers fold a block) and summed over the
// blocks in order. Within a block the order is TDPBF16PS's (pairs of k, fp32 sums): the amx tier's
// bits differ from the other tiers' in the last places, like the bf16 AMX kernel's. Rows do not
// depend on each other (16-row blocks, zero rows past M): batch invariant. 4-bit panels take the
// same path, their codes looked up as values as the tiles are built.
#include "amx.h"
#include "fp8_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

namespace pds {

#if PDS_X86
namespace {

constexpr int64_t kChunkRows = 256;  // rows whose sums stay in a buffer while a panel's blocks pass

// the B tiles of the 32-k step of lines [k0, k0 + nk) (nk <= 32; zero past it): b[j] is
// [16 pairs][16 outputs of group j][2] bf16
template <int C>
PDS_AMX void build_step(const uint8_t* lines, int64_t nk, uint16_t (*b)[16][32]) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  for (int kp = 0; kp < 16; ++kp) {
    __m512 even[4], odd[4];
    for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm512_setzero_ps();
    if (2 * kp < nk) widen_line<C>(lines + 2 * kp * lb, even);
    if (2 * kp + 1 < nk) widen_line<C>(lines + (2 * kp + 1) * lb, odd);
    for (int j = 0; j < 4; ++j) {
      const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even[j]), 16),
                                           _mm512_and_si512(_mm512_castps_si512(odd[j]), high));
      _mm512_store_si512(b[j][kp], pair);
    }
  }
}

template <class Tiles, int C, int B>
PDS_AMX inline void dp_group(Tiles& t, const uint16_t (*b)[16][32]) {
  t.template load<B>(b[C], 64);
  t.template dpbf16ps<C, 4, B>();
}

template <typename T>
PDS_AMX void store_rows(const Fp8Args& f, int64_t np, int64_t m0, int64_t rows, const float* acc) {
  const T* bias = static_cast<const T*>(f.bias);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j) {
      const int64_t n = np * kFp8Panel + 16 * j;
      if (n >= f.N) break;
      const __mmask16 mk = tail_mask(f.N - n);
      const __m512 b = bias ? load16(bias + n, mk) : _mm512_setzero_ps();
      store16(static_cast<T*>(f.out) + (m0 + r) * f.out_stride + n,
              _mm512_add_ps(_mm512_loadu_ps(acc + r * kFp8Panel + 16 * j), b), mk);
    }
}

template <class Tiles, int C>
PDS_AMX void panels(const Fp8AmxArgs& a, int64_t np0, int64_t np1) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  const Fp8Args& f = a.f;
  const int64_t Mp = (f.M + 15) / 16 * 16, steps_max = (f.bk + 31) / 32;
  std::vector<float> acc_buf(kChunkRows * kFp8Panel);
  struct Step {
    uint16_t b[4][16][32];
  };
  // the block's B tiles, 64-byte aligned (built with aligned stores)
  std::unique_ptr<Step, void (*)(void*)> steps(static_cast<Step*>(std::aligned_alloc(64, steps_max * sizeof(Step))),
                                                &std::free);
  alignas(64) float c[16][kFp8Panel], sbuf[kFp8Panel];
  float* acc = acc_buf.data();
  Tiles t(full_tiles());
  for (int64_t np = np0; np < np1; ++np)
    for (int64_t c0 = 0; c0 < Mp; c0 += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, Mp - c0);
      std::fill(acc, acc + rows * kFp8Panel, 0.f);
      for (int64_t kb = 0; kb < f.KB; ++kb) {
        const int64_t k0 = kb * f.bk, nk = std::min(f.K, k0 + f.bk) - k0, ns = (nk + 31) / 32;
        const uint8_t* block = f.w + (np * f.K + k0) * lb;
        for (int64_t s = 0; s < ns; ++s)
          build_step<C>(block + 32 * s * lb, std::min<int64_t>(32, nk - 32 * s), steps.get()[s].b);
        const float* sc = block_scales(f, np, kb, sbuf);
        for (int64_t m0 = c0; m0 < c0 + rows; m0 += 16) {
          t.template zero<0>();
          t.template zero<1>();
          t.template zero<2>();
          t.template zero<3>();
          for (int64_t s = 0; s < ns; ++s) {
            t.template load<4>(a.xa + m0 * a.xa_stride + k0 + 32 * s, a.xa_stride * 2);
            dp_group<Tiles, 0, 6>(t, steps.get()[s].b);
            dp_group<Tiles, 1, 7>(t, steps.get()[s].b);
            dp_group<Tiles, 2, 6>(t, steps.get()[s].b);
            dp_group<Tiles, 3, 7>(t, steps.get()[s].b);
          }
          t.template store<0>(&c[0][0], 256);
          t.template store<1>(&c[0][16], 256);
          t.template store<2>(&c[0][32], 256);
          t.template store<3>(&c[0][48], 256);
          for (int j = 0; j < 4; ++j) {
            const __m512 s = _mm512_loadu_ps(sc + 16 * j);
            for (int r = 0; r < 16; ++r) {
              float* row = acc + (m0 - c0 + r) * kFp8Panel + 16 * j;
              _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_load_ps(&c[r][16 * j]), s, _mm512_loadu_ps(row)));
            }
          }
        }
      }
      const int64_t real = std::max<int64_t>(0, std::min(rows, f.M - c0));
      if (f.out_bf16)
        store_rows<uint16_t>(f, np, c0, real, acc);
      else
        store_rows<float>(f, np, c0, real, acc);
    }
}

}  // namespace

void amx_linear_fp8(const Fp8AmxArgs& a, int tile_backend) {
  const int64_t NP = (a.f.N + kFp8Panel - 1) / kFp8Panel;
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
    const bool hw = TileBackend(tile_backend) == TileBackend::kHardware;
    switch (a.f.codes) {
      case kCodesE2m1:
        return hw ? panels<HwTiles, kCodesE2m1>(a, b, e) : panels<EmuTiles, kCodesE2m1>(a, b, e);
      case kCodesInt4:
        return hw ? panels<HwTiles, kCodesInt4>(a, b, e) : panels<EmuTiles, kCodesInt4>(a, b, e);
      default:
        return hw ? panels<HwTiles, kCodesFp8>(a, b, e) : panels<EmuTiles, kCodesFp8>(a, b, e);
    }
  });
}
#endif

}  // namespace pds
