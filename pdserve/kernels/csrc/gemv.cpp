// y = x w^T (+ bias) for a bfloat16 weight packed for vdpbf16ps, output in bf16 or float32.
//
// The weight [N, K] is packed once at load ("VNNI-16" layout):
//   packed[nb][kp][i][e] = w[16 nb + i][2 kp + e]     shape [ceil(N/16), ceil(K/2), 16, 2]
// so one 64-byte line holds the pair (k, k+1) of 16 outputs and a block of 16 outputs is one
// contiguous run. Each step is one vdpbf16ps of such a line with x's pair broadcast: the 16 float32
// lanes are 16 outputs, no horizontal sums. x is rounded to bf16 first, as in any bf16 GEMM.
//
// Work is cut in tiles of R rows x J blocks (R x J accumulators in registers):
// - few rows (decode at small batch): the step is a read of the weight, streamed once at memory
//   speed with J blocks in flight and a software prefetch into L2;
// - many rows: 4 x 4 tiles over a panel of 4 blocks that stays in L2 while the row tiles pass.
// Every output is one float32 accumulator summed over k in order, whatever the tile: a row's
// result does not depend on how many rows share the call (batch invariance).
// Without avx512_bf16 the pairs are widened to fp32 and multiplied with FMAs (the same per-output
// order on that path).
#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace pds {
namespace {

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead to prefetch the weight stream into L2
constexpr int64_t kSmallM = 8;  // up to this many rows: one row tile, the weight streamed once

struct GemvArgs {
  const uint16_t* w;  // packed, [NB, KP, 16, 2]
  const void* bias;  // [N] or null, dtype of out
  void* out;  // [M, N] row stride out_stride
  int64_t M, N, K, KP, NB, out_stride;
  bool out_bf16;
};

inline void put(const GemvArgs& a, int64_t m, int64_t n, float v) {
  if (a.bias) v += a.out_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(a.bias)[n]) : static_cast<const float*>(a.bias)[n];
  if (a.out_bf16)
    static_cast<uint16_t*>(a.out)[m * a.out_stride + n] = f32_to_bf16(v);
  else
    static_cast<float*>(a.out)[m * a.out_stride + n] = v;
}

// xb: x rounded to bf16, [M, 2 KP] zero padded
void gemv_scalar(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint16_t* blk = a.w + nb * a.KP * 32;
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[16] = {0};
      for (int64_t kp = 0; kp < a.KP; ++kp)
        for (int i = 0; i < 16; ++i)
          acc[i] += bf16_to_f32(xb[m * 2 * a.KP + 2 * kp]) * bf16_to_f32(blk[kp * 32 + 2 * i]) +
                    bf16_to_f32(xb[m * 2 * a.KP + 2 * kp + 1]) * bf16_to_f32(blk[kp * 32 + 2 * i + 1]);
      for (int i = 0; i < 16 && nb * 16 + i < a.N; ++i) put(a, m, nb * 16 + i, acc[i]);
    }
  }
}

#if PDS_X86
template <typename T>
PDS_AVX512 inline void store_tile_row(const GemvArgs& a, int64_t m, int64_t n0, __m512 r) {
  const __mmask16 mk = tail_mask(a.N - n0);
  if (a.bias) r = _mm512_add_ps(r, load16(static_cast<const T*>(a.bias) + n0, mk));
  store16(static_cast<T*>(a.out) + m * a.out_stride + n0, r, mk);
}

PDS_AVX512 inline void store_result(const GemvArgs& a, int64_t m, int64_t n0, __m512 r) {
  if (a.out_bf16)
    store_tile_row<uint16_t>(a, m, n0, r);
  else
    store_tile_row<float>(a, m, n0, r);
}

// rows m0 .. m0 + R, blocks nb0 .. nb0 + J
template <int R, int J>
PDS_AVX512_BF16 void tile_dp(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t m0, bool prefetch) {
  const int64_t KP = a.KP;
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb) + m0 * KP;  // bf16 pairs
  const uint16_t* blk[J];
  for (int j = 0; j < J; ++j) blk[j] = a.w + (nb0 + j) * KP * 32;
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512i wv[J];
    for (int j = 0; j < J; ++j) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(blk[j] + kp * 32) + kPrefetchBytes, _MM_HINT_T1);
      wv[j] = _mm512_load_si512(blk[j] + kp * 32);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(int32_t(x32[r * KP + kp]));
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xp, (__m512bh)wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) store_result(a, m0 + r, (nb0 + j) * 16, acc[r][j]);
}

// AVX-512 without bf16 dot products: even and odd k of each pair widened to fp32 separately.
template <int R, int J>
PDS_AVX512 void tile_fma(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t m0, bool prefetch) {
  const int64_t KP = a.KP;
  const uint16_t* x = xb + m0 * 2 * KP;
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  const uint16_t* blk[J];
  for (int j = 0; j < J; ++j) blk[j] = a.w + (nb0 + j) * KP * 32;
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512 even[J], odd[J];
    for (int j = 0; j < J; ++j) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(blk[j] + kp * 32) + kPrefetchBytes, _MM_HINT_T1);
      const __m512i wv = _mm512_load_si512(blk[j] + kp * 32);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(wv, hi_mask));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(bf16_to_f32(x[r * 2 * KP + 2 * kp]));
      const __m512 x1 = _mm512_set1_ps(bf16_to_f32(x[r * 2 * KP + 2 * kp + 1]));
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(x1, odd[j], _mm512_fmadd_ps(x0, even[j], acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) store_result(a, m0 + r, (nb0 + j) * 16, acc[r][j]);
}

