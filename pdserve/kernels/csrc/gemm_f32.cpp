// y = x w^T (+ bias) in float32 with a fixed reduction order: the batch-invariant matmul of
// --enable-deterministic-inference for float32 models.
//
// A BLAS sgemm picks its blocking (and its K split) from the shapes, so a row's result changes in
// the last bits with the number of rows in the call; a prompt computed whole and the same prompt
// computed after a cached prefix then differ. Here every output is one float32 accumulator summed
// over k = 0 .. K-1 in order with a fused multiply-add, whatever M, the tile or the thread: the
// AVX-512 tiles, the 8-lane ones (gemm_vec8.cpp) and the portable loop (std::fma) give the same
// bits.
//
// The weight [N, K] is packed once in panels of 64 outputs:
//   packed[np][k][j][i] = w[64 np + 16 j + i][k]   shape [ceil(N/64), K, 4, 16] (zero padded)
// so a panel is one sequential stream, read once per tile of up to 4 rows.
#include "common.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace pds {
namespace {

constexpr int64_t kPanel = 64;

void panel_scalar(const F32Args& a, int64_t np) {
  const float* p = a.w + np * a.K * kPanel;
  const int64_t n0 = np * kPanel, nn = std::min<int64_t>(kPanel, a.N - n0);
  for (int64_t m = 0; m < a.M; ++m) {
    const float* x = a.x + m * a.x_stride;
    float acc[kPanel] = {0};
    for (int64_t k = 0; k < a.K; ++k)
      for (int o = 0; o < kPanel; ++o) acc[o] = std::fma(x[k], p[k * kPanel + o], acc[o]);
    for (int64_t o = 0; o < nn; ++o) a.out[m * a.out_stride + n0 + o] = acc[o] + (a.bias ? a.bias[n0 + o] : 0.0f);
  }
}

#if PDS_X86
// rows m0 .. m0 + R of panel np
template <int R>
PDS_AVX512 void tile(const F32Args& a, int64_t np, int64_t m0) {
  const float* p = a.w + np * a.K * kPanel;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; ++k) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(p + k * kPanel + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(a.x[(m0 + r) * a.x_stride + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      const int64_t n = np * kPanel + 16 * j;
      if (n >= a.N) break;
      const __mmask16 mk = tail_mask(a.N - n);
      __m512 v = acc[r][j];
      // the bias is added after the sum, as the portable loop does
      if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a.bias + n));
      _mm512_mask_storeu_ps(a.out + (m0 + r) * a.out_stride + n, mk, v);
    }
}

void panel_avx512(const F32Args& a, int64_t np) {
  for (int64_t m0 = 0; m0 < a.M; m0 += 4) {
    switch (std::min<int64_t>(4, a.M - m0)) {
      case 1: tile<1>(a, np, m0); break;
      case 2: tile<2>(a, np, m0); break;
      case 3: tile<3>(a, np, m0); break;
      default: tile<4>(a, np, m0); break;
    }
  }
}
#endif

}  // namespace

// out: [M, N] float32, x: [M, K] float32 (rows contiguous), packed: [ceil(N/64), K, 4, 16] float32
// (pack_panels(w, 1) in layers/linear.py), bias: [N] float32, optional.
void linear_f32(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 5 && packed.size(2) == 4 && packed.size(3) == 16 &&
                  packed.size(4) == 1 && packed.is_contiguous(),
              "linear_f32: weight must be packed as a contiguous [N/64, K, 4, 16, 1] float32 tensor");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "linear_f32: x and out must be 2-D float32 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(1) == K && out.size(0) == M,
              "linear_f32: shapes x ", x.sizes(), ", packed weight ", packed.sizes(), ", out ", out.sizes(),
              " do not agree");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat,
                "linear_f32: bias must be contiguous [N] float32");
  if (M == 0) return;
  F32Args a{data<float>(packed), bias.has_value() ? data<float>(*bias) : nullptr, data<float>(x), data<float>(out),
            M, N, K, x.stride(0), out.stride(0)};
  const bool avx512 = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t b, int64_t e) {
    if (v8 && !avx512) return linear_f32_panels_vec8(a, b, e);
    for (int64_t np = b; np < e; ++np) {
#if PDS_X86
      if (avx512) {
        panel_avx512(a, np);
        continue;
      }
#endif
      panel_scalar(a, np);
    }
  });
}

}  // namespace pds
