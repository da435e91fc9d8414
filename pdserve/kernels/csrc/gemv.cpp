// y = x w^T (+ bias) for a bfloat16 weight packed for vdpbf16ps, output in bf16 or float32.
//
// At batch 1..8 a linear layer is a read of its weight, so the kernel is built around reading it
// sequentially at memory speed; more rows are taken 8 at a time per block of 16 outputs, the
// block staying in cache between them (the LM head uses this for float32 logits at any batch). The weight [N, K] is packed once at load ("VNNI-16" layout):
//   packed[nb][kp][i][e] = w[16 nb + i][2 kp + e]     shape [ceil(N/16), ceil(K/2), 16, 2]
// so one 64-byte line holds the pair (k, k+1) of 16 outputs, a block of 16 outputs is one
// contiguous run, and each step is one vdpbf16ps of that line with x's pair broadcast: the 16
// float32 accumulators are the 16 outputs, no horizontal sums. x is rounded to bf16 first, as in
// any bf16 GEMM. Without avx512_bf16 the pairs are widened to fp32 and multiplied with FMAs.
// Each row is computed the same way whatever the number of rows: results do not depend on batching.
#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace pds {
namespace {

constexpr int64_t kRowsPerPass = 8;
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead to prefetch the weight stream into L2

struct GemvArgs {
  const uint16_t* w;  // packed, [NB, KP, 16, 2]
  const void* bias;  // [N] or null, dtype of out
  void* out;  // [M, N] row stride out_stride
  int64_t M, N, K, KP, out_stride;
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
// one block of 16 outputs (nb) for rows m0 .. m0 + M
template <int M>
PDS_AVX512_BF16 void block_dp(const GemvArgs& a, const uint16_t* xb, int64_t nb, int64_t m0) {
  // Two accumulators per row hide vdpbf16ps latency; the same two for every M, so a row's result
  // does not depend on how many rows share the call (batch invariance).
  constexpr int S = 2;
  const int64_t KP = a.KP;
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb) + m0 * KP;  // bf16 pairs
  const uint16_t* blk = a.w + nb * KP * 32;
  const char* pf = reinterpret_cast<const char*>(blk) + kPrefetchBytes;
  __m512 acc[M][S];
  for (int m = 0; m < M; ++m)
    for (int s = 0; s < S; ++s) acc[m][s] = _mm512_setzero_ps();
  int64_t kp = 0;
  for (; kp + S <= KP; kp += S) {
    for (int s = 0; s < S; ++s) {
      _mm_prefetch(pf + (kp + s) * 64, _MM_HINT_T1);
      const __m512i wv = _mm512_load_si512(blk + (kp + s) * 32);
      for (int m = 0; m < M; ++m)
        acc[m][s] = _mm512_dpbf16_ps(acc[m][s], (__m512bh)_mm512_set1_epi32(x32[m * KP + kp + s]), (__m512bh)wv);
    }
  }
  for (; kp < KP; ++kp) {
    const __m512i wv = _mm512_load_si512(blk + kp * 32);
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_set1_epi32(x32[m * KP + kp]), (__m512bh)wv);
  }
  const int64_t n0 = nb * 16;
  const __mmask16 mk = tail_mask(a.N - n0);
  for (int m = 0; m < M; ++m) {
    __m512 r = _mm512_add_ps(acc[m][0], acc[m][1]);
    if (a.bias)
      r = _mm512_add_ps(r, a.out_bf16 ? load16(static_cast<const uint16_t*>(a.bias) + n0, mk)
                                      : load16(static_cast<const float*>(a.bias) + n0, mk));
    if (a.out_bf16)
      store16(static_cast<uint16_t*>(a.out) + (m0 + m) * a.out_stride + n0, r, mk);
    else
      store16(static_cast<float*>(a.out) + (m0 + m) * a.out_stride + n0, r, mk);
  }
}

// AVX-512 without bf16 dot products: even and odd k of each pair widened to fp32 separately.
template <int M>
PDS_AVX512 void block_fma(const GemvArgs& a, const uint16_t* xb, int64_t nb, int64_t m0) {
  const int64_t KP = a.KP;
  const uint16_t* x = xb + m0 * 2 * KP;
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  const uint16_t* blk = a.w + nb * KP * 32;
  const char* pf = reinterpret_cast<const char*>(blk) + kPrefetchBytes;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    _mm_prefetch(pf + kp * 64, _MM_HINT_T1);
    const __m512i wv = _mm512_load_si512(blk + kp * 32);
    const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
    const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(wv, hi_mask));
    for (int m = 0; m < M; ++m) {
      const __m512 x0 = _mm512_set1_ps(bf16_to_f32(x[m * 2 * KP + 2 * kp]));
      const __m512 x1 = _mm512_set1_ps(bf16_to_f32(x[m * 2 * KP + 2 * kp + 1]));
      acc[m] = _mm512_fmadd_ps(x1, w_odd, _mm512_fmadd_ps(x0, w_even, acc[m]));
    }
  }
  const int64_t n0 = nb * 16;
  const __mmask16 mk = tail_mask(a.N - n0);
  for (int m = 0; m < M; ++m) {
    __m512 r = acc[m];
    if (a.bias)
      r = _mm512_add_ps(r, a.out_bf16 ? load16(static_cast<const uint16_t*>(a.bias) + n0, mk)
                                      : load16(static_cast<const float*>(a.bias) + n0, mk));
    if (a.out_bf16)
      store16(static_cast<uint16_t*>(a.out) + (m0 + m) * a.out_stride + n0, r, mk);
    else
      store16(static_cast<float*>(a.out) + (m0 + m) * a.out_stride + n0, r, mk);
  }
}

template <int M>
void run_block(const GemvArgs& a, const uint16_t* xb, int64_t nb, int64_t m0) {
  if (use_avx512_bf16())
    block_dp<M>(a, xb, nb, m0);
  else
    block_fma<M>(a, xb, nb, m0);
}

// every row of blocks nb0 .. nb1, 8 rows per pass over a block
void run_blocks(const GemvArgs& a, const uint16_t* xb, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kRowsPerPass) {
      switch (std::min<int64_t>(kRowsPerPass, a.M - m0)) {
        case 1: run_block<1>(a, xb, nb, m0); break;
        case 2: run_block<2>(a, xb, nb, m0); break;
        case 3: run_block<3>(a, xb, nb, m0); break;
        case 4: run_block<4>(a, xb, nb, m0); break;
        case 5: run_block<5>(a, xb, nb, m0); break;
        case 6: run_block<6>(a, xb, nb, m0); break;
        case 7: run_block<7>(a, xb, nb, m0); break;
        default: run_block<8>(a, xb, nb, m0); break;
      }
    }
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
  GemvArgs a{data<uint16_t>(packed), bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(),
             M, N, K, KP, out.stride(0), out.scalar_type() == at::kBFloat16};
  const int64_t NB = packed.size(0);
  at::parallel_for(0, NB, 4, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (use_avx512()) return run_blocks(a, xb.data(), b, e);
#endif
    gemv_scalar(a, xb.data(), b, e);
  });
}

}  // namespace pds
