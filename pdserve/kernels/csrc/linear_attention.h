// The linear-attention kernels' per-ISA parts and the argument structs they share:
// linear_attention.cpp (the torch-facing entry points, checks and portable code) calls
// linear_attention_avx512.cpp (x86-64 only) or linear_attention_vec8.cpp (AVX2, NEON) on a range of
// its tasks after the ISA checks of isa.h. No torch headers.
#pragma once

#include <cstdint>

namespace pds {

// the sizes the kernels' stack buffers hold (linear_attention.cpp refuses larger ones)
constexpr int64_t kConvMaxTaps = 8;  // K
constexpr int64_t kMamba2MaxState = 512;  // N
constexpr int64_t kDeltaMaxKeyDim = 256;  // dk

// The decode step of the linear-attention mixers (one new token per request, its state updated in
// place in the request's slot of the pool). First the causal convolution of every channel:
struct ConvStepArgs {
  const void* x;  // [B, C] the new inputs (T), row stride x_stride
  void* state;  // [num_slots, C, K - 1] (T): each channel's previous K - 1 inputs, oldest first
  const int64_t* slots;  // [B]
  const void* weight;  // [C, K] (T)
  const void* bias;  // [C] (T) or null
  float* out;  // [B, C]: SiLU of the taps' sum, each rounded to T
  int64_t C, K, x_stride;
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

// or of a Gated DeltaNet layer, task b * Hv + h
struct DeltaStepArgs {
  const float* qkv;  // [B, C]: the convolution's output, q [G, dk], k [G, dk], v [Hv, dv]
  const float* decay;  // [B, Hv]: exp(g)
  const float* beta;  // [B, Hv]
  float* state;  // [num_slots, Hv, dk, dv]
  const int64_t* slots;  // [B]
  void* out;  // [B, Hv, dv] (T)
  int64_t G, Hv, dk, dv, C;
  float scale;  // dk^-0.5, on q after its L2 norm
};
template <typename T>
void delta_heads_vec8(const DeltaStepArgs& a, int64_t task0, int64_t task1);
template <typename T>
void delta_heads_avx512(const DeltaStepArgs& a, int64_t task0, int64_t task1);

}  // namespace pds
