// int4 weights with int8 activations (W4A8), opt-in (--int4-int8-activations): compressed-tensors'
// symmetric int4 codes c = q + 8 with a float scale per output and group of k, multiplied by each
// row of x quantized to int8 as w8a8_int8 does (s = max|x| / 127, xq = round(x / s)), in integer
// dot products.
//
// Why: at one row the 4-bit panels of fp8_linear.h look every code up as a float and run one
// float multiply-add per weight; on Zen 4 that path reads 25 G weights/s whether the weights come
// from memory or from L2 (bound by vector micro-operations, not by memory). Here 4 k of 16 outputs
// take one vpdpbusd (AVX-512 VNNI) after a mask or a shift of the packed nibbles.
//
// Arithmetic, the same on every tier (so tiers and batches give the same bits): per output and
// group g, isum = sum over the group's k of c * xq (exact in int32), corr = isum - 8 * sum(xq over
// the group) (the codes' offset, exact), acc = fma(float(corr), w_scale[o, g], acc) over the
// groups in order from zero; out = fma(acc, s, bias) rounded once to out's dtype. |corr| < 2^24
// for groups up to 1024, so float(corr) is exact.
//
// MXFP4 with int8 activations (opt-in, --mxfp4-int8-activations) runs the same sums on e2m1
// codes: twice an e2m1 value is an integer in -12 .. 12, so a 16-entry table (vpshufb / TBL) turns
// each code into u = 2 v + 12 (0 .. 24), the offset corrected as int4's 8 is (corr = isum - 12 *
// sum(xq)), and the scale is 2^(e - 127) / 2 per group of 32 (exact in float32).
//
// Layout (quantization/int4_matmul.py pack_w4a8): [ceil(N/64), ceil(K/4), 128] bytes. Quad kq of
// panel np holds k = 4 kq .. 4 kq + 3 of its 64 outputs: byte 4 l + i of the first 64 holds the
// code of output l (low nibble) and 32 + l (high), k = 4 kq + i; of the second 64, outputs
// 16 + l and 48 + l. A mask or a shift of one 64-byte half gives 16 lanes of 4 codes, the operand
// layout of vpdpbusd. Padding codes (outputs past N, k past K) multiply x's zero padding. Scales:
// [ceil(N/64), ceil(K/group), 64] float32 in output order.
#include "common.h"
#include "fp8_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if PDS_ARM
#include <arm_neon.h>
#endif

