// w8a8_int8 linear layers: int8 weights (symmetric, one scale per output channel) times int8
// activations (symmetric, one scale per token, quantized on the fly), int32 accumulation with
// AVX512-VNNI vpdpbusd (AMX's TDPBUSD, or the 8-lane kernels of int8_vec8.cpp: AVX2, AVX-VNNI,
// NEON, SDOT, USDOT), dequantized to bf16 or float32.
//
// Weight layout, in panels of 64 outputs ("VNNI-4x4"): packed[np][kq][j][i][e] =
// wq[64 np + 16 j + i][4 kq + e], shape [ceil(N/64), ceil(K/4), 4, 16, 4] (zero padded): one
// 64-byte line is 4 consecutive k of 16 outputs, which vpdpbusd multiplies with 4 bytes of x
// broadcast, and a panel is one sequential stream. vpdpbusd takes unsigned x, so x is stored as
// xq + 128 and the extra 128 * sum_k wq[n][k] (colsum, precomputed) is subtracted from each sum:
//   y[m][n] = (acc[m][n] - 128 colsum[n]) * x_scale[m] * w_scale[n] + bias[n]
// The integer sums are exact, so results do not depend on tiling or batching. Tiles as in the
// bf16 kernel (gemv.cpp): R rows x one panel. On AMX hosts calls of at least amx_min_rows rows
// run on tiles (TDPBUSD, amx_gemm.cpp) on the same packed weight, with the same results.
#include "amx.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace pds {

namespace {

constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kSmallM = 8;

constexpr int64_t kPanel = 64;

// per row: scale = max|x| / 127, xq = round(x / scale) + 128 (zero padded to 4 KQ with 128)
template <typename T>
void quantize_rows(const T* x, int64_t stride, int64_t M, int64_t K, int64_t K4, uint8_t* xq, float* scale) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * stride;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(load_f32(row + k)));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / s;
    scale[m] = s;
    uint8_t* q = xq + m * K4;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(load_f32(row + k) * inv);
      q[k] = uint8_t(int32_t(std::max(-127.f, std::min(127.f, v))) + 128);
    }
    for (int64_t k = K; k < K4; ++k) q[k] = 128;
  }
}

#if PDS_X86
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2"))) void quantize_rows_avx512(
    const T* x, int64_t stride, int64_t M, int64_t K, int64_t K4, uint8_t* xq, float* scale) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * stride;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, load16(row + k, tail_mask(K - k))));
    const float mx = _mm512_reduce_max_ps(amax);
    const float s = mx > 0.f ? mx / 127.f : 1.f;
    scale[m] = s;
    const __m512 inv = _mm512_set1_ps(1.f / s);
    uint8_t* q = xq + m * K4;
    for (int64_t k = 0; k < K4; k += 16) {
      const __mmask16 mk = tail_mask(K - k);  // beyond K: 0, stored as 128
      const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load16(row + k, mk), inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512i iv = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f)));
      iv = _mm512_add_epi32(iv, _mm512_set1_epi32(128));
      _mm_mask_storeu_epi8(q + k, tail_mask(K4 - k), _mm512_cvtepi32_epi8(iv));
    }
  }
}
#endif

template <typename T>
void quantize(const T* x, int64_t stride, int64_t M, int64_t K, int64_t K4, uint8_t* xq, float* scale) {
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (use_avx512()) return quantize_rows_avx512(x + b * stride, stride, e - b, K, K4, xq + b * K4, scale + b);
#endif
    if (use_vec8()) return quantize_rows_vec8(x + b * stride, stride, e - b, K, K4, xq + b * K4, scale + b);
    quantize_rows(x + b * stride, stride, e - b, K, K4, xq + b * K4, scale + b);
  });
}

void int8_scalar(const Int8Args& a, int64_t np0, int64_t np1) {
  for (int64_t np = np0; np < np1; ++np) {
    const int8_t* p = a.w + np * a.KQ * 256;
    for (int64_t m = 0; m < a.M; ++m) {
      const uint8_t* x = a.xq + m * a.KQ * 4;
      for (int o = 0; o < kPanel && np * kPanel + o < a.N; ++o) {
        int32_t acc = 0;
        for (int64_t kq = 0; kq < a.KQ; ++kq)
          for (int e = 0; e < 4; ++e) acc += int32_t(x[kq * 4 + e]) * int32_t(p[kq * 256 + o * 4 + e]);
        const int64_t n = np * kPanel + o;
        float v = float(acc - 128 * a.colsum[n]) * a.x_scale[m] * a.w_scale[n];
        if (a.bias) v += a.out_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(a.bias)[n]) : static_cast<const float*>(a.bias)[n];
        if (a.out_bf16)
          static_cast<uint16_t*>(a.out)[m * a.out_stride + n] = f32_to_bf16(v);
        else
          static_cast<float*>(a.out)[m * a.out_stride + n] = v;
      }
    }
  }
}

