// y = x w^T (+ bias) for FP8 e4m3 block-scaled weights (DeepSeek-V3 / Qwen3-FP8 checkpoints: one
// scale per bn x bk block), x and out float32 or bf16: the weight's bytes are read in place (packed
// once into panels, fp8_linear.h) and widened to float32 in registers, never into a resident
// dequantized copy.
//
// A panel (64 outputs) is taken one k block at a time; the block's partial sums are scaled into a
// row block's sums (kFp8RowBlock rows x 64 in a stack buffer) at its end. One row (decode at batch
// 1): the lines are widened in registers as they stream in, the panel read once. More rows: the
// block is widened once into a float32 buffer (bk x 64: 32 KiB at 128, in L1) and tiles of up to 6
// rows x 64 outputs run on it; the panel stays in L2 for the row blocks after. Every output's sums are those of fp8_linear.h whatever the tier or the tiling:
// AVX-512 here, the 8-lane kernels (fp8_vec8.cpp) and the portable loop give the same bits.
// 4-bit panels (linear_mxfp4, linear_int4) run the same code, their codes looked up as values
// (fp8_linear.h).
#include "amx.h"
#include "common.h"
#include "fp8_linear.h"
#include "kv_quant.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <memory>
#include <vector>

namespace pds {
namespace {

// every e4m3 byte's value at 2^-8 (what the vector widening gives), for the portable loops
const float* e4m3_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = fp8_e4m3_to_f32(uint8_t(b)) * (1.f / 256.f);
    return t;
  }();
  return table.data();
}

// a packed line (FP8 or 4-bit codes) -> its 64 weights at 2^-8 of their values, in output order
inline void widen_line_scalar(const uint8_t* line, int codes, float* w) {
  if (codes != kCodesFp8) {
    const float* values = code_values(codes);
    for (int o = 0; o < kFp8Panel; ++o) w[o] = values[fp4_code(line, o)];
    return;
  }
  const float* table = e4m3_table();
  for (int p = 0; p < kFp8Panel; ++p) w[fp8_out_of(p)] = table[line[p]];
}

void panel_scalar(const Fp8Args& a, int64_t np) {
  const int64_t lb = line_bytes(a.codes);
  float acc[kFp8RowBlock * kFp8Panel];
  float w[kFp8Panel], sbuf[kFp8Panel];
  const int64_t n0 = np * kFp8Panel, nn = std::min<int64_t>(kFp8Panel, a.N - n0);
  for (int64_t m0 = 0; m0 < a.M; m0 += kFp8RowBlock) {
    const int64_t rows = std::min(kFp8RowBlock, a.M - m0);
    std::fill(acc, acc + rows * kFp8Panel, 0.f);
    for (int64_t kb = 0; kb < a.KB; ++kb) {
      const int64_t k0 = kb * a.bk, k1 = std::min(a.K, k0 + a.bk);
      const float* s = block_scales(a, np, kb, sbuf);
      for (int64_t r = 0; r < rows; ++r) {
        float part[kFp8Panel] = {0};
        for (int64_t k = k0; k < k1; ++k) {
          const uint8_t* line = a.w + (np * a.K + k) * lb;
          widen_line_scalar(line, a.codes, w);
          const int64_t m = m0 + r;
          const float x = a.x[m * a.x_stride + k];
          for (int o = 0; o < kFp8Panel; ++o) part[o] = std::fma(x, w[o], part[o]);
        }
        for (int o = 0; o < kFp8Panel; ++o) acc[r * kFp8Panel + o] = std::fma(part[o], s[o], acc[r * kFp8Panel + o]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < nn; ++o) {
        const int64_t n = n0 + o;
        float v = acc[r * kFp8Panel + o];
        if (a.out_bf16) {
          v += a.bias ? bf16_to_f32(static_cast<const uint16_t*>(a.bias)[n]) : 0.f;
          static_cast<uint16_t*>(a.out)[(m0 + r) * a.out_stride + n] = f32_to_bf16(v);
        } else {
          v += a.bias ? static_cast<const float*>(a.bias)[n] : 0.f;
          static_cast<float*>(a.out)[(m0 + r) * a.out_stride + n] = v;
        }
      }
  }
}

#if PDS_X86

// Up to kStreamRows rows: k block kb of panel np widened in registers as it streams in, each
// line's 64 weights used by every row before the next line; more rows run in groups of up to
// kStreamRows, the block then read again from L1. Measured on Zen 4 (int4 and FP8, 1536 x 2048):
// as fast as widening each block once into a buffer for register tiles from 64 to 256 rows, and
// faster below (2 rows 0.49x the buffered tiles' time, 8 rows 0.74x), where widening a line costs
// more than one row's multiply-adds.
constexpr int kStreamRows = 6;

template <int C, int R>
PDS_AVX512 void row_block(const Fp8Args& a, int64_t np, int64_t kb, int64_t m0, float* acc) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  const int64_t k0 = kb * a.bk, k1 = std::min(a.K, k0 + a.bk);
  const uint8_t* block = a.w + (np * a.K + k0) * lb;
  const float* x = a.x + m0 * a.x_stride;
  __m512 part[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 w[4];
    // the panel is one sequential stream: fetched into L2 ahead of its use, as the bf16 GEMV does
    _mm_prefetch(reinterpret_cast<const char*>(block + (k - k0) * lb) + kFp8PrefetchBytes, _MM_HINT_T1);
    widen_line<C>(block + (k - k0) * lb, w);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * a.x_stride + k]);
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_fmadd_ps(xv, w[j], part[r][j]);
    }
  }
  alignas(64) float sbuf[kFp8Panel];
  const float* s = block_scales(a, np, kb, sbuf);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      float* row = acc + r * kFp8Panel + 16 * j;
      _mm512_storeu_ps(row, _mm512_fmadd_ps(part[r][j], _mm512_loadu_ps(s + 16 * j), _mm512_loadu_ps(row)));
    }
}