namespace pds {

void linear_panels(const char* op, int codes, at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                   const at::Tensor& scale, const c10::optional<at::Tensor>& bias, int64_t block_k,
                   int64_t amx_min_rows);
void quantize_activation_rows(const at::Tensor& x, int64_t K4, uint8_t* xq, float* scale);

namespace {

constexpr int64_t kPanel = 64, kQuad = 128;
// how far ahead the quads stream is prefetched into L2 (both lines of a quad)
constexpr int64_t kPrefetchBytes = 2048;

struct W4A8Args {
  const uint8_t* lut;  // 16 bytes: each code's unsigned value (MXFP4), or null (int4: the code)
  int32_t offset;  // what the unsigned values add to the signed ones: 8 (int4), 12 (MXFP4)
  const uint8_t* w;  // [NP, KQ, 128]
  const float* scale;  // [NP, KB, 64]
  const int8_t* xq;  // [M, K4], K4 = 4 KQ, zero padded
  const float* xs;  // [M] row scales
  const int32_t* sx;  // [M, KB] sums of xq per group
  const void* bias;  // [N] in out's dtype, or null
  void* out;  // [M, N], row stride out_stride
  int64_t M, N, KQ, KB, gq /* quads per group */, out_stride;
  bool out_bf16;
};

inline int code_of(const uint8_t* quad, int64_t o, int i, const uint8_t* lut) {
  const int half = (o >> 4) & 1, l = o & 15, hi = o >> 5;
  const int c = (quad[half * 64 + 4 * l + i] >> (4 * hi)) & 0xF;
  return lut ? lut[c] : c;
}

// MXFP4: twice each e2m1 code's value, plus 12
constexpr uint8_t kE2m1Unsigned[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// the rows' accumulators [rows][64] of panel np -> out (fma with the row scale, the bias)
void store_rows(const W4A8Args& a, int64_t np, int64_t m0, int64_t rows, const float* acc) {
  const int64_t n0 = np * kPanel, nn = std::min<int64_t>(kPanel, a.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    const float s = a.xs[m0 + r];
    for (int64_t o = 0; o < nn; ++o) {
      float b = 0.f;
      if (a.bias) b = a.out_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(a.bias)[n0 + o])
                                 : static_cast<const float*>(a.bias)[n0 + o];
      const float v = std::fma(acc[r * kPanel + o], s, b);
      if (a.out_bf16)
        static_cast<uint16_t*>(a.out)[(m0 + r) * a.out_stride + n0 + o] = f32_to_bf16(v);
      else
        static_cast<float*>(a.out)[(m0 + r) * a.out_stride + n0 + o] = v;
    }
  }
}

void panel_scalar(const W4A8Args& a, int64_t np, int64_t m, float* acc) {
  const uint8_t* base = a.w + np * a.KQ * kQuad;
  const int8_t* x = a.xq + m * a.KQ * 4;
  std::fill(acc, acc + kPanel, 0.f);
  for (int64_t g = 0; g < a.KB; ++g) {
    const int64_t q0 = g * a.gq, q1 = std::min(a.KQ, q0 + a.gq);
    const float* s = a.scale + (np * a.KB + g) * kPanel;
    const int32_t corr8 = a.offset * a.sx[m * a.KB + g];
    for (int64_t o = 0; o < kPanel; ++o) {
      int32_t isum = 0;
      for (int64_t q = q0; q < q1; ++q)
        for (int i = 0; i < 4; ++i) isum += code_of(base + q * kQuad, o, i, a.lut) * int32_t(x[4 * q + i]);
      acc[o] = std::fma(float(isum - corr8), s[o], acc[o]);
    }
  }
}

#if PDS_X86
// R rows of panel np from the packed quads: 4 R int32 accumulators of 16 lanes a group
template <int R, bool LUT>
PDS_AVX512_VNNI void panel_vnni(const W4A8Args& a, int64_t np, int64_t m0, float* acc) {
  const uint8_t* base = a.w + np * a.KQ * kQuad;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i lut = LUT ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.lut)))
                          : _mm512_setzero_si512();
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * kPanel + 16 * j, _mm512_setzero_ps());
  for (int64_t g = 0; g < a.KB; ++g) {
    const int64_t q0 = g * a.gq, q1 = std::min(a.KQ, q0 + a.gq);
    __m512i isum[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) isum[r][j] = _mm512_setzero_si512();
    for (int64_t q = q0; q < q1; ++q) {
      const uint8_t* p = base + q * kQuad;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64, _MM_HINT_T1);
      const __m512i A = _mm512_loadu_si512(p), B = _mm512_loadu_si512(p + 64);
      __m512i c[4] = {_mm512_and_si512(A, nib), _mm512_and_si512(B, nib),
                      _mm512_and_si512(_mm512_srli_epi16(A, 4), nib),
                      _mm512_and_si512(_mm512_srli_epi16(B, 4), nib)};
      if (LUT)
        for (int j = 0; j < 4; ++j) c[j] = _mm512_shuffle_epi8(lut, c[j]);
      for (int r = 0; r < R; ++r) {
        int32_t xw;
        std::memcpy(&xw, a.xq + (m0 + r) * a.KQ * 4 + 4 * q, 4);
        const __m512i xv = _mm512_set1_epi32(xw);
        for (int j = 0; j < 4; ++j) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], c[j], xv);
      }
    }
    const float* s = a.scale + (np * a.KB + g) * kPanel;
    for (int r = 0; r < R; ++r) {
      const __m512i corr8 = _mm512_set1_epi32(a.offset * a.sx[(m0 + r) * a.KB + g]);
      for (int j = 0; j < 4; ++j) {
        float* dst = acc + r * kPanel + 16 * j;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][j], corr8));
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(v, _mm512_loadu_ps(s + 16 * j), _mm512_loadu_ps(dst)));
      }
    }
  }
}

