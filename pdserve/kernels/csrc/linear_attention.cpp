// The decode step of the linear-attention mixers, one new token per request, each request's state
// read and updated in place in its slot of the pool (no gather, no scatter):
//
//   Mamba2 (layers/mamba2.py, Mamba2Mixer._step): the causal depthwise convolution of x | B | C and
//   SiLU; per head h of P channels, dt = softplus(dt + dt_bias), S = S exp(dt A) + dt x B^T
//   (S: [P, N] float32), y = S C + D x.
//   Gated DeltaNet (layers/gated_deltanet.py, GatedDeltaNet._step): the convolution of q | k | v
//   and SiLU, q and k L2-normalised per key head (q also scaled by dk^-0.5); per value head,
//   S = S exp(g), delta = (v - S^T k) beta, S = S + k delta^T (S: [dk, dv] float32), o = S^T q.
//
// Rounding follows the torch reference step by step, so that a bf16 model's outputs are those of
// its torch path up to float32 summation order: the K taps' products are summed in order in
// float32 and rounded once to the model's dtype T, SiLU rounded again; Mamba2's dt + dt_bias,
// softplus, dt B, (dt B) x, the state as read for y, y itself, x D and y + x D are each rounded to
// T (the state stays float32); Gated DeltaNet computes in float32 from the convolution's output
// and rounds its output once.
//
// Two passes, each an at::parallel_for: the convolution (tasks: request x 256 channels; a
// request's B and C are shared by the heads of a group, so the heads cannot each convolve their
// own), then the state (tasks: request x head, each reading and writing only its own head's
// state). A head's state row is the vectorised dimension: N for Mamba2, dv for Gated DeltaNet.
#include "common.h"
#include "linear_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace pds {

// ---- checks shared with linear_attention_scan.cpp ------------------------------------------------
// Checks x [rows, C] (the new inputs, rows contiguous), the pool's windows [num_slots, C, K - 1],
// the weight [C, 1, K] (or [C, K]) and the bias [C], all of x's dtype; returns the bias or null.
const void* check_conv(const at::Tensor& x, const at::Tensor& state, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": the convolution's input must be a float32 or bfloat16 CPU [tokens, channels] tensor with "
              "contiguous rows");
  const int64_t C = x.size(1), K = weight.size(-1);
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.numel() == C * K && weight.size(0) == C,
              op, ": the convolution's weight must be contiguous [", C, ", 1, K]");
  TORCH_CHECK(K >= 2 && K <= kConvMaxTaps, op, ": convolutions of 2 to ", kConvMaxTaps, " taps only, got ", K);
  TORCH_CHECK(state.device().is_cpu() && state.dim() == 3 && state.size(1) == C && state.size(2) == K - 1 &&
                  state.is_contiguous(),
              op, ": the convolution state must be a contiguous [slots, ", C, ", ", K - 1, "] tensor, got ",
              state.sizes());
  TORCH_CHECK(state.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), op,
              ": the convolution state and weight must have the input's dtype");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == C && bias->scalar_type() == x.scalar_type(), op,
              ": the convolution's bias must be contiguous [", C, "] in the input's dtype");
  return bias->data_ptr();
}

// The recurrent states' pool: [num_slots, heads, ., .], float32, contiguous.
void check_state(const at::Tensor& state, int64_t num_slots, const char* op) {
  TORCH_CHECK(state.device().is_cpu() && state.dim() == 4 && state.scalar_type() == at::kFloat &&
                  state.is_contiguous() && state.size(0) == num_slots,
              op, ": the recurrent state must be a contiguous float32 [", num_slots, " slots, heads, ., .] tensor");
}

