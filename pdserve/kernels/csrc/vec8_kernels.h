// The 8-lane kernels (AVX2 on x86-64, NEON on aarch64): what the torch-facing files call on a
// range of their work after use_vec8() (isa.h), and the argument structs both sides share.
// No torch headers.
#pragma once

#include <cstdint>

#include "kv_quant.h"

namespace pds {

// ---- elementwise.cpp ----------------------------------------------------------------------------
// T: float or uint16_t (bf16). Rows begin .. end.
template <typename T>
void rms_rows_vec8(T* x, int64_t x_stride, T* res, int64_t res_stride, T* out, int64_t out_stride, const T* w,
                   int64_t H, float eps, int64_t begin, int64_t end);
template <typename T>
void rope_rows_vec8(T* x, int64_t s_tok, int64_t s_head, int64_t heads, int64_t D, const float* cos,
                    const float* sin, int64_t begin, int64_t end);
template <typename T>
void silu_rows_vec8(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t I, int64_t begin,
                    int64_t end);

// ---- gemm_f32.cpp -------------------------------------------------------------------------------
struct F32Args {
  const float* w;  // [NP, K, 64]
  const float* bias;  // [N] or null
  const float* x;  // [M, K], row stride x_stride
  float* out;  // [M, N], row stride out_stride
  int64_t M, N, K, x_stride, out_stride;
};
void linear_f32_panels_vec8(const F32Args& a, int64_t np0, int64_t np1);

// ---- gemv.cpp -----------------------------------------------------------------------------------
struct GemvArgs {
  const uint16_t* w;  // packed, [NP, KP, 4, 16, 2]
  const void* bias;  // [N] or null, dtype of out
  void* out;  // [M, N] row stride out_stride
  int64_t M, N, K, KP, NP, out_stride;
  bool out_bf16;
  int64_t x_stride;  // x's row stride in bf16 elements (even: rows of whole pairs)
};
// xb: x as bf16 rows of 2 KP (zero padded), row stride a.x_stride
void linear_vnni_panels_vec8(const GemvArgs& a, const uint16_t* xb, int64_t np0, int64_t np1);

// ---- int8_gemm.cpp ------------------------------------------------------------------------------
struct Int8Args {
  const int8_t* w;  // [NP, KQ, 4, 16, 4]
  const int32_t* colsum;  // [NP * 64]
  const float* w_scale;  // [NP * 64]
  const uint8_t* xq;  // [M, 4 KQ], x quantized + 128
  const float* x_scale;  // [M]
  const void* bias;  // [N] in out's dtype, or null
  void* out;
  int64_t M, N, KQ, NP, out_stride;
  bool out_bf16;
};
void linear_w8a8_panels_vec8(const Int8Args& a, int64_t np0, int64_t np1);
// per row: scale = max|x| / 127, xq = round(x / scale) + 128, zero (as 128) padded to K4
template <typename T>
void quantize_rows_vec8(const T* x, int64_t stride, int64_t M, int64_t K, int64_t K4, uint8_t* xq, float* scale);

// ---- paged_attention.cpp ------------------------------------------------------------------------
struct DecodeArgs {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int32_t* table;
  const int32_t* lens;
  int64_t q_stride_b, q_stride_h, out_stride_b, out_stride_h;
  int64_t table_stride;
  int64_t heads, kv_heads, page_size, head_dim, window;
  float scale;
  bool q_bf16;
  const float* sinks;  // [heads] or nullptr
  KVScales sc = {};  // a quantized cache's scales (kv_quant.h)
};
// tasks (request, KV head) begin .. end; KT: the cache's element type (float, uint16_t: bf16, or
// a quantized element of kv_quant.h)
template <typename KT>
void decode_attention_vec8(const DecodeArgs& a, int64_t task_begin, int64_t task_end);

// ---- flash_attention.cpp ------------------------------------------------------------------------
struct FlashArgs {
  const uint16_t* q;
  uint16_t* out;
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* table;
  const int32_t* lens;  // tokens in the request after this forward
  const int32_t* q_starts;  // [B + 1]: rows of request b are q_starts[b] .. q_starts[b + 1]
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride;
  int64_t heads, kv_heads, page_size, D, window;
  float scale;
  const float* sinks;  // [heads] or nullptr
  // a quantized cache (kv_quant.h): k, v above unused; its bytes, their type and scales
  KVKind kind = KVKind::kPlain;
  const void* kq = nullptr;
  const void* vq = nullptr;
  KVScales sc = {};
};
struct FlashScratchVec8;  // one per thread: flash_scratch_vec8() / flash_scratch_free_vec8()
FlashScratchVec8* flash_scratch_vec8();
void flash_scratch_free_vec8(FlashScratchVec8* s);
// request b, KV head h, query positions q0 .. q0 + nq
void flash_task_vec8(const FlashArgs& a, int64_t b, int64_t h, int64_t q0, int64_t nq, FlashScratchVec8& s);

// ---- moe.cpp ------------------------------------------------------------------------------------
enum class MoeAct : int { kSilu, kSwigluOai };
constexpr int kMoeTileRows = 6;
// One register tile of the fused MoE kernel: up to kMoeTileRows input rows against a whole panel
// of 64 outputs; float results [rows][64] (int8: dequantized).
struct MoeTile {
  const uint32_t* xr[kMoeTileRows];
  float xs[kMoeTileRows];
  int rows;
  const uint8_t* panel;
  int64_t KS;
  bool prefetch;
  const int32_t* colsum;  // this panel's 64
  const float* w_scale;
  float* res;
};
void moe_tile_bf16_vec8(const MoeTile& t);
void moe_tile_int8_vec8(const MoeTile& t);
// first matmul: 32 gate and 32 up results (+ bias) -> 32 values of a
void moe_finish_act_vec8(const float* res, const float* bias, uint16_t* a, MoeAct act, float alpha, float limit);
void moe_finish_out_vec8(const float* res, const float* bias, uint16_t* y, int64_t n);
void moe_combine_vec8(float* out, const uint16_t* y, const int32_t* ids, const float* w, int64_t K, int64_t H);
void moe_quantize_row_vec8(const uint16_t* x, int64_t K, int64_t K4, uint8_t* q, float* scale);

}  // namespace pds