// one row, 8 lanes: vpmaddubsw + vpmaddwd (codes <= 15, |xq| <= 127: pairs never saturate), or
// AVX-VNNI's vpdpbusd; the same body under each target
PDS_AVX2 inline __m256i dot4_avx2(__m256i acc, __m256i c, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), _mm256_set1_epi16(1)));
}
PDS_AVX2_VNNI inline __m256i dot4_avx_vnni(__m256i acc, __m256i c, __m256i x) {
  return _mm256_dpbusd_avx_epi32(acc, c, x);
}

#define PDS_W4A8_PANEL8(NAME, TARGET, DOT)                                                                 \
  template <bool LUT>                                                                                      \
  TARGET void NAME(const W4A8Args& a, int64_t np, int64_t m, float* acc) {                                 \
    const uint8_t* base = a.w + np * a.KQ * kQuad;                                                         \
    const __m256i nib = _mm256_set1_epi8(0x0F);                                                            \
    const __m256i lut = LUT ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.lut))) \
                            : _mm256_setzero_si256();                                                      \
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + 8 * j, _mm256_setzero_ps());                        \
    for (int64_t g = 0; g < a.KB; ++g) {                                                                   \
      const int64_t q0 = g * a.gq, q1 = std::min(a.KQ, q0 + a.gq);                                         \
      __m256i isum[8]; /* outputs 8 j .. 8 j + 7 */                                                        \
      for (int j = 0; j < 8; ++j) isum[j] = _mm256_setzero_si256();                                        \
      for (int64_t q = q0; q < q1; ++q) {                                                                  \
        const uint8_t* p = base + q * kQuad;                                                               \
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1);                      \
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64, _MM_HINT_T1);                 \
        int32_t xw;                                                                                        \
        std::memcpy(&xw, a.xq + m * a.KQ * 4 + 4 * q, 4);                                                  \
        const __m256i xv = _mm256_set1_epi32(xw);                                                          \
        /* 32 bytes h: outputs 8 h .. 8 h + 7 (low nibbles) and 32 + 8 h .. (high) */ \
        for (int h = 0; h < 4; ++h) {                                                                      \
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));              \
          __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);      \
          if (LUT) {                                                                                       \
            lo = _mm256_shuffle_epi8(lut, lo);                                                             \
            hi = _mm256_shuffle_epi8(lut, hi);                                                             \
          }                                                                                                \
          isum[h] = DOT(isum[h], lo, xv);                                                                  \
          isum[h + 4] = DOT(isum[h + 4], hi, xv);                                                          \
        }                                                                                                  \
      }                                                                                                    \
      const float* s = a.scale + (np * a.KB + g) * kPanel;                                                 \
      const __m256i corr8 = _mm256_set1_epi32(a.offset * a.sx[m * a.KB + g]);                              \
      for (int j = 0; j < 8; ++j) {                                                                        \
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[j], corr8));                             \
        _mm256_storeu_ps(acc + 8 * j,                                                                      \
                         _mm256_fmadd_ps(v, _mm256_loadu_ps(s + 8 * j), _mm256_loadu_ps(acc + 8 * j)));    \
      }                                                                                                    \
    }                                                                                                      \
  }

PDS_W4A8_PANEL8(panel_avx2, PDS_AVX2, dot4_avx2)
PDS_W4A8_PANEL8(panel_avx_vnni, PDS_AVX2_VNNI, dot4_avx_vnni)
#undef PDS_W4A8_PANEL8
#endif

#if PDS_ARM
// one row, 4 lanes a register: SDOT (dotprod), or widening multiplies and pairwise adds (Advanced
// SIMD; a code times an int8 fits int16 and so does the sum of a pair); the same body under each
// target, the same exact integer sums as the other tiers
inline int32x4_t dot4_neon(int32x4_t acc, int8x16_t c, int8x16_t x) {
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(c), vget_low_s8(x)));
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(c, x));
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
}
PDS_NEON_DOT inline int32x4_t dot4_sdot(int32x4_t acc, int8x16_t c, int8x16_t x) { return vdotq_s32(acc, c, x); }