template <int R, int J>
void tile(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t m0, bool prefetch) {
  if (use_avx512_bf16())
    tile_dp<R, J>(a, xb, nb0, m0, prefetch);
  else
    tile_fma<R, J>(a, xb, nb0, m0, prefetch);
}

// one tile with R = rows (1..8), J = blocks (1..4); R * J <= 16 accumulators
template <int J>
void tile_rows(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t m0, int64_t rows, bool prefetch) {
  switch (rows) {
    case 1: return tile<1, J>(a, xb, nb0, m0, prefetch);
    case 2: return tile<2, J>(a, xb, nb0, m0, prefetch);
    case 3: return tile<3, J>(a, xb, nb0, m0, prefetch);
    case 4: return tile<4, J>(a, xb, nb0, m0, prefetch);
    case 5: return tile<5, (J > 2 ? 2 : J)>(a, xb, nb0, m0, prefetch);
    case 6: return tile<6, (J > 2 ? 2 : J)>(a, xb, nb0, m0, prefetch);
    case 7: return tile<7, (J > 2 ? 2 : J)>(a, xb, nb0, m0, prefetch);
    default: return tile<8, (J > 2 ? 2 : J)>(a, xb, nb0, m0, prefetch);
  }
}

void run_tile(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t blocks, int64_t m0, int64_t rows,
              bool prefetch) {
  switch (blocks) {
    case 1: return tile_rows<1>(a, xb, nb0, m0, rows, prefetch);
    case 2: return tile_rows<2>(a, xb, nb0, m0, rows, prefetch);
    case 3: return tile_rows<3>(a, xb, nb0, m0, rows, prefetch);
    default: return tile_rows<4>(a, xb, nb0, m0, rows, prefetch);
  }
}

// blocks nb0 .. nb1 for every row
void run_panel(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t nb1) {
  if (a.M <= kSmallM) {
    // one pass: J blocks at a time (2 when the rows need 16 accumulators), the weight streamed
    const int64_t J = a.M <= 4 ? 4 : 2;
    for (int64_t nb = nb0; nb < nb1; nb += J) run_tile(a, xb, nb, std::min(J, nb1 - nb), 0, a.M, true);
    return;
  }
  // 4 x 4 tiles; the panel of 4 blocks is read from memory by the first row tile, from L2 after
  for (int64_t nb = nb0; nb < nb1; nb += 4) {
    const int64_t blocks = std::min<int64_t>(4, nb1 - nb);
    for (int64_t m0 = 0; m0 < a.M; m0 += 4) run_tile(a, xb, nb, blocks, m0, std::min<int64_t>(4, a.M - m0), m0 == 0);
  }
}
#endif

}  // namespace

// out: [M, N] (rows contiguous), float32 or bf16; x: [M, K] (rows contiguous), float32 or bf16;
// packed: the weight [N, K] in the layout above, [ceil(N/16), ceil(K/2), 16, 2] bf16, 64-byte
// aligned; bias: [N] in out's dtype, optional.
void linear_vnni(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "linear_vnni: weight must be packed as a contiguous, 64-byte aligned [N/16, K/2, 16, 2] bfloat16 tensor");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "linear_vnni: x and out must be 2-D with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "linear_vnni: x and out must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), KP = packed.size(1);
  TORCH_CHECK(packed.size(0) == (N + 15) / 16 && KP == (K + 1) / 2 && out.size(0) == M,
              "linear_vnni: shapes x ", x.sizes(), ", packed weight ", packed.sizes(), ", out ", out.sizes(),
              " do not agree");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == out.scalar_type(),
                "linear_vnni: bias must be contiguous [N] in out's dtype");
  if (M == 0) return;
  // x as bf16 pairs, zero padded to 2 KP
  std::vector<uint16_t> xb(M * 2 * KP, 0);
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      xb[m * 2 * KP + k] = x_bf16 ? data<uint16_t>(x)[m * x.stride(0) + k] : f32_to_bf16(data<float>(x)[m * x.stride(0) + k]);
    }
  }
  const int64_t NB = packed.size(0);
  GemvArgs a{data<uint16_t>(packed), bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(),
             M, N, K, KP, NB, out.stride(0), out.scalar_type() == at::kBFloat16};
  // threads take panels of 4 blocks (64 outputs)
  at::parallel_for(0, (NB + 3) / 4, 1, [&](int64_t b, int64_t e) {
    const int64_t nb0 = b * 4, nb1 = std::min(NB, e * 4);
#if PDS_X86
    if (use_avx512()) return run_panel(a, xb.data(), nb0, nb1);
#endif
    gemv_scalar(a, xb.data(), nb0, nb1);
  });
}

}  // namespace pds
