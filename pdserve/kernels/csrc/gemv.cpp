// y = x w^T (+ bias) for a bfloat16 weight packed for vdpbf16ps, output in bf16 or float32.
//
// The weight [N, K] is packed once at load in panels of 64 outputs ("VNNI-16x4" layout):
//   packed[np][kp][j][i][e] = w[64 np + 16 j + i][2 kp + e]   shape [ceil(N/64), ceil(K/2), 4, 16, 2]
// (zero padded). One 64-byte line holds the pair (k, k+1) of 16 outputs; the 4 lines of a step are
// adjacent, so a panel is one sequential stream. Each line meets x's pair, broadcast, in one
// vdpbf16ps: the 16 float32 lanes are 16 outputs, no horizontal sums. x is rounded to bf16 first,
// as in any bf16 GEMM.
//
// Tiles are R rows x one panel (R x 4 accumulators): with few rows (decode at small batch) the
// step is a read of the weight, streamed once at memory speed with a software prefetch into L2;
// with many rows, 4-row tiles pass over a panel that stays in L2. Every output is one float32
// accumulator summed over k in order, whatever the tile: a row's result does not depend on how
// many rows share the call (batch invariance). Without avx512_bf16 the pairs are widened to fp32
// and multiplied with FMAs (the same per-output order on that path); on AVX2 and NEON hosts by the
// 8-lane kernels of gemm_vec8.cpp, in that order too, which also serve prefill-sized calls where
// oneDNN has no bf16 matmul.
//
// On AMX hosts calls of at least amx_min_rows rows run on tiles instead (amx_gemm.cpp: the same
// packed weight, the same per-output order but for the order inside a pair of k).
#include "amx.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace pds {
namespace {

constexpr int64_t kPanel = 64;  // outputs per panel (4 vectors of 16)
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead to prefetch the weight stream into L2

inline const uint16_t* panel_ptr(const GemvArgs& a, int64_t np) { return a.w + np * a.KP * 128; }

inline void put(const GemvArgs& a, int64_t m, int64_t n, float v) {
  if (a.bias) v += a.out_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(a.bias)[n]) : static_cast<const float*>(a.bias)[n];
  if (a.out_bf16)
    static_cast<uint16_t*>(a.out)[m * a.out_stride + n] = f32_to_bf16(v);
  else
    static_cast<float*>(a.out)[m * a.out_stride + n] = v;
}

// xb: x rounded to bf16, M rows of 2 KP (zero padded), row stride a.x_stride
void gemv_scalar(const GemvArgs& a, const uint16_t* xb, int64_t np0, int64_t np1) {
  for (int64_t np = np0; np < np1; ++np) {
    const uint16_t* p = panel_ptr(a, np);
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kPanel] = {0};
      for (int64_t kp = 0; kp < a.KP; ++kp)
        for (int o = 0; o < kPanel; ++o)
          acc[o] += bf16_to_f32(xb[m * a.x_stride + 2 * kp]) * bf16_to_f32(p[kp * 128 + 2 * o]) +
                    bf16_to_f32(xb[m * a.x_stride + 2 * kp + 1]) * bf16_to_f32(p[kp * 128 + 2 * o + 1]);
      for (int o = 0; o < kPanel && np * kPanel + o < a.N; ++o) put(a, m, np * kPanel + o, acc[o]);
    }
  }
}

#if PDS_X86
template <typename T>
PDS_AVX512 inline void store_vec(const GemvArgs& a, int64_t m, int64_t n0, __m512 r) {
  if (n0 >= a.N) return;
  const __mmask16 mk = tail_mask(a.N - n0);
  if (a.bias) r = _mm512_add_ps(r, load16(static_cast<const T*>(a.bias) + n0, mk));
  store16(static_cast<T*>(a.out) + m * a.out_stride + n0, r, mk);
}

PDS_AVX512 inline void store_result(const GemvArgs& a, int64_t m, int64_t n0, __m512 r) {
  if (a.out_bf16)
    store_vec<uint16_t>(a, m, n0, r);
  else
    store_vec<float>(a, m, n0, r);
}