template <int C>
PDS_AVX512 void stream_rows(const Fp8Args& a, int64_t np, int64_t kb, int64_t m0, int64_t rows, float* acc) {
  static_assert(kStreamRows == 6, "stream_rows instantiates 1..6 rows");
  switch (rows) {
    case 1: return row_block<C, 1>(a, np, kb, m0, acc);
    case 2: return row_block<C, 2>(a, np, kb, m0, acc);
    case 3: return row_block<C, 3>(a, np, kb, m0, acc);
    case 4: return row_block<C, 4>(a, np, kb, m0, acc);
    case 5: return row_block<C, 5>(a, np, kb, m0, acc);
    default: return row_block<C, 6>(a, np, kb, m0, acc);
  }
}

template <typename T>
PDS_AVX512 void store_rows(const Fp8Args& a, int64_t np, int64_t m0, int64_t rows, const float* acc) {
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j) {
      const int64_t n = np * kFp8Panel + 16 * j;
      if (n >= a.N) break;
      const __mmask16 mk = tail_mask(a.N - n);
      const __m512 b = bias ? load16(bias + n, mk) : _mm512_setzero_ps();
      store16(static_cast<T*>(a.out) + (m0 + r) * a.out_stride + n,
              _mm512_add_ps(_mm512_loadu_ps(acc + r * kFp8Panel + 16 * j), b), mk);
    }
}

template <int C>
PDS_AVX512 void panels_avx512(const Fp8Args& a, int64_t np0, int64_t np1) {
  alignas(64) float acc[kFp8RowBlock * kFp8Panel];
  for (int64_t np = np0; np < np1; ++np)
    for (int64_t m0 = 0; m0 < a.M; m0 += kFp8RowBlock) {
      const int64_t rows = std::min(kFp8RowBlock, a.M - m0);
      std::fill(acc, acc + rows * kFp8Panel, 0.f);
      for (int64_t kb = 0; kb < a.KB; ++kb) {
        // groups of rows as even as can be: 8 rows are 4 + 4, not 6 + 2
        const int64_t groups = (rows + kStreamRows - 1) / kStreamRows;
        for (int64_t g = 0, r = 0; g < groups; ++g) {
          const int64_t gr = rows / groups + (g < rows % groups);
          stream_rows<C>(a, np, kb, m0 + r, gr, acc + r * kFp8Panel);
          r += gr;
        }
      }
      if (a.out_bf16)
        store_rows<uint16_t>(a, np, m0, rows, acc);
      else
        store_rows<float>(a, np, m0, rows, acc);
    }
}

