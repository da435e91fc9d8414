// The linear-attention kernels' per-ISA parts and the argument structs they share:
// linear_attention.cpp (decode) and linear_attention_scan.cpp (prefill), the torch-facing entry
// points with their checks and portable code, call linear_attention_avx512.cpp (x86-64 only) or
// linear_attention_vec8.cpp (AVX2, NEON) on a range of their tasks after the ISA checks of isa.h.
// No torch headers.
#pragma once

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace pds {

// the sizes the kernels' stack buffers hold (linear_attention.cpp refuses larger ones)
constexpr int64_t kConvMaxTaps = 8;  // K
constexpr int64_t kMamba2MaxState = 512;  // N
constexpr int64_t kDeltaMaxKeyDim = 256;  // dk

// Mamba2's dt of one token and head: round(softplus(round(dt + dt_bias))) in T (dt_bias already
// rounded to T), with torch's softplus threshold of 20, as Mamba2Mixer._step / _extend compute it.
template <typename T>
inline float mamba2_dt(float dt, float dt_bias) {
  const float v = round_to<T>(dt + dt_bias);
  return round_to<T>(v > 20.f ? v : std::log1p(std::exp(v)));
}

// The decode step of the linear-attention mixers (one new token per request, its state updated in
// place in the request's slot of the pool). First the causal convolution of every channel:
struct ConvStepArgs {
  const void* x;  // [B, C] the new inputs (T), row stride x_stride
  void* state;  // [num_slots, C, K - 1] (T): each channel's previous K - 1 inputs, oldest first
  const int64_t* slots;  // [B]
  const void* weight;  // [C, K] (T)
  const void* bias;  // [C] (T) or null
  float* out;  // [B, C]: SiLU of the taps' sum, each rounded to T (the sum itself without `silu`)
  int64_t C, K, x_stride;
  bool silu = true;  // false: LFM2's short convolution, no activation
};
// channels c0 .. c1 of request b
template <typename T>
void conv_step_vec8(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1);
template <typename T>
void conv_step_avx512(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1);

// then the state of each (request, head) of a Mamba2 layer, task b * H + h
struct Mamba2StepArgs {
  const float* xbc;  // [B, C]: the convolution's output, x [H, P] then B and C [G, N] each
  const float* dt;  // [B, H]: softplus(dt + dt_bias), rounded to T
  const float* decay;  // [B, H]: exp(dt A)
  const float* d;  // [H]: D, rounded to T
  float* state;  // [num_slots, H, P, N]
  const int64_t* slots;  // [B]
  void* out;  // [B, H, P] (T)
  int64_t H, P, N, G, C;
};
template <typename T>
void mamba2_heads_vec8(const Mamba2StepArgs& a, int64_t task0, int64_t task1);
template <typename T>
void mamba2_heads_avx512(const Mamba2StepArgs& a, int64_t task0, int64_t task1);

// or of a Gated DeltaNet layer, task b * Hv + h; the decay is one per value head (Gated DeltaNet)
// or one per key channel (Kimi Delta Attention): row r of S decays by decay[.., r * decay_step]
struct DeltaStepArgs {
  const float* qkv;  // [B, C]: the convolution's output, q [G, dk], k [G, dk], v [Hv, dv]
  const float* decay;  // [B, Hv, decay_rows]: exp(g)
  const float* beta;  // [B, Hv]
  float* state;  // [num_slots, Hv, dk, dv]
  const int64_t* slots;  // [B]
  void* out;  // [B, Hv, dv] (T)
  int64_t G, Hv, dk, dv, C;
  float scale;  // dk^-0.5, on q after its L2 norm
  int64_t decay_rows;  // 1 or dk
  int64_t decay_step() const { return decay_rows == 1 ? 0 : 1; }
};
template <typename T>
void delta_heads_vec8(const DeltaStepArgs& a, int64_t task0, int64_t task1);
template <typename T>
void delta_heads_avx512(const DeltaStepArgs& a, int64_t task0, int64_t task1);

// The prefill scan (linear_attention_scan.cpp): the new tokens of one request in order, from the
// state in its slot, which it updates in place. First the causal convolution of every channel over
// the tokens (rounding as the decode step's), tasks of channels c0 .. c1:
struct ConvScanArgs {
  const void* x;  // [n, C] the new inputs (T), row stride x_stride
  void* state;  // [C, K - 1] (T): the request's window, oldest first; left holding the last K - 1
  const void* weight;  // [C, K] (T)
  const void* bias;  // [C] (T) or null
  float* out;  // [n, C]: SiLU of the taps' sum, each rounded to T (the sum itself without `silu`)
  int64_t n, C, K, x_stride;
  bool silu = true;  // false: LFM2's short convolution, no activation
};
template <typename T>
void conv_scan_vec8(const ConvScanArgs& a, int64_t c0, int64_t c1);
template <typename T>
void conv_scan_avx512(const ConvScanArgs& a, int64_t c0, int64_t c1);

// then the recurrence, one step per token, in float32. Mamba2: tasks are heads.
struct Mamba2ScanArgs {
  const float* xbc;  // [n, C]: the convolution's output, x [H, P] then B and C [G, N] each
  const float* dt;  // [n, H]: softplus(dt + dt_bias), clamped
  const float* a;  // [H]: -exp(A_log)
  const float* d;  // [H]: D
  float* state;  // [H, P, N]: the request's
  float* y;  // [n, H, P]: S C + D x
  int64_t n, H, P, N, G, C;
};
void mamba2_scan_vec8(const Mamba2ScanArgs& a, int64_t h0, int64_t h1);
void mamba2_scan_avx512(const Mamba2ScanArgs& a, int64_t h0, int64_t h1);

// Gated DeltaNet: tasks are (value head, block of kScanColumns columns of its state); a column of
// S (one of dv) follows its own recurrence, so a block runs through every token on its own.
constexpr int64_t kScanColumns = 64;
struct DeltaScanArgs {
  const float* qkv;  // [n, C]: the convolution's output, q [G, dk], k [G, dk], v [Hv, dv]
  const float* g;  // [n, Hv, g_rows]: the log of the decay, per head (1) or per key channel (dk)
  const float* beta;  // [n, Hv]
  float* state;  // [Hv, dk, dv]: the request's
  float* o;  // [n, Hv, dv]: S^T q
  int64_t n, G, Hv, dk, dv, C;
  float scale;  // dk^-0.5, on q after its L2 norm
  int64_t g_rows;  // 1 or dk
  // the decays of token t's head h, one per row of S (row r's at [r * step], step 0 or 1)
  int64_t decays(int64_t t, int64_t h, float* out) const {
    const float* src = g + (t * Hv + h) * g_rows;
    for (int64_t r = 0; r < g_rows; ++r) out[r] = std::exp(src[r]);
    return g_rows == 1 ? 0 : 1;
  }
};
void delta_scan_vec8(const DeltaScanArgs& a, int64_t task0, int64_t task1);
void delta_scan_avx512(const DeltaScanArgs& a, int64_t task0, int64_t task1);

}  // namespace pds