// A [H] parameter in float32 or bf16, as float32 (rounded to bf16 first when `to_bf16`).
std::vector<float> per_head(const at::Tensor& t, int64_t H, const char* op, const char* name, bool to_bf16) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == H && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              op, ": ", name, " must be a contiguous float32 or bfloat16 CPU [", H, "] tensor, got ", t.sizes());
  std::vector<float> v(H);
  for (int64_t i = 0; i < H; ++i) {
    const float f = t.scalar_type() == at::kFloat ? t.data_ptr<float>()[i] : load_f32(data<uint16_t>(t) + i);
    v[i] = to_bf16 ? round_to<uint16_t>(f) : f;
  }
  return v;
}

namespace {

constexpr int64_t kConvBlock = 256;  // channels per convolution task

// ---- portable code -----------------------------------------------------------------------------
template <typename T>
void conv_scalar(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1) {
  const int64_t K = a.K, K1 = K - 1;
  const T* x = static_cast<const T*>(a.x) + b * a.x_stride;
  T* state = static_cast<T*>(a.state) + a.slots[b] * a.C * K1;
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t c = c0; c < c1; ++c) {
    T* s = state + c * K1;
    const T* wc = w + c * K;
    float acc = load_f32(s) * load_f32(wc);
    for (int64_t k = 1; k < K1; ++k) acc += load_f32(s + k) * load_f32(wc + k);
    acc += load_f32(x + c) * load_f32(wc + K1);
    if (bias) acc += load_f32(bias + c);
    acc = round_to<T>(acc);
    a.out[b * a.C + c] = a.silu ? round_to<T>(acc / (1.f + std::exp(-acc))) : acc;
    for (int64_t k = 0; k + 1 < K1; ++k) s[k] = s[k + 1];
    s[K1 - 1] = x[c];
  }
}

template <typename T>
void mamba2_scalar(const Mamba2StepArgs& a, int64_t b, int64_t h) {
  const int64_t P = a.P, N = a.N;
  const float* row = a.xbc + b * a.C;
  const float* x = row + h * P;
  const float* bv = row + a.H * P + (h / (a.H / a.G)) * N;
  const float* cv = bv + a.G * N;
  float* S = a.state + (a.slots[b] * a.H + h) * P * N;
  T* out = static_cast<T*>(a.out) + (b * a.H + h) * P;
  const float dt = a.dt[b * a.H + h], decay = a.decay[b * a.H + h];
  for (int64_t p = 0; p < P; ++p) {
    float* s = S + p * N;
    float y = 0.f;
    for (int64_t n = 0; n < N; ++n) {
      s[n] = s[n] * decay + round_to<T>(round_to<T>(dt * bv[n]) * x[p]);
      y += round_to<T>(s[n]) * cv[n];
    }
    store_f32(out + p, round_to<T>(y) + round_to<T>(x[p] * a.d[h]));
  }
}

void l2_normalise_scalar(const float* v, int64_t n, float scale, bool scaled, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  const float r = 1.f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = scaled ? v[i] * r * scale : v[i] * r;
}

template <typename T>
void delta_scalar(const DeltaStepArgs& a, int64_t b, int64_t h) {
  const int64_t dk = a.dk, dv = a.dv, hk = h / (a.Hv / a.G);
  const float* row = a.qkv + b * a.C;
  float q[kDeltaMaxKeyDim], k[kDeltaMaxKeyDim];
  l2_normalise_scalar(row + hk * dk, dk, a.scale, true, q);
  l2_normalise_scalar(row + (a.G + hk) * dk, dk, 1.f, false, k);
  const float* v = row + 2 * a.G * dk + h * dv;
  float* S = a.state + (a.slots[b] * a.Hv + h) * dk * dv;
  T* out = static_cast<T*>(a.out) + (b * a.Hv + h) * dv;
  const float* decay = a.decay + (b * a.Hv + h) * a.decay_rows;
  const int64_t step = a.decay_step();
  const float beta = a.beta[b * a.Hv + h];
  for (int64_t c = 0; c < dv; ++c) {
    float kv = 0.f;
    for (int64_t r = 0; r < dk; ++r) kv += S[r * dv + c] * decay[r * step] * k[r];
    const float delta = (v[c] - kv) * beta;
    float o = 0.f;
    for (int64_t r = 0; r < dk; ++r) {
      float& s = S[r * dv + c];
      s = s * decay[r * step] + k[r] * delta;
      o += s * q[r];
    }
    store_f32(out + c, o);
  }
}