// k-line by k-line: 64 weights widened, scaled, stored as float32 or bf16 (rounded to nearest even
// by the integer rule of f32x16_to_bf16, or by vcvtneps2bf16 where the tier has it: the same bits,
// no NaN here)
template <int C>
PDS_AVX512 void dequantize_avx512(const Fp8DequantArgs& a, int64_t np0, int64_t np1) {
  constexpr int64_t lb = C == kCodesFp8 ? kFp8Panel : kFp4Line;
  alignas(64) float sbuf[kFp8Panel];
  for (int64_t np = np0; np < np1; ++np) {
    const int64_t c0 = np * kFp8Panel;
    const float* s = block_scales(a, np, 0, sbuf);
    for (int64_t k = 0, kb = 0, next = a.bk; k < a.K; ++k) {
      if (k == next) ++kb, next += a.bk, s = block_scales(a, np, kb, sbuf);
      __m512 w[4];
      widen_line<C>(a.w + (np * a.K + k) * lb, w);
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + 16 * j;
        if (c >= a.cols) break;
        const __mmask16 mk = tail_mask(a.cols - c);
        const __m512 v = _mm512_mul_ps(w[j], _mm512_loadu_ps(s + 16 * j));
        if (a.out_bf16)
          store16(static_cast<uint16_t*>(a.out) + k * a.out_stride + c, v, mk);
        else
          store16(static_cast<float*>(a.out) + k * a.out_stride + c, v, mk);
      }
    }
  }
}

// FP8 only: vcvtneps2bf16 reads float32 subnormals as zero, and MXFP4 scales can make them
PDS_AVX512_BF16 void dequantize_avx512_bf16(const Fp8DequantArgs& a, int64_t np0, int64_t np1) {
  alignas(64) float sbuf[kFp8Panel];
  for (int64_t np = np0; np < np1; ++np) {
    const int64_t c0 = np * kFp8Panel;
    const float* s = block_scales(a, np, 0, sbuf);
    for (int64_t k = 0, kb = 0, next = a.bk; k < a.K; ++k) {
      if (k == next) ++kb, next += a.bk, s = block_scales(a, np, kb, sbuf);
      __m512 w[4];
      widen_line<kCodesFp8>(a.w + (np * a.K + k) * kFp8Panel, w);
      uint16_t* dst = static_cast<uint16_t*>(a.out) + k * a.out_stride + c0;
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + 16 * j;
        if (c >= a.cols) break;
        const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(w[j], _mm512_loadu_ps(s + 16 * j)));
        _mm256_mask_storeu_epi16(dst + 16 * j, tail_mask(a.cols - c), v);
      }
    }
  }
}

#endif

// linear_fp8 / linear_mxfp4 once their arguments are checked: `a` holds all but x
void run_linear(Fp8Args a, const at::Tensor& x, int64_t amx_min_rows) {
  const int64_t M = a.M, K = a.K;
  if (M == 0) return;
#if PDS_X86
  // bf16 x on AMX hosts: tiles (amx_fp8.cpp), from amx_min_rows rows as the bf16 matmuls
  if (x.scalar_type() == at::kBFloat16 && M >= amx_linear_min_rows(amx_min_rows)) {
    const TileBackend tb = amx_backend();
    if (tb != TileBackend::kNone) {
      const int64_t Mp = (M + 15) / 16 * 16, stride = (K + 31) / 32 * 32 + 32;
      std::vector<uint16_t> xa(Mp * stride, 0);  // A rows: x, zero padded
      for (int64_t m = 0; m < M; ++m) std::memcpy(xa.data() + m * stride, data<uint16_t>(x) + m * x.stride(0), K * 2);
      return amx_linear_fp8(Fp8AmxArgs{a, xa.data(), stride}, int(tb));
    }
  }
#endif
  // x in float32 (a bf16 x widened once: the tiles broadcast each x from memory)
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  a.x = data<float>(xf);
  a.x_stride = xf.stride(0);
  const int64_t NP = (a.N + kFp8Panel - 1) / kFp8Panel, bk = a.bk;
  const bool avx512 = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
    // one widened k block per thread, where the 8-lane tiers run tiles
    std::unique_ptr<float, void (*)(void*)> wbuf(
        M > kVec8StreamRows && !avx512 ? static_cast<float*>(std::aligned_alloc(64, ((bk * kFp8Panel * 4 + 63) / 64) * 64)) : nullptr,
        &std::free);
#if PDS_X86
    if (avx512) {
      if (a.codes == kCodesE2m1) return panels_avx512<kCodesE2m1>(a, b, e);
      if (a.codes == kCodesInt4) return panels_avx512<kCodesInt4>(a, b, e);
      return panels_avx512<kCodesFp8>(a, b, e);
    }
#endif
#if PDS_HAS_V8
    if (v8) return linear_fp8_panels_vec8(a, b, e, wbuf.get());
#endif
    for (int64_t np = b; np < e; ++np) panel_scalar(a, np);
  });
}