#if PDS_X86

template <typename T>
PDS_AVX512_VNNI inline void finish(const Int8Args& a, int64_t m, int64_t n0, __m512i acc) {
  if (n0 >= a.N) return;
  const __mmask16 mk = tail_mask(a.N - n0);
  const __m512i fixed = _mm512_sub_epi32(acc, _mm512_slli_epi32(_mm512_loadu_si512(a.colsum + n0), 7));
  __m512 r = _mm512_mul_ps(_mm512_cvtepi32_ps(fixed),
                           _mm512_mul_ps(_mm512_set1_ps(a.x_scale[m]), _mm512_loadu_ps(a.w_scale + n0)));
  if (a.bias) r = _mm512_add_ps(r, load16(static_cast<const T*>(a.bias) + n0, mk));
  store16(static_cast<T*>(a.out) + m * a.out_stride + n0, r, mk);
}

// Steps kq0 .. kq1 of rows m0 .. m0 + R of panel np. The int32 sums start from zero (kq0 == 0) or
// from `carry` ([R][64]) and end in `carry`, or, after the last step, in the output.
template <int R>
PDS_AVX512_VNNI void tile_vnni(const Int8Args& a, int64_t np, int64_t m0, int64_t kq0, int64_t kq1, bool prefetch,
                               int32_t* carry) {
  const int64_t KQ = a.KQ;
  const int32_t* x32 = reinterpret_cast<const int32_t*>(a.xq) + m0 * KQ;  // 4 bytes of x per step
  const int8_t* p = a.w + np * KQ * 256;
  // int32-lane vectors, the type the builtin takes: with __m512i (64-bit lanes) GCC copies every
  // accumulator through other registers and the stack on each step (as it did in moe.cpp)
  __v16si acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = __v16si(kq0 == 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(carry + r * kPanel + j * 16));
  for (int64_t kq = kq0; kq < kq1; ++kq) {
    const int8_t* step = p + kq * 256;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 128, _MM_HINT_T1);
    }
    __v16si wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = __v16si(_mm512_load_si512(step + j * 64));
    for (int r = 0; r < R; ++r) {
      const __v16si xv = __v16si(_mm512_set1_epi32(x32[r * KQ + kq]));
      for (int j = 0; j < 4; ++j)
        acc[r][j] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[r][j]), __m512i(xv), __m512i(wv[j])));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      const __m512i sum = __m512i(acc[r][j]);
      if (kq1 < KQ)
        _mm512_storeu_si512(carry + r * kPanel + j * 16, sum);
      else if (a.out_bf16)
        finish<uint16_t>(a, m0 + r, np * kPanel + j * 16, sum);
      else
        finish<float>(a, m0 + r, np * kPanel + j * 16, sum);
    }
}

void run_tile(const Int8Args& a, int64_t np, int64_t m0, int64_t rows, int64_t kq0, int64_t kq1, bool prefetch,
              int32_t* carry) {
  switch (rows) {
    case 1: return tile_vnni<1>(a, np, m0, kq0, kq1, prefetch, carry);
    case 2: return tile_vnni<2>(a, np, m0, kq0, kq1, prefetch, carry);
    case 3: return tile_vnni<3>(a, np, m0, kq0, kq1, prefetch, carry);
    default: return tile_vnni<4>(a, np, m0, kq0, kq1, prefetch, carry);
  }
}

constexpr int64_t kStepsPerChunk = 64;  // k-steps per pass: 64 x 256 B = 16 KiB of the panel stays in L1
constexpr int64_t kRowsPerChunk = 256;  // rows per pass: their quantized x stays in L2

void run_panels(const Int8Args& a, int64_t np0, int64_t np1, std::vector<int32_t>& carry) {
  if (a.M <= 4) {  // one pass, the weight streamed from memory
    for (int64_t np = np0; np < np1; ++np) run_tile(a, np, 0, a.M, 0, a.KQ, true, nullptr);
    return;
  }
  // 4-row tiles; k in chunks so the panel's chunk stays in L1 while the row tiles pass, rows in
  // chunks whose x stays in L2; partial sums carried between k chunks (integers: order is free)
  carry.resize(kRowsPerChunk * kPanel);
  for (int64_t mc = 0; mc < a.M; mc += kRowsPerChunk) {
    const int64_t mc1 = std::min(a.M, mc + kRowsPerChunk);
    for (int64_t np = np0; np < np1; ++np) {
      for (int64_t kq0 = 0; kq0 < a.KQ; kq0 += kStepsPerChunk) {
        const int64_t kq1 = std::min(a.KQ, kq0 + kStepsPerChunk);
        for (int64_t m0 = mc; m0 < mc1; m0 += 4)
          run_tile(a, np, m0, std::min<int64_t>(4, mc1 - m0), kq0, kq1, m0 == mc, carry.data() + (m0 - mc) * kPanel);
      }
    }
  }
}
#endif

}  // namespace