// ---- dispatch ----------------------------------------------------------------------------------
template <typename T>
void convolve(const ConvStepArgs& a, int64_t B) {
  const int64_t blocks = (a.C + kConvBlock - 1) / kConvBlock;
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / blocks, c0 = (t % blocks) * kConvBlock, c1 = std::min(a.C, c0 + kConvBlock);
#if PDS_X86
      if (simd) {
        conv_step_avx512<T>(a, b, c0, c1);
        continue;
      }
#endif
      if (v8)
        conv_step_vec8<T>(a, b, c0, c1);
      else
        conv_scalar<T>(a, b, c0, c1);
    }
  });
}

template <typename T>
void mamba2_heads(const Mamba2StepArgs& a, int64_t B) {
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, B * a.H, 1, [&](int64_t begin, int64_t end) {
#if PDS_X86
    if (simd) return mamba2_heads_avx512<T>(a, begin, end);
#endif
    if (v8) return mamba2_heads_vec8<T>(a, begin, end);
    for (int64_t t = begin; t < end; ++t) mamba2_scalar<T>(a, t / a.H, t % a.H);
  });
}

template <typename T>
void delta_heads(const DeltaStepArgs& a, int64_t B) {
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, B * a.Hv, 1, [&](int64_t begin, int64_t end) {
#if PDS_X86
    if (simd) return delta_heads_avx512<T>(a, begin, end);
#endif
    if (v8) return delta_heads_vec8<T>(a, begin, end);
    for (int64_t t = begin; t < end; ++t) delta_scalar<T>(a, t / a.Hv, t % a.Hv);
  });
}

// ---- checks ------------------------------------------------------------------------------------
// The slots as int64, each a slot of the pool ([0, num_slots)) and no two the same.
std::vector<int64_t> checked_slots(const at::Tensor& slots, int64_t B, int64_t num_slots, const char* op) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.is_contiguous() &&
                  (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt),
              op, ": slots must be a contiguous int64 or int32 [", B, "] tensor");
  std::vector<int64_t> s(B);
  for (int64_t b = 0; b < B; ++b) {
    s[b] = slots.scalar_type() == at::kLong ? slots.data_ptr<int64_t>()[b] : slots.data_ptr<int32_t>()[b];
    TORCH_CHECK(s[b] >= 0 && s[b] < num_slots, op, ": slot ", s[b], " is not in the pool's [0, ", num_slots, ")");
  }
  std::vector<int64_t> sorted = s;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), op,
              ": two requests of the batch have the same slot");
  return s;
}

ConvStepArgs conv_args(const at::Tensor& x, const at::Tensor& state, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, const int64_t* slots, float* out, const char* op) {
  const void* b = check_conv(x, state, weight, bias, op);
  return ConvStepArgs{x.data_ptr(), state.data_ptr(), slots, weight.data_ptr(), b, out, x.size(1), weight.size(-1),
                      x.stride(0)};
}

void check_out(const at::Tensor& out, const at::Tensor& x, int64_t numel, const char* op) {
  TORCH_CHECK(out.is_contiguous() && out.numel() == numel && out.scalar_type() == x.scalar_type(), op,
              ": out must be contiguous with ", numel, " elements of the input's dtype");
}