void run_dequantize(const Fp8DequantArgs& a, int64_t NP) {
  const bool avx512 = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (avx512 && a.out_bf16 && a.codes == kCodesFp8 && use_avx512_bf16()) return dequantize_avx512_bf16(a, b, e);
    if (avx512) {
      if (a.codes == kCodesE2m1) return dequantize_avx512<kCodesE2m1>(a, b, e);
      if (a.codes == kCodesInt4) return dequantize_avx512<kCodesInt4>(a, b, e);
      return dequantize_avx512<kCodesFp8>(a, b, e);
    }
#endif
#if PDS_HAS_V8
    if (v8) return fp8_dequantize_panels_vec8(a, b, e);
#endif
    const int64_t lb = line_bytes(a.codes);
    float sbuf[kFp8Panel], w[kFp8Panel];
    for (int64_t np = b; np < e; ++np) {
      const int64_t c0 = np * kFp8Panel, nc = std::min<int64_t>(kFp8Panel, a.cols - c0);
      for (int64_t k = 0, kb = 0, next = a.bk; k < a.K; ++k) {
        if (k == next) ++kb, next += a.bk;
        const uint8_t* line = a.w + (np * a.K + k) * lb;
        const float* s = block_scales(a, np, kb, sbuf);
        widen_line_scalar(line, a.codes, w);
        for (int o = 0; o < nc; ++o) {
          const float v = w[o] * s[o];
          if (a.out_bf16)
            static_cast<uint16_t*>(a.out)[k * a.out_stride + c0 + o] = f32_to_bf16(v);
          else
            static_cast<float*>(a.out)[k * a.out_stride + c0 + o] = v;
        }
      }
    }
  });
}

// The checks and the call every entry point shares: `codes` picks the panels' line (64 FP8 bytes
// or 32 bytes of 4-bit codes) and the scales (E8M0 bytes for MXFP4, float32 times 256 otherwise);
// MXFP4's blocks are 32 k.
void check_packed(const char* op, const at::Tensor& packed, int codes, int64_t K) {
  const int64_t lb = line_bytes(codes);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == lb && packed.is_contiguous(),
              op, ": weight must be packed as a contiguous [N/64, K, ", lb, "] uint8 tensor");
  if (codes == kCodesE2m1) TORCH_CHECK(K % kMxfp4Block == 0, op, ": K (", K, ") must be a multiple of 32");
}

int64_t check_scale(const char* op, const at::Tensor& scale, int codes, int64_t NP, int64_t K, int64_t block_k) {
  TORCH_CHECK(block_k > 0, op, ": block_k must be positive");
  const int64_t KB = (K + block_k - 1) / block_k;
  const auto dtype = codes == kCodesE2m1 ? at::kByte : at::kFloat;
  TORCH_CHECK(scale.scalar_type() == dtype && scale.is_contiguous() && scale.dim() == 3 && scale.size(0) == NP &&
                  scale.size(1) == KB && scale.size(2) == kFp8Panel,
              op, ": scale must be a contiguous [", NP, ", ", KB, ", 64] ", codes == kCodesE2m1 ? "uint8" : "float32",
              " tensor, got ", scale.sizes());
  return KB;
}

}  // namespace

// the checked entry point of linear_fp8 / linear_mxfp4 / linear_int4 (moe_panels.cpp calls it too)
void linear_panels(const char* op, int codes, at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                   const at::Tensor& scale, const c10::optional<at::Tensor>& bias, int64_t block_k,
                   int64_t amx_min_rows) {
  check_packed(op, packed, codes, x.size(-1));
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, op,
              ": x and out must be 2-D with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              op, ": x and out must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NP = packed.size(0);
  TORCH_CHECK(NP == (N + kFp8Panel - 1) / kFp8Panel && packed.size(1) == K && out.size(0) == M, op, ": shapes x ",
              x.sizes(), ", packed weight ", packed.sizes(), ", out ", out.sizes(), " do not agree");
  const int64_t KB = check_scale(op, scale, codes, NP, K, block_k);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == out.scalar_type(), op,
                ": bias must be contiguous [N] in out's dtype");
  const bool e8m0 = codes == kCodesE2m1;
  Fp8Args a{data<uint8_t>(packed), e8m0 ? nullptr : data<float>(scale), nullptr,
            bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(), M, N, K, KB, block_k, 0, out.stride(0),
            out.scalar_type() == at::kBFloat16};
  a.codes = codes;
  a.e8m0 = e8m0 ? data<uint8_t>(scale) : nullptr;
  run_linear(a, x, amx_min_rows);
}

