// The prefill scan of the linear-attention mixers: the new tokens of one request, one recurrent step
// each in order, from the state in the request's slot of the pool, which it updates in place. The
// torch code it replaces (Mamba2Mixer._extend, GatedDeltaNet._extend) solves blocks of tokens in
// the chunked (matrix) form; this is the recurrence itself, in float32, so its results do not
// depend on how a prompt is cut into chunks or blocks.
//
// First the causal convolution and SiLU over the tokens, each channel's window carried from token to
// token, rounding as the decode step does (linear_attention.cpp), tasks of 64 channels; then
//
//   Mamba2, per head h and token t:   S = exp(dt A) S + (dt x) B^T;  y = S C + D x
//   Gated DeltaNet, per value head:   q, k L2-normalised (q scaled by dk^-0.5); S = exp(g) S
//                                     (Kimi Delta Attention: exp(g) a diagonal, a decay per row);
//                                     S = S + k (beta (v - S^T k))^T;  o = S^T q
//
// with tasks of Mamba2's heads (a head's state, P x N floats, stays in cache for the whole scan) or
// of Gated DeltaNet's (value head, block of kScanColumns columns), since each column of S follows
// its own recurrence (dk x 64 floats per task). Mamba2's dt = softplus(dt + dt_bias) is computed
// here per token and head (so that a token's result does not depend on its place in a call);
// Gated DeltaNet's gates g and beta come from torch, computed over the whole batch.
#include "common.h"
#include "linear_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace pds {

const void* check_conv(const at::Tensor& x, const at::Tensor& state, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, const char* op);  // linear_attention.cpp
void check_state(const at::Tensor& state, int64_t num_slots, const char* op);
std::vector<float> per_head(const at::Tensor& t, int64_t H, const char* op, const char* name, bool to_bf16);

namespace {

constexpr int64_t kConvColumns = 64;  // channels per convolution task

template <typename T>
void conv_scan_scalar(const ConvScanArgs& a, int64_t c0, int64_t c1) {
  const int64_t K = a.K, K1 = K - 1;
  T* state = static_cast<T*>(a.state);
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t c = c0; c < c1; ++c) {
    float win[kConvMaxTaps];
    for (int64_t k = 0; k < K1; ++k) win[k] = load_f32(state + c * K1 + k);
    for (int64_t t = 0; t < a.n; ++t) {
      win[K1] = load_f32(static_cast<const T*>(a.x) + t * a.x_stride + c);
      float acc = win[0] * load_f32(w + c * K);
      for (int64_t k = 1; k < K; ++k) acc += win[k] * load_f32(w + c * K + k);
      if (bias) acc += load_f32(bias + c);
      acc = round_to<T>(acc);
      a.out[t * a.C + c] = a.silu ? round_to<T>(acc / (1.f + std::exp(-acc))) : acc;
      for (int64_t k = 0; k < K1; ++k) win[k] = win[k + 1];
    }
    for (int64_t k = 0; k < K1; ++k) store_f32(state + c * K1 + k, win[k]);
  }
}

void mamba2_scan_scalar(const Mamba2ScanArgs& a, int64_t h) {
  const int64_t P = a.P, N = a.N;
  float* S = a.state + h * P * N;
  for (int64_t t = 0; t < a.n; ++t) {
    const float* x = a.xbc + t * a.C + h * P;
    const float* bv = a.xbc + t * a.C + a.H * P + (h / (a.H / a.G)) * N;
    const float* cv = bv + a.G * N;
    const float dt = a.dt[t * a.H + h], decay = std::exp(dt * a.a[h]);
    for (int64_t p = 0; p < P; ++p) {
      float* s = S + p * N;
      const float u = dt * x[p];
      float y = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        s[n] = s[n] * decay + u * bv[n];
        y += s[n] * cv[n];
      }
      a.y[(t * a.H + h) * P + p] = y + a.d[h] * x[p];
    }
  }
}

void l2_normalise(const float* v, int64_t n, float scale, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  const float r = 1.f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = v[i] * r * scale;
}