template <typename T>
void mamba2_impl(at::Tensor& out, const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv_state,
                 at::Tensor& ssm_state, const at::Tensor& slots, const at::Tensor& conv_weight,
                 const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias, const at::Tensor& A_log,
                 const at::Tensor& D, int64_t G) {
  const char* op = "mamba2_decode_step";
  const int64_t B = xbc.size(0), C = xbc.size(1);
  check_state(ssm_state, conv_state.size(0), op);
  const int64_t H = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3);
  TORCH_CHECK(G >= 1 && H % G == 0 && C == H * P + 2 * G * N, op, ": ", C, " channels are not x | B | C of ", H,
              " heads of ", P, " and ", G, " groups of state ", N);
  TORCH_CHECK(N <= kMamba2MaxState, op, ": a state of at most ", kMamba2MaxState, " per channel, got ", N);
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == B && dt.size(1) == H && dt.stride(1) == 1 &&
                  dt.scalar_type() == xbc.scalar_type(),
              op, ": dt must be [B, ", H, "] in the input's dtype with contiguous rows");
  check_out(out, xbc, B * H * P, op);
  const bool bf16 = std::is_same<T, uint16_t>::value;
  const std::vector<float> bias = per_head(dt_bias, H, op, "dt_bias", bf16);
  const std::vector<float> a_log = per_head(A_log, H, op, "A_log", false);
  const std::vector<float> d = per_head(D, H, op, "D", bf16);
  const std::vector<int64_t> s = checked_slots(slots, B, conv_state.size(0), op);
  if (B == 0) return;
  at::Tensor conv_out = at::empty({B, C}, at::kFloat);
  convolve<T>(conv_args(xbc, conv_state, conv_weight, conv_bias, s.data(), conv_out.data_ptr<float>(), op), B);
  // per (request, head): dt, and decay = exp(dt A) with A = -exp(A_log), in float32
  std::vector<float> dts(B * H), decay(B * H);
  const T* dtp = data<T>(dt);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float sp = mamba2_dt<T>(load_f32(dtp + b * dt.stride(0) + h), bias[h]);
      dts[b * H + h] = sp;
      decay[b * H + h] = std::exp(sp * -std::exp(a_log[h]));
    }
  Mamba2StepArgs a{conv_out.data_ptr<float>(), dts.data(), decay.data(), d.data(), ssm_state.data_ptr<float>(),
                   s.data(), out.data_ptr(), H, P, N, G, C};
  mamba2_heads<T>(a, B);
}

template <typename T>
void delta_impl(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta,
                at::Tensor& conv_state, at::Tensor& rec_state, const at::Tensor& slots, const at::Tensor& conv_weight,
                int64_t G) {
  const char* op = "gated_delta_decode_step";
  const int64_t B = qkv.size(0), C = qkv.size(1);
  check_state(rec_state, conv_state.size(0), op);
  const int64_t Hv = rec_state.size(1), dk = rec_state.size(2), dv = rec_state.size(3);
  TORCH_CHECK(G >= 1 && Hv % G == 0 && C == 2 * G * dk + Hv * dv, op, ": ", C, " channels are not q | k | v of ", G,
              " key heads of ", dk, " and ", Hv, " value heads of ", dv);
  TORCH_CHECK(dk <= kDeltaMaxKeyDim, op, ": key heads of at most ", kDeltaMaxKeyDim, " dims, got ", dk);
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == B && beta.size(1) == Hv && beta.stride(1) == 1 &&
                  beta.scalar_type() == at::kFloat,
              op, ": g and beta must be float32 [B, ", Hv, "] with contiguous rows");
  const int64_t rows = g.dim() == 3 ? dk : 1;  // a decay per key channel, or per head
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.size(0) == B && g.size(1) == Hv &&
                  (g.dim() == 2 ? g.stride(1) == 1 : g.dim() == 3 && g.size(2) == dk && g[0].is_contiguous()),
              op, ": g and beta must be float32 [B, ", Hv, "] with contiguous rows (g: or [B, ", Hv, ", ", dk,
              "], a decay per key channel)");
  check_out(out, qkv, B * Hv * dv, op);
  const std::vector<int64_t> s = checked_slots(slots, B, conv_state.size(0), op);
  if (B == 0) return;
  at::Tensor conv_out = at::empty({B, C}, at::kFloat);
  convolve<T>(conv_args(qkv, conv_state, conv_weight, c10::nullopt, s.data(), conv_out.data_ptr<float>(), op), B);
  std::vector<float> decay(B * Hv * rows), betas(B * Hv);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Hv * rows; ++i)
      decay[b * Hv * rows + i] = std::exp(g.data_ptr<float>()[b * g.stride(0) + i]);
    for (int64_t h = 0; h < Hv; ++h) betas[b * Hv + h] = beta.data_ptr<float>()[b * beta.stride(0) + h];
  }
  const float scale = float(1.0 / std::sqrt(double(dk)));
  DeltaStepArgs a{conv_out.data_ptr<float>(), decay.data(), betas.data(), rec_state.data_ptr<float>(), s.data(),
                  out.data_ptr(), G, Hv, dk, dv, C, scale, rows};
  delta_heads<T>(a, B);
}

}  // namespace