namespace {

void dequantize_panels(const char* op, int codes, at::Tensor out, const at::Tensor& packed, const at::Tensor& scale,
                       int64_t block_k) {
  check_packed(op, packed, codes, packed.size(1));
  const int64_t NP = packed.size(0), K = packed.size(1), cols = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              op, ": out must be a 2-D float32 or bfloat16 tensor with contiguous rows");
  TORCH_CHECK(out.size(0) == K && cols <= NP * kFp8Panel && cols > (NP - 1) * kFp8Panel, op, ": out ", out.sizes(),
              " does not match the packed weight ", packed.sizes(), " (out is [K, N])");
  const int64_t KB = check_scale(op, scale, codes, NP, K, block_k);
  const bool e8m0 = codes == kCodesE2m1;
  Fp8DequantArgs a{data<uint8_t>(packed), e8m0 ? nullptr : data<float>(scale), out.data_ptr(), K, KB, block_k, cols,
                   out.stride(0), out.scalar_type() == at::kBFloat16};
  a.codes = codes;
  a.e8m0 = e8m0 ? data<uint8_t>(scale) : nullptr;
  run_dequantize(a, NP);
}

}  // namespace

// out: [M, N] float32 or bf16; x: [M, K] float32 or bf16 (rows contiguous); packed: [ceil(N/64), K,
// 64] uint8 (the layout of fp8_linear.h); scale: [ceil(N/64), ceil(K/block_k), 64] float32 (times
// 256); bias: [N] in out's dtype, optional. amx_min_rows: bf16 calls of at least this many rows take
// AMX where it is used (-1: the process default, see amx.h; the tiles' bits differ from the vector
// kernels', so one value for every call keeps a row's result independent of its batch).
void linear_fp8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                c10::optional<at::Tensor> bias, int64_t block_k, int64_t amx_min_rows) {
  linear_panels("linear_fp8", kCodesFp8, out, x, packed, scale, bias, block_k, amx_min_rows);
}

// MXFP4 weights (fp8_linear.h): packed [ceil(N/64), K, 32] uint8 codes, scale [ceil(N/64), K/32, 64]
// uint8 E8M0 (each <= 246); otherwise linear_fp8's arguments, with its kernels and their bits.
void linear_mxfp4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  c10::optional<at::Tensor> bias, int64_t amx_min_rows) {
  linear_panels("linear_mxfp4", kCodesE2m1, out, x, packed, scale, bias, kMxfp4Block, amx_min_rows);
}

// int4 weights (compressed-tensors' pack-quantized, symmetric: codes q + 8, fp8_linear.h): packed
// [ceil(N/64), K, 32] uint8 codes in output order, scale [ceil(N/64), ceil(K/block_k), 64] float32
// (times 256), one per output and group of block_k; otherwise linear_fp8's arguments and kernels.
void linear_int4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                 c10::optional<at::Tensor> bias, int64_t block_k, int64_t amx_min_rows) {
  linear_panels("linear_int4", kCodesInt4, out, x, packed, scale, bias, block_k, amx_min_rows);
}

// The weight of whole panels in out's dtype, transposed: out [K, cols] (cols <= 64 * packed.size(0),
// any row stride) gets out[k][n] = value(q[n][k]) * scale, rounded once to float32 (transformers'
// dequantization), then to bf16 if out is bf16: what a prefill multiplies with a bf16 GEMM (x out,
// a k-major weight needs no copy there) where that is faster than linear_fp8.
void fp8_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale, int64_t block_k) {
  dequantize_panels("fp8_dequantize", kCodesFp8, out, packed, scale, block_k);
}

// linear_mxfp4's weight as fp8_dequantize gives linear_fp8's (exact in float32: code * 2^(e - 127))
void mxfp4_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale) {
  dequantize_panels("mxfp4_dequantize", kCodesE2m1, out, packed, scale, kMxfp4Block);
}

// linear_int4's weight as fp8_dequantize gives linear_fp8's (q * scale, one rounding)
void int4_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale, int64_t block_k) {
  dequantize_panels("int4_dequantize", kCodesInt4, out, packed, scale, block_k);
}

}  // namespace pds