// rows m0 .. m0 + R of panel np
template <int R>
PDS_AVX512_BF16 void tile_dp(const GemvArgs& a, const uint16_t* xb, int64_t np, int64_t m0, bool prefetch) {
  const int64_t KP = a.KP, xs = a.x_stride / 2;
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb + m0 * a.x_stride);  // bf16 pairs
  const uint16_t* p = panel_ptr(a, np);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    const uint16_t* step = p + kp * 128;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 128, _MM_HINT_T1);
    }
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_load_si512(step + j * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(int32_t(x32[r * xs + kp]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xp, (__m512bh)wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) store_result(a, m0 + r, np * kPanel + j * 16, acc[r][j]);
}

// AVX-512 without bf16 dot products: even and odd k of each pair widened to fp32 separately.
template <int R>
PDS_AVX512 void tile_fma(const GemvArgs& a, const uint16_t* xb, int64_t np, int64_t m0, bool prefetch) {
  const int64_t KP = a.KP, xs = a.x_stride;
  const uint16_t* x = xb + m0 * xs;
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  const uint16_t* p = panel_ptr(a, np);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    const uint16_t* step = p + kp * 128;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 128, _MM_HINT_T1);
    }
    __m512 even[4], odd[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i wv = _mm512_load_si512(step + j * 32);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(wv, hi_mask));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(bf16_to_f32(x[r * xs + 2 * kp]));
      const __m512 x1 = _mm512_set1_ps(bf16_to_f32(x[r * xs + 2 * kp + 1]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(x1, odd[j], _mm512_fmadd_ps(x0, even[j], acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) store_result(a, m0 + r, np * kPanel + j * 16, acc[r][j]);
}

template <int R>
void tile(const GemvArgs& a, const uint16_t* xb, int64_t np, int64_t m0, bool prefetch) {
  if (use_avx512_bf16())
    tile_dp<R>(a, xb, np, m0, prefetch);
  else
    tile_fma<R>(a, xb, np, m0, prefetch);
}

// panels np0 .. np1 for every row, in tiles of up to 4 rows; the first tile of a panel streams it
void run_panels(const GemvArgs& a, const uint16_t* xb, int64_t np0, int64_t np1) {
  for (int64_t np = np0; np < np1; ++np) {
    for (int64_t m0 = 0; m0 < a.M; m0 += 4) {
      switch (std::min<int64_t>(4, a.M - m0)) {
        case 1: tile<1>(a, xb, np, m0, m0 == 0); break;
        case 2: tile<2>(a, xb, np, m0, m0 == 0); break;
        case 3: tile<3>(a, xb, np, m0, m0 == 0); break;
        default: tile<4>(a, xb, np, m0, m0 == 0); break;
      }
    }
  }
}
#endif

}  // namespace

// out: [M, N] (rows contiguous), float32 or bf16; x: [M, K] (rows contiguous), float32 or bf16;
// packed: the weight [N, K] in the layout above, [ceil(N/64), ceil(K/2), 4, 16, 2] bf16, 64-byte
// aligned; bias: [N] in out's dtype, optional.
// amx_min_rows: calls of at least this many rows take AMX where it is used (-1: the process
// default, see amx.h; 1: every call, for one kernel at every batch size)
void linear_vnni(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias,
                 int64_t amx_min_rows) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 && packed.size(2) == 4 &&
                  packed.size(3) == 16 && packed.size(4) == 2 && packed.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "linear_vnni: weight must be packed as a contiguous, 64-byte aligned [N/64, K/2, 4, 16, 2] bfloat16 tensor");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "linear_vnni: x and out must be 2-D with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "linear_vnni: x and out must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), KP = packed.size(1), NP = packed.size(0);
  TORCH_CHECK(NP == (N + kPanel - 1) / kPanel && KP == (K + 1) / 2 && out.size(0) == M,
              "linear_vnni: shapes x ", x.sizes(), ", packed weight ", packed.sizes(), ", out ", out.sizes(),
              " do not agree");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == out.scalar_type(),
                "linear_vnni: bias must be contiguous [N] in out's dtype");
  if (M == 0) return;
  if (M >= amx_linear_min_rows(amx_min_rows)) {
    const TileBackend tb = amx_backend();
    if (tb != TileBackend::kNone) return amx_linear_bf16(out, x, packed, bias, tb);
  }
  // x as rows of bf16 pairs: read in place when it is bf16 with whole pairs per row (a decode
  // step's every call), else rounded into a zero-padded copy
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const bool in_place = x_bf16 && K == 2 * KP && x.stride(0) % 2 == 0 &&
                        reinterpret_cast<uintptr_t>(x.data_ptr()) % sizeof(uint32_t) == 0;
  std::vector<uint16_t> xb;
  if (!in_place) {
    xb.assign(M * 2 * KP, 0);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        xb[m * 2 * KP + k] = x_bf16 ? data<uint16_t>(x)[m * x.stride(0) + k] : f32_to_bf16(data<float>(x)[m * x.stride(0) + k]);
      }
    }
  }
  const uint16_t* xp = in_place ? data<uint16_t>(x) : xb.data();
  GemvArgs a{data<uint16_t>(packed), bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(),
             M, N, K, KP, NP, out.stride(0), out.scalar_type() == at::kBFloat16, in_place ? x.stride(0) : 2 * KP};
  const bool avx512 = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (avx512) return run_panels(a, xp, b, e);
#endif
    if (v8) return linear_vnni_panels_vec8(a, xp, b, e);
    gemv_scalar(a, xp, b, e);
  });
}

void linear_vnni(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias) {
  linear_vnni(out, x, packed, bias, -1);
}

}  // namespace pds