// out [B, C] (bx's dtype): LFM2's short convolution of each request's one new input bx [B, C]
// (B * x, rows contiguous), no activation, its window (conv_state [num_slots, C, K - 1], bx's
// dtype) updated in place at slots [B]: the taps summed in float32 as causal_conv sums them,
// rounded once.
void short_conv_decode_step(at::Tensor out, const at::Tensor& bx, at::Tensor conv_state, const at::Tensor& slots,
                            const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const char* op = "short_conv_decode_step";
  const int64_t B = bx.size(0), C = bx.size(1);
  check_out(out, bx, B * C, op);
  const std::vector<int64_t> s = checked_slots(slots, B, conv_state.size(0), op);
  at::Tensor conv_out = at::empty({B, C}, at::kFloat);
  ConvStepArgs a = conv_args(bx, conv_state, weight, bias, s.data(), conv_out.data_ptr<float>(), op);
  a.silu = false;
  if (bx.scalar_type() == at::kBFloat16)
    convolve<uint16_t>(a, B);
  else
    convolve<float>(a, B);
  out.view({B, C}).copy_(conv_out);
}

// out [B, H * P] (the model's dtype): y = S C + D x of each request's one new token, its conv
// window (conv_state [num_slots, conv_dim, K - 1], the model's dtype) and SSM state (ssm_state
// [num_slots, H, P, N], float32) updated in place at slots [B]. xbc [B, conv_dim] (x | B | C
// before the convolution) and dt [B, H]: the projection's, rows contiguous.
void mamba2_decode_step(at::Tensor out, const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_state,
                        at::Tensor ssm_state, const at::Tensor& slots, const at::Tensor& conv_weight,
                        const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias,
                        const at::Tensor& A_log, const at::Tensor& D, int64_t groups) {
  if (xbc.scalar_type() == at::kBFloat16)
    mamba2_impl<uint16_t>(out, xbc, dt, conv_state, ssm_state, slots, conv_weight, conv_bias, dt_bias, A_log, D,
                          groups);
  else
    mamba2_impl<float>(out, xbc, dt, conv_state, ssm_state, slots, conv_weight, conv_bias, dt_bias, A_log, D,
                       groups);
}

// out [B, Hv, dv] (the model's dtype): o = S^T q of each request's one new token, its conv window
// (conv_state [num_slots, conv_dim, K - 1]) and recurrent state (rec_state [num_slots, Hv, dk, dv],
// float32) updated in place at slots [B]. qkv [B, conv_dim]: q | k | v before the convolution;
// g (the log of the decay) and beta: [B, Hv] float32 (g: or [B, Hv, dk], a decay per key channel,
// Kimi Delta Attention's); key_heads: G.
void gated_delta_decode_step(at::Tensor out, const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta,
                             at::Tensor conv_state, at::Tensor rec_state, const at::Tensor& slots,
                             const at::Tensor& conv_weight, int64_t key_heads) {
  if (qkv.scalar_type() == at::kBFloat16)
    delta_impl<uint16_t>(out, qkv, g, beta, conv_state, rec_state, slots, conv_weight, key_heads);
  else
    delta_impl<float>(out, qkv, g, beta, conv_state, rec_state, slots, conv_weight, key_heads);
}

}  // namespace pds