#define PDS_W4A8_PANEL_NEON(NAME, TARGET, DOT)                                                    \
  template <bool LUT>                                                                             \
  TARGET void NAME(const W4A8Args& a, int64_t np, int64_t m, float* acc) {                        \
    const uint8_t* base = a.w + np * a.KQ * kQuad;                                                \
    const uint8x16_t nib = vdupq_n_u8(0x0F);                                                      \
    const uint8x16_t lut = LUT ? vld1q_u8(a.lut) : vdupq_n_u8(0);                                 \
    for (int j = 0; j < 16; ++j) vst1q_f32(acc + 4 * j, vdupq_n_f32(0.f));                        \
    for (int64_t g = 0; g < a.KB; ++g) {                                                          \
      const int64_t q0 = g * a.gq, q1 = std::min(a.KQ, q0 + a.gq);                                \
      int32x4_t isum[16]; /* outputs 4 j .. 4 j + 3 */                                            \
      for (int j = 0; j < 16; ++j) isum[j] = vdupq_n_s32(0);                                      \
      for (int64_t q = q0; q < q1; ++q) {                                                         \
        const uint8_t* p = base + q * kQuad;                                                      \
        int32_t xw;                                                                               \
        std::memcpy(&xw, a.xq + m * a.KQ * 4 + 4 * q, 4);                                         \
        const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(xw));                               \
        /* 16 bytes c: outputs 4 c .. 4 c + 3 (low nibbles) and 32 + 4 c .. (high) */            \
        for (int c = 0; c < 8; ++c) {                                                             \
          const uint8x16_t v = vld1q_u8(p + 16 * c);                                              \
          uint8x16_t lo = vandq_u8(v, nib), hi = vshrq_n_u8(v, 4);                                \
          if (LUT) {                                                                              \
            lo = vqtbl1q_u8(lut, lo);                                                             \
            hi = vqtbl1q_u8(lut, hi);                                                             \
          }                                                                                       \
          isum[c] = DOT(isum[c], vreinterpretq_s8_u8(lo), xv);                                    \
          isum[c + 8] = DOT(isum[c + 8], vreinterpretq_s8_u8(hi), xv);                            \
        }                                                                                         \
      }                                                                                           \
      const float* s = a.scale + (np * a.KB + g) * kPanel;                                        \
      const int32x4_t corr8 = vdupq_n_s32(a.offset * a.sx[m * a.KB + g]);                         \
      for (int j = 0; j < 16; ++j) {                                                              \
        const float32x4_t v = vcvtq_f32_s32(vsubq_s32(isum[j], corr8));                           \
        vst1q_f32(acc + 4 * j, vfmaq_f32(vld1q_f32(acc + 4 * j), v, vld1q_f32(s + 4 * j)));       \
      }                                                                                           \
    }                                                                                             \
  }

PDS_W4A8_PANEL_NEON(panel_neon, , dot4_neon)
PDS_W4A8_PANEL_NEON(panel_neon_dot, PDS_NEON_DOT, dot4_sdot)
#undef PDS_W4A8_PANEL_NEON
#endif

}  // namespace

namespace {

template <bool LUT>
void run_panels(const W4A8Args& a, int64_t NP) {
  const bool vnni512 = use_avx512_vnni(), avx_vnni = use_avx_vnni(), avx2 = use_avx2();
  const int64_t M = a.M;
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
    alignas(64) float acc[4 * kPanel];
    for (int64_t np = b; np < e; ++np)
      for (int64_t m0 = 0; m0 < M;) {
#if PDS_X86
        if (vnni512) {
          const int64_t rows = std::min<int64_t>(4, M - m0);
          switch (rows) {
            case 1: panel_vnni<1, LUT>(a, np, m0, acc); break;
            case 2: panel_vnni<2, LUT>(a, np, m0, acc); break;
            case 3: panel_vnni<3, LUT>(a, np, m0, acc); break;
            default: panel_vnni<4, LUT>(a, np, m0, acc); break;
          }
          store_rows(a, np, m0, rows, acc);
          m0 += rows;
          continue;
        }
        if (avx2) {
          if (avx_vnni)
            panel_avx_vnni<LUT>(a, np, m0, acc);
          else
            panel_avx2<LUT>(a, np, m0, acc);
          store_rows(a, np, m0, 1, acc);
          ++m0;
          continue;
        }
#endif
#if PDS_ARM
        if (use_neon()) {
          if (use_dotprod())
            panel_neon_dot<LUT>(a, np, m0, acc);
          else
            panel_neon<LUT>(a, np, m0, acc);
          store_rows(a, np, m0, 1, acc);
          ++m0;
          continue;
        }
#endif
        panel_scalar(a, np, m0, acc);
        store_rows(a, np, m0, 1, acc);
        ++m0;
      }
  });
}