void delta_scan_scalar(const DeltaScanArgs& a, int64_t task) {
  const int64_t blocks = (a.dv + kScanColumns - 1) / kScanColumns;
  const int64_t h = task / blocks, c0 = (task % blocks) * kScanColumns, c1 = std::min(a.dv, c0 + kScanColumns);
  const int64_t dk = a.dk, dv = a.dv, hk = h / (a.Hv / a.G);
  float* S = a.state + h * dk * dv;
  float q[kDeltaMaxKeyDim], k[kDeltaMaxKeyDim];
  for (int64_t t = 0; t < a.n; ++t) {
    const float* row = a.qkv + t * a.C;
    l2_normalise(row + hk * dk, dk, a.scale, q);
    l2_normalise(row + (a.G + hk) * dk, dk, 1.f, k);
    const float* v = row + 2 * a.G * dk + h * dv;
    float g[kDeltaMaxKeyDim];
    const int64_t step = a.decays(t, h, g);  // 0: one decay per head, applied to S^T k once
    const float beta = a.beta[t * a.Hv + h];
    for (int64_t c = c0; c < c1; ++c) {
      float kv = 0.f;
      if (step)
        for (int64_t r = 0; r < dk; ++r) kv += S[r * dv + c] * g[r] * k[r];
      else
        for (int64_t r = 0; r < dk; ++r) kv += S[r * dv + c] * k[r];
      const float delta = (v[c] - (step ? kv : kv * g[0])) * beta;
      float o = 0.f;
      for (int64_t r = 0; r < dk; ++r) {
        float& s = S[r * dv + c];
        s = s * g[r * step] + k[r] * delta;
        o += s * q[r];
      }
      a.o[(t * a.Hv + h) * dv + c] = o;
    }
  }
}

void check_f32(const at::Tensor& t, std::initializer_list<int64_t> sizes, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.sizes() == at::IntArrayRef(sizes),
              op, ": ", name, " must be a contiguous float32 CPU tensor of shape ", at::IntArrayRef(sizes),
              ", got ", t.scalar_type(), " ", t.sizes());
}

// The convolution of x [n, C] over the window at `slot` of conv_state (updated in place): its
// output [n, C], float32 (rounded to x's dtype).
template <typename T>
at::Tensor convolve(const at::Tensor& x, at::Tensor& conv_state, int64_t slot, const at::Tensor& weight,
                    const void* bias, bool silu) {
  const int64_t n = x.size(0), C = x.size(1), K = weight.size(-1);
  at::Tensor out = at::empty({n, C}, at::kFloat);
  ConvScanArgs a{x.data_ptr(), data<T>(conv_state) + slot * conv_state.stride(0), weight.data_ptr(), bias,
                 out.data_ptr<float>(), n, C, K, x.stride(0), silu};
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, (C + kConvColumns - 1) / kConvColumns, 1, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kConvColumns, c1 = std::min(C, end * kConvColumns);
#if PDS_X86
    if (simd) return conv_scan_avx512<T>(a, c0, c1);
#endif
    if (v8) return conv_scan_vec8<T>(a, c0, c1);
    conv_scan_scalar<T>(a, c0, c1);
  });
  return out;
}

at::Tensor convolve(const at::Tensor& x, at::Tensor& conv_state, int64_t slot, const at::Tensor& weight,
                    const c10::optional<at::Tensor>& bias, const char* op, bool silu = true) {
  const void* b = check_conv(x, conv_state, weight, bias, op);
  TORCH_CHECK(slot >= 0 && slot < conv_state.size(0), op, ": slot ", slot, " is not in the pool's [0, ",
              conv_state.size(0), ")");
  return x.scalar_type() == at::kBFloat16 ? convolve<uint16_t>(x, conv_state, slot, weight, b, silu)
                                          : convolve<float>(x, conv_state, slot, weight, b, silu);
}

}  // namespace

// out [n, C] (bx's dtype): LFM2's short convolution of n new inputs bx [n, C] (B * x, rows
// contiguous) of one request, no activation, over its window (conv_state [num_slots, C, K - 1],
// bx's dtype) at `slot`, updated in place: the taps summed in float32 as causal_conv sums them,
// rounded once.
void short_conv_scan(at::Tensor out, const at::Tensor& bx, at::Tensor conv_state, int64_t slot,
                     const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const char* op = "short_conv_scan";
  TORCH_CHECK(out.sizes() == bx.sizes() && out.is_contiguous() && out.scalar_type() == bx.scalar_type(), op,
              ": out must be contiguous and shaped and typed as bx ", bx.sizes());
  out.copy_(convolve(bx, conv_state, slot, weight, bias, op, false));
}