// x's rows [M, K] (float32 or bf16, contiguous rows) to int8 by w8a8_int8's rule, stored + 128 in
// rows of K4 bytes (zero padded: 128), their scales in `scale` [M]; the tiers' quantizers above
void quantize_activation_rows(const at::Tensor& x, int64_t K4, uint8_t* xq, float* scale) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16)
    quantize(data<uint16_t>(x), x.stride(0), M, K, K4, xq, scale);
  else
    quantize(data<float>(x), x.stride(0), M, K, K4, xq, scale);
}

// out [M, N] = dequant(quant(x) wq^T) (+ bias). x: [M, K] float32 or bf16 (rows contiguous);
// packed: int8 [ceil(N/64), ceil(K/4), 4, 16, 4], 64-byte aligned; colsum: int32 [ceil(N/64) * 64];
// w_scale: float32 [ceil(N/64) * 64]; bias: [N] in out's dtype, optional; out: float32 or bf16.
// amx_min_rows: as linear_vnni's.
void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                 const at::Tensor& w_scale, c10::optional<at::Tensor> bias, int64_t amx_min_rows) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 5 && packed.size(2) == 4 && packed.size(3) == 16 &&
                  packed.size(4) == 4 && packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "linear_w8a8: weight must be packed as a contiguous, 64-byte aligned int8 [N/64, K/4, 4, 16, 4] tensor");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "linear_w8a8: x and out must be float32 or bfloat16 2-D tensors with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NP = packed.size(0), KQ = packed.size(1);
  TORCH_CHECK(NP == (N + kPanel - 1) / kPanel && KQ == (K + 3) / 4 && out.size(0) == M, "linear_w8a8: shapes x ", x.sizes(),
              ", packed weight ", packed.sizes(), ", out ", out.sizes(), " do not agree");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.numel() == NP * kPanel && colsum.is_contiguous() &&
                  w_scale.scalar_type() == at::kFloat && w_scale.numel() == NP * kPanel && w_scale.is_contiguous(),
              "linear_w8a8: colsum (int32) and w_scale (float32) must be contiguous [N/64 * 64]");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == out.scalar_type(),
                "linear_w8a8: bias must be contiguous [N] in out's dtype");
  if (M == 0) return;
  const TileBackend tb = M >= amx_linear_min_rows(amx_min_rows) ? amx_backend() : TileBackend::kNone;
  // AMX reads x in tiles: rows padded to 16, k to 64 (the padding is 128, i.e. zero)
  const int64_t x_stride = tb != TileBackend::kNone ? (KQ * 4 + 63) / 64 * 64 : KQ * 4;
  const int64_t x_rows = tb != TileBackend::kNone ? (M + 15) / 16 * 16 : M;
  std::vector<uint8_t> xq(x_rows * x_stride, 128);
  std::vector<float> xs(M);
  if (x.scalar_type() == at::kBFloat16)
    quantize(data<uint16_t>(x), x.stride(0), M, K, x_stride, xq.data(), xs.data());
  else
    quantize(data<float>(x), x.stride(0), M, K, x_stride, xq.data(), xs.data());
  if (tb != TileBackend::kNone)
    return amx_linear_w8a8(AmxInt8Gemm{packed.data_ptr<int8_t>(), colsum.data_ptr<int32_t>(), w_scale.data_ptr<float>(),
                                       xq.data(), xs.data(), bias.has_value() ? bias->data_ptr() : nullptr,
                                       out.data_ptr(), M, N, KQ, NP, x_stride, out.stride(0),
                                       out.scalar_type() == at::kBFloat16},
                           tb);
  Int8Args a{packed.data_ptr<int8_t>(), colsum.data_ptr<int32_t>(), w_scale.data_ptr<float>(), xq.data(), xs.data(),
             bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(), M, N, KQ, NP, out.stride(0),
             out.scalar_type() == at::kBFloat16};
  const bool vnni512 = use_avx512_vnni(), v8 = use_vec8();
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (vnni512) {
      std::vector<int32_t> carry;
      return run_panels(a, b, e, carry);
    }
#endif
    if (v8) return linear_w8a8_panels_vec8(a, b, e);
    int8_scalar(a, b, e);
  });
}

void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                 const at::Tensor& w_scale, c10::optional<at::Tensor> bias) {
  linear_w8a8(out, x, packed, colsum, w_scale, bias, -1);
}

}  // namespace pds