// the checks, x's quantization and the panels of either code set
void w4a8(const char* op, const uint8_t* lut, int32_t offset, at::Tensor& out, const at::Tensor& x,
          const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias, int64_t group) {
  TORCH_CHECK(group > 0 && group % 4 == 0, op, ": group (", group, ") must be a positive multiple of 4");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, op,
              ": x and out must be 2-D with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              op, ": x and out must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NP = (N + kPanel - 1) / kPanel;
  const int64_t KQ = (K + 3) / 4, KB = (K + group - 1) / group;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == NP && packed.size(1) == KQ && packed.size(2) == kQuad && out.size(0) == M,
              op, ": packed must be a contiguous [", NP, ", ", KQ, ", 128] uint8 tensor for x ", x.sizes(), " and out ",
              out.sizes(), ", got ", packed.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3 && scale.size(0) == NP &&
                  scale.size(1) == KB && scale.size(2) == kPanel,
              op, ": scale must be a contiguous [", NP, ", ", KB, ", 64] float32 tensor, got ", scale.sizes());
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == out.scalar_type(), op,
                ": bias must be contiguous [N] in out's dtype");
  if (M == 0) return;
  // x per row to int8 (w8a8_int8's rule and quantizers, stored + 128: flipping the top bit gives
  // the int8), zero padded to whole quads, and its sums per group
  std::vector<uint8_t> xu(M * KQ * 4);
  std::vector<float> xs(M);
  std::vector<int32_t> sx(M * KB, 0);
  quantize_activation_rows(x, KQ * 4, xu.data(), xs.data());
  int8_t* xq = reinterpret_cast<int8_t*>(xu.data());
  for (int64_t i = 0; i < M * KQ * 4; ++i) xu[i] ^= 0x80;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < KB; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) sum += xq[m * KQ * 4 + k];
      sx[m * KB + g] = sum;
    }
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  const W4A8Args a{lut, offset, data<uint8_t>(packed), data<float>(scale), xq, xs.data(), sx.data(),
                   bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(), M, N, KQ, KB, group / 4,
                   out.stride(0), out_bf16};
  if (lut)
    run_panels<true>(a, NP);
  else
    run_panels<false>(a, NP);
}

}  // namespace

// out [M, N] float32 or bf16 = x W^T (+ bias) for int4 codes packed as above, x [M, K] float32 or
// bf16 (rows contiguous) quantized per row to int8 here; scale [NP, ceil(K/group), 64] float32.
void linear_int4_w4a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      c10::optional<at::Tensor> bias, int64_t group) {
  w4a8("linear_int4_w4a8", nullptr, 8, out, x, packed, scale, bias, group);
}

// The same for MXFP4 codes in the same quads (their e2m1 values times 2 by kE2m1Unsigned), scale
// [NP, K/32, 64] float32 (2^(e - 127) / 2): MXFP4 with int8 activations.
void linear_mxfp4_w4a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       c10::optional<at::Tensor> bias) {
  w4a8("linear_mxfp4_w4a8", kE2m1Unsigned, 12, out, x, packed, scale, bias, 32);
}

// A weight of the panel formats by its codes (fp8_linear.h's, kCodesW4A8 or kCodesMxfp4A8): the one dispatch the
// experts' call and the decode stack share
void linear_codes(int codes, at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, int64_t block_k, int64_t amx_min_rows) {
  if (codes == kCodesW4A8) return linear_int4_w4a8(out, x, packed, scale, bias, block_k);
  if (codes == kCodesMxfp4A8) return linear_mxfp4_w4a8(out, x, packed, scale, bias);
  linear_panels("linear_codes", codes, out, x, packed, scale, bias, block_k, amx_min_rows);
}

}  // namespace pds
