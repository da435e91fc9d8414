// The torch-facing side of quantized KV caches (kv_quant.h) shared by the attention kernels: the
// checks of their scale arguments, and the AVX-512 dequantization of a flash kernel's key block.
#include "common.h"
#include "kv_quant.h"
#include "vec8_kernels.h"

namespace pds {

// The scales of a quantized cache after checking them: int8 needs per-row scales (float32, the
// cache's shape without head_dim), fp8 takes one scale per K and V; a float cache none. Shared
// with flash_attention.cpp.
KVScales checked_scales(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scales,
                        const c10::optional<at::Tensor>& v_scales, double k_scale, double v_scale, const char* kernel) {
  KVScales sc;
  sc.k = float(k_scale);
  sc.v = float(v_scale);
  const bool per_row = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(per_row == (k_scales.has_value() && v_scales.has_value()) && k_scales.has_value() == v_scales.has_value(),
              kernel, ": k_scales and v_scales go with an int8 cache, and only with one");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 || per_row || (k_scale == 1.0 && v_scale == 1.0),
              kernel, ": k_scale and v_scale go with an fp8 cache");
  if (!per_row) return sc;
  for (const at::Tensor* t : {&*k_scales, &*v_scales}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->sizes() == k_cache.sizes().slice(0, 3),
                kernel, ": k_scales / v_scales must be contiguous float32 [pages, kv_heads, page_size]");
  }
  sc.k_rows = k_scales->data_ptr<float>();
  sc.v_rows = v_scales->data_ptr<float>();
  return sc;
}

#if PDS_X86
namespace {

// rows[0 .. n) of a quantized cache `src` (element KT), times their scales, as bf16 rows of dst
template <typename KT>
PDS_AVX512 void dequantize_block(const void* src, const float* row_scales, float scale, const int64_t* rows, int n,
                                 int64_t D, uint16_t* dst) {
  const KT* base = static_cast<const KT*>(src);
  for (int t = 0; t < n; ++t) {
    const __m512 s = _mm512_set1_ps(row_scales ? row_scales[rows[t]] : scale);
    for (int64_t c = 0; c < D; c += 16) {
      const __mmask16 mk = tail_mask(D - c);
      store16(dst + t * D + c, _mm512_mul_ps(load16(base + rows[t] * D + c, mk), s), mk);
    }
  }
}

PDS_AVX512 void dequantize_kv_bf16_impl(const FlashArgs& a, const int64_t* rows, int n, int64_t D, uint16_t* kd, uint16_t* vd) {
  switch (a.kind) {
    case KVKind::kPlain:
      return;
    case KVKind::kInt8:
      dequantize_block<int8_t>(a.kq, a.sc.k_rows, a.sc.k, rows, n, D, kd);
      return dequantize_block<int8_t>(a.vq, a.sc.v_rows, a.sc.v, rows, n, D, vd);
    case KVKind::kFp8E4M3:
      dequantize_block<Fp8E4M3>(a.kq, a.sc.k_rows, a.sc.k, rows, n, D, kd);
      return dequantize_block<Fp8E4M3>(a.vq, a.sc.v_rows, a.sc.v, rows, n, D, vd);
    case KVKind::kFp8E5M2:
      dequantize_block<Fp8E5M2>(a.kq, a.sc.k_rows, a.sc.k, rows, n, D, kd);
      return dequantize_block<Fp8E5M2>(a.vq, a.sc.v_rows, a.sc.v, rows, n, D, vd);
  }
}

}  // namespace

// flash_attention.cpp's block staging: rows[0 .. n) of a's quantized K and V as bf16 rows
void dequantize_kv_bf16(const FlashArgs& a, const int64_t* rows, int n, int64_t D, uint16_t* kd, uint16_t* vd) {
  dequantize_kv_bf16_impl(a, rows, n, D, kd, vd);
}
#endif

}  // namespace pds