// y [n, H * P] (float32) = S C + D x of n new tokens of one request, its convolution window
// (conv_state [num_slots, conv_dim, K - 1], xbc's dtype) and SSM state (ssm_state [num_slots, H,
// P, N], float32) at `slot` updated in place. xbc [n, conv_dim] (x | B | C before the convolution)
// and dt [n, H]: the projection's, rows contiguous; dt = softplus(dt + dt_bias) clamped to
// [dt_min, dt_max] as Mamba2Mixer._extend computes it.
void mamba2_scan(at::Tensor y, const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_state,
                 at::Tensor ssm_state, int64_t slot, const at::Tensor& conv_weight,
                 const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias, const at::Tensor& A_log,
                 const at::Tensor& D, int64_t groups, double dt_min, double dt_max) {
  const char* op = "mamba2_scan";
  check_state(ssm_state, conv_state.size(0), op);
  const int64_t n = xbc.size(0), C = xbc.size(1);
  const int64_t H = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3), G = groups;
  TORCH_CHECK(G >= 1 && H % G == 0 && C == H * P + 2 * G * N, op, ": ", C, " channels are not x | B | C of ", H,
              " heads of ", P, " and ", G, " groups of state ", N);
  TORCH_CHECK(N <= kMamba2MaxState, op, ": a state of at most ", kMamba2MaxState, " per channel, got ", N);
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == n && dt.size(1) == H && dt.stride(1) == 1 &&
                  dt.scalar_type() == xbc.scalar_type(),
              op, ": dt must be [n, ", H, "] in xbc's dtype with contiguous rows");
  check_f32(y, {n, H * P}, op, "y");
  const bool bf16 = xbc.scalar_type() == at::kBFloat16;
  const std::vector<float> bias = per_head(dt_bias, H, op, "dt_bias", bf16);
  std::vector<float> a = per_head(A_log, H, op, "A_log", false);
  for (float& v : a) v = -std::exp(v);
  const std::vector<float> d = per_head(D, H, op, "D", false);
  const at::Tensor conv_out = convolve(xbc, conv_state, slot, conv_weight, conv_bias, op);
  // dt per (token, head), clamped in T (its bounds rounded to T, as torch.clamp's)
  std::vector<float> dts(n * H);
  const float lo = bf16 ? round_to<uint16_t>(float(dt_min)) : float(dt_min);
  const float hi = bf16 ? round_to<uint16_t>(float(dt_max)) : float(dt_max);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float v = bf16 ? mamba2_dt<uint16_t>(load_f32(data<uint16_t>(dt) + t * dt.stride(0) + h), bias[h])
                             : mamba2_dt<float>(dt.data_ptr<float>()[t * dt.stride(0) + h], bias[h]);
        dts[t * H + h] = std::min(std::max(v, lo), hi);
      }
  });
  Mamba2ScanArgs args{conv_out.data_ptr<float>(), dts.data(), a.data(), d.data(),
                      ssm_state.data_ptr<float>() + slot * ssm_state.stride(0), y.data_ptr<float>(), n, H, P, N, G, C};
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
#if PDS_X86
    if (simd) return mamba2_scan_avx512(args, begin, end);
#endif
    if (v8) return mamba2_scan_vec8(args, begin, end);
    for (int64_t h = begin; h < end; ++h) mamba2_scan_scalar(args, h);
  });
}

// o [n, Hv, dv] (float32) = S^T q of n new tokens of one request, its convolution window
// (conv_state [num_slots, conv_dim, K - 1], qkv's dtype) and recurrent state (rec_state
// [num_slots, Hv, dk, dv], float32) at `slot` updated in place. qkv [n, conv_dim]: q | k | v
// before the convolution (rows contiguous); g (the log of the decay) and beta: [n, Hv] float32 (g: or
// [n, Hv, dk], a decay per key channel).
void gated_delta_scan(at::Tensor o, const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta,
                      at::Tensor conv_state, at::Tensor rec_state, int64_t slot, const at::Tensor& conv_weight,
                      int64_t key_heads) {
  const char* op = "gated_delta_scan";
  check_state(rec_state, conv_state.size(0), op);
  const int64_t n = qkv.size(0), C = qkv.size(1), G = key_heads;
  const int64_t Hv = rec_state.size(1), dk = rec_state.size(2), dv = rec_state.size(3);
  TORCH_CHECK(G >= 1 && Hv % G == 0 && C == 2 * G * dk + Hv * dv, op, ": ", C, " channels are not q | k | v of ", G,
              " key heads of ", dk, " and ", Hv, " value heads of ", dv);
  TORCH_CHECK(dk <= kDeltaMaxKeyDim, op, ": key heads of at most ", kDeltaMaxKeyDim, " dims, got ", dk);
  if (g.dim() == 3)  // a decay per key channel (Kimi Delta Attention's)
    check_f32(g, {n, Hv, dk}, op, "g");
  else
    check_f32(g, {n, Hv}, op, "g");
  check_f32(beta, {n, Hv}, op, "beta");
  check_f32(o, {n, Hv, dv}, op, "o");
  const at::Tensor conv_out = convolve(qkv, conv_state, slot, conv_weight, c10::nullopt, op);
  DeltaScanArgs args{conv_out.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>(),
                     rec_state.data_ptr<float>() + slot * rec_state.stride(0), o.data_ptr<float>(), n, G, Hv, dk, dv, C,
                     float(1.0 / std::sqrt(double(dk))), g.dim() == 3 ? dk : 1};
  const int64_t tasks = Hv * ((dv + kScanColumns - 1) / kScanColumns);
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
#if PDS_X86
    if (simd) return delta_scan_avx512(args, begin, end);
#endif
    if (v8) return delta_scan_vec8(args, begin, end);
    for (int64_t t = begin; t < end; ++t) delta_scan_scalar(args, t);
  });
}

}  // namespace pds
