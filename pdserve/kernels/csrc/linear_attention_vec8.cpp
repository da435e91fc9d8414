// The linear-attention kernels on 8 lanes (AVX2 + FMA, NEON). Decode: the causal convolution,
// Mamba2's state update and Gated DeltaNet's delta rule, each rounding where the torch reference
// rounds (linear_attention.cpp states where), vectorised over channels or over the state's inner
// dimension. Prefill: the same recurrences over a request's tokens in float32
// (linear_attention_scan.cpp).
#include "vec8.h"
#include "linear_attention.h"

#if PDS_HAS_V8
namespace pds {
namespace {
using namespace v8;

template <typename T>
PDS_V8 void conv_rows(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1) {
  const int64_t K = a.K, K1 = K - 1;
  const T* x = static_cast<const T*>(a.x) + b * a.x_stride;
  T* state = static_cast<T*>(a.state) + a.slots[b] * a.C * K1;
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  float* out = a.out + b * a.C;
  const F8 one = set1(1.f);
  for (int64_t c = c0; c < c1; c += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - c);
    // the window and the weights of 8 channels, tap by tap (a channel's K1 inputs are contiguous)
    alignas(32) float tap[kConvMaxTaps][8], wt[kConvMaxTaps][8];
    if (n < 8) {  // lanes past the last channel: computed, not stored
      std::memset(tap, 0, sizeof(tap));
      std::memset(wt, 0, sizeof(wt));
    }
    for (int64_t i = 0; i < n; ++i) {
      T* s = state + (c + i) * K1;
      const T* wc = w + (c + i) * K;
      for (int64_t k = 0; k < K1; ++k) tap[k][i] = load_f32(s + k);
      tap[K1][i] = load_f32(x + c + i);
      for (int64_t k = 0; k < K; ++k) wt[k][i] = load_f32(wc + k);
      for (int64_t k = 0; k + 1 < K1; ++k) s[k] = s[k + 1];  // the window moves on by one input
      s[K1 - 1] = x[c + i];
    }
    F8 acc = mul(load(tap[0]), load(wt[0]));  // taps in order, each product rounded
    for (int64_t k = 1; k < K; ++k) acc = add(acc, mul(load(tap[k]), load(wt[k])));
    if (bias) acc = add(acc, load_upto(bias + c, n));
    acc = round_to<T>(acc);
    store_upto(out + c, a.silu ? round_to<T>(div(acc, add(one, exp(sub(zero(), acc))))) : acc, n);
  }
}

template <typename T>
PDS_V8 void mamba2_head(const Mamba2StepArgs& a, int64_t b, int64_t h) {
  const int64_t P = a.P, N = a.N, NV = N & ~int64_t(7);
  const float* row = a.xbc + b * a.C;
  const float* x = row + h * P;
  const float* bv = row + a.H * P + (h / (a.H / a.G)) * N;
  const float* cv = bv + a.G * N;
  float* S = a.state + (a.slots[b] * a.H + h) * P * N;
  T* out = static_cast<T*>(a.out) + (b * a.H + h) * P;
  const float dt = a.dt[b * a.H + h], dh = a.d[h];
  alignas(32) float db[kMamba2MaxState];  // round(dt B)
  for (int64_t n = 0; n < N; n += 8) store_upto(db + n, round_to<T>(mul(set1(dt), load_upto(bv + n, N - n))), N - n);
  const F8 decay = set1(a.decay[b * a.H + h]);
  for (int64_t p = 0; p < P; ++p) {
    float* s = S + p * N;
    const F8 xp = set1(x[p]);
    F8 acc0 = zero(), acc1 = zero();
    int64_t n = 0;
    // S = S decay + round(round(dt B) x), not fused; y = round(S) . C
    for (; n + 16 <= NV; n += 16) {
      const F8 s0 = add(mul(load(s + n), decay), round_to<T>(mul(load(db + n), xp)));
      const F8 s1 = add(mul(load(s + n + 8), decay), round_to<T>(mul(load(db + n + 8), xp)));
      store(s + n, s0);
      store(s + n + 8, s1);
      acc0 = fma(round_to<T>(s0), load(cv + n), acc0);
      acc1 = fma(round_to<T>(s1), load(cv + n + 8), acc1);
    }
    for (; n < N; n += 8) {
      const F8 s0 = add(mul(load_upto(s + n, N - n), decay), round_to<T>(mul(load_upto(db + n, N - n), xp)));
      store_upto(s + n, s0, N - n);
      acc0 = fma(round_to<T>(s0), load_upto(cv + n, N - n), acc0);
    }
    const float y = pds::round_to<T>(reduce_add(add(acc0, acc1)));
    store_f32(out + p, y + pds::round_to<T>(x[p] * dh));
  }
}

// L2 norm of a head's dk values, times scale (after the norm, as the reference does)
PDS_VI void l2_normalise(const float* v, int64_t n, float scale, bool scaled, float* out) {
  F8 ss = zero();
  for (int64_t i = 0; i < n; i += 8) {
    const F8 t = load_upto(v + i, n - i);
    ss = fma(t, t, ss);
  }
  const F8 r = set1(1.f / std::sqrt(reduce_add(ss) + 1e-6f));
  for (int64_t i = 0; i < n; i += 8) {
    F8 t = mul(load_upto(v + i, n - i), r);
    if (scaled) t = mul(t, set1(scale));
    store_upto(out + i, t, n - i);
  }
}

// J vectors of a head's columns (Partial: one vector of its last n < 8 columns): S is the first of
// them in row 0 (rows dv apart), v and o the same columns of the values and of the output
template <bool Partial>
PDS_VI F8 load_cols(const float* p, int64_t n) { return Partial ? load_n(p, n) : load(p); }
template <bool Partial>
PDS_VI void store_cols(float* p, F8 t, int64_t n) {
  if (Partial)
    store_n(p, t, n);
  else
    store(p, t);
}

template <int J, bool Partial>
PDS_VI void delta_columns(float* S, int64_t dk, int64_t dv, int64_t n, const float* q, const float* k,
                          const float* v, const float* decay, int64_t step, float beta, float* o) {
  F8 acc[J], delta[J];
  for (int j = 0; j < J; ++j) acc[j] = zero();
  for (int64_t r = 0; r < dk; ++r) {  // S^T k of the decayed state
    const F8 kr = set1(k[r]), g = set1(decay[r * step]);
    for (int j = 0; j < J; ++j) acc[j] = fma(mul(load_cols<Partial>(S + r * dv + 8 * j, n), g), kr, acc[j]);
  }
  for (int j = 0; j < J; ++j) {  // delta = (v - S^T k) beta
    delta[j] = mul(sub(load_cols<Partial>(v + 8 * j, n), acc[j]), set1(beta));
    acc[j] = zero();
  }
  for (int64_t r = 0; r < dk; ++r) {  // S = S decay + k delta^T (not fused), o = S^T q
    const F8 kr = set1(k[r]), qr = set1(q[r]), g = set1(decay[r * step]);
    float* s = S + r * dv;
    for (int j = 0; j < J; ++j) {
      const F8 t = add(mul(load_cols<Partial>(s + 8 * j, n), g), mul(kr, delta[j]));
      store_cols<Partial>(s + 8 * j, t, n);
      acc[j] = fma(t, qr, acc[j]);
    }
  }
  for (int j = 0; j < J; ++j) store_cols<Partial>(o + 8 * j, acc[j], n);
}

template <typename T>
PDS_V8 void delta_head(const DeltaStepArgs& a, int64_t b, int64_t h) {
  const int64_t dk = a.dk, dv = a.dv, hk = h / (a.Hv / a.G);
  const float* row = a.qkv + b * a.C;
  alignas(32) float q[kDeltaMaxKeyDim], k[kDeltaMaxKeyDim], o[32];
  l2_normalise(row + hk * dk, dk, a.scale, true, q);
  l2_normalise(row + (a.G + hk) * dk, dk, 1.f, false, k);
  const float* v = row + 2 * a.G * dk + h * dv;
  float* S = a.state + (a.slots[b] * a.Hv + h) * dk * dv;
  T* out = static_cast<T*>(a.out) + (b * a.Hv + h) * dv;
  const float* decay = a.decay + (b * a.Hv + h) * a.decay_rows;
  const int64_t step = a.decay_step();
  const float beta = a.beta[b * a.Hv + h];
  int64_t c = 0;
  for (; c + 32 <= dv; c += 32) {  // 4 vectors of columns: their S^T k, delta and o in registers
    delta_columns<4, false>(S + c, dk, dv, 8, q, k, v + c, decay, step, beta, o);
    for (int i = 0; i < 32; i += 8) store(out + c + i, load(o + i));
  }
  for (; c < dv; c += 8) {
    const int64_t n = std::min<int64_t>(8, dv - c);
    if (n == 8)
      delta_columns<1, false>(S + c, dk, dv, 8, q, k, v + c, decay, step, beta, o);
    else
      delta_columns<1, true>(S + c, dk, dv, n, q, k, v + c, decay, step, beta, o);
    store_upto(out + c, load_upto(o, n), n);
  }
}

// ---- prefill scans ------------------------------------------------------------------------------
// channels c0 .. c1 through every token, 8 at a time, their window carried from token to token
template <typename T>
PDS_V8 void conv_scan_rows(const ConvScanArgs& a, int64_t c0, int64_t c1) {
  const int64_t K = a.K, K1 = K - 1;
  const T* x = static_cast<const T*>(a.x);
  T* state = static_cast<T*>(a.state);
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  const F8 one = set1(1.f);
  for (int64_t c = c0; c < c1; c += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - c);
    alignas(32) float buf[kConvMaxTaps][8] = {}, wbuf[kConvMaxTaps][8] = {};
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < K1; ++k) buf[k][i] = load_f32(state + (c + i) * K1 + k);
      for (int64_t k = 0; k < K; ++k) wbuf[k][i] = load_f32(w + (c + i) * K + k);
    }
    F8 win[kConvMaxTaps], wt[kConvMaxTaps];
    for (int64_t k = 0; k < K; ++k) {
      win[k] = load(buf[k]);
      wt[k] = load(wbuf[k]);
    }
    const F8 b = bias ? load_upto(bias + c, n) : zero();
    for (int64_t t = 0; t < a.n; ++t) {
      win[K1] = load_upto(x + t * a.x_stride + c, n);
      F8 acc = mul(win[0], wt[0]);  // taps in order, each product rounded
      for (int64_t k = 1; k < K; ++k) acc = add(acc, mul(win[k], wt[k]));
      if (bias) acc = add(acc, b);
      acc = round_to<T>(acc);
      store_upto(a.out + t * a.C + c, a.silu ? round_to<T>(div(acc, add(one, exp(sub(zero(), acc))))) : acc, n);
      for (int64_t k = 0; k < K1; ++k) win[k] = win[k + 1];
    }
    for (int64_t k = 0; k < K1; ++k) store(buf[k], win[k]);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K1; ++k) store_f32(state + (c + i) * K1 + k, buf[k][i]);
  }
}

PDS_V8 void mamba2_scan_head(const Mamba2ScanArgs& a, int64_t h) {
  const int64_t P = a.P, N = a.N, NV = N & ~int64_t(15);
  float* S = a.state + h * P * N;
  for (int64_t t = 0; t < a.n; ++t) {
    const float* x = a.xbc + t * a.C + h * P;
    const float* bv = a.xbc + t * a.C + a.H * P + (h / (a.H / a.G)) * N;
    const float* cv = bv + a.G * N;
    const float dt = a.dt[t * a.H + h];
    const F8 decay = set1(std::exp(dt * a.a[h]));
    float* y = a.y + (t * a.H + h) * P;
    for (int64_t p = 0; p < P; ++p) {  // S = S decay + (dt x) B^T, y = S C + D x
      float* s = S + p * N;
      const F8 u = set1(dt * x[p]);
      F8 acc0 = zero(), acc1 = zero();
      int64_t n = 0;
      for (; n < NV; n += 16) {
        const F8 s0 = fma(u, load(bv + n), mul(load(s + n), decay));
        const F8 s1 = fma(u, load(bv + n + 8), mul(load(s + n + 8), decay));
        store(s + n, s0);
        store(s + n + 8, s1);
        acc0 = fma(s0, load(cv + n), acc0);
        acc1 = fma(s1, load(cv + n + 8), acc1);
      }
      for (; n < N; n += 8) {
        const F8 s0 = fma(u, load_upto(bv + n, N - n), mul(load_upto(s + n, N - n), decay));
        store_upto(s + n, s0, N - n);
        acc0 = fma(s0, load_upto(cv + n, N - n), acc0);
      }
      y[p] = reduce_add(add(acc0, acc1)) + a.d[h] * x[p];
    }
  }
}

// columns c .. c + 8 J of value head h (Partial: one vector of n < 8) through every token; PerRow:
// a decay per row of S (Kimi Delta Attention), else one per head, applied to S^T k once
template <int J, bool Partial, bool PerRow>
PDS_VI void delta_scan_columns(const DeltaScanArgs& a, int64_t h, int64_t c, int64_t n) {
  const int64_t dk = a.dk, dv = a.dv, hk = h / (a.Hv / a.G);
  float* S = a.state + h * dk * dv + c;
  alignas(32) float q[kDeltaMaxKeyDim], k[kDeltaMaxKeyDim];
  for (int64_t t = 0; t < a.n; ++t) {
    const float* row = a.qkv + t * a.C;
    l2_normalise(row + hk * dk, dk, a.scale, true, q);
    l2_normalise(row + (a.G + hk) * dk, dk, 1.f, false, k);
    const float* v = row + 2 * a.G * dk + h * dv + c;
    alignas(32) float decay[kDeltaMaxKeyDim];
    a.decays(t, h, decay);
    const F8 beta = set1(a.beta[t * a.Hv + h]), g0 = set1(decay[0]);
    F8 acc[J], delta[J];
    for (int j = 0; j < J; ++j) acc[j] = zero();
    for (int64_t r = 0; r < dk; ++r) {  // S^T k of the decayed state
      const F8 kr = set1(k[r]);
      for (int j = 0; j < J; ++j) {
        const F8 s = load_cols<Partial>(S + r * dv + 8 * j, n);
        acc[j] = fma(PerRow ? mul(s, set1(decay[r])) : s, kr, acc[j]);
      }
    }
    for (int j = 0; j < J; ++j) {  // delta = (v - S^T k) beta
      delta[j] = mul(sub(load_cols<Partial>(v + 8 * j, n), PerRow ? acc[j] : mul(acc[j], g0)), beta);
      acc[j] = zero();
    }
    for (int64_t r = 0; r < dk; ++r) {  // S = S decay + k delta^T, o = S^T q
      const F8 kr = set1(k[r]), qr = set1(q[r]), g = PerRow ? set1(decay[r]) : g0;
      float* s = S + r * dv;
      for (int j = 0; j < J; ++j) {
        const F8 st = fma(kr, delta[j], mul(load_cols<Partial>(s + 8 * j, n), g));
        store_cols<Partial>(s + 8 * j, st, n);
        acc[j] = fma(st, qr, acc[j]);
      }
    }
    float* o = a.o + (t * a.Hv + h) * dv + c;
    for (int j = 0; j < J; ++j) store_cols<Partial>(o + 8 * j, acc[j], n);
  }
}

PDS_V8 void delta_scan_task(const DeltaScanArgs& a, int64_t task) {
  const int64_t blocks = (a.dv + kScanColumns - 1) / kScanColumns;
  const int64_t h = task / blocks, c0 = (task % blocks) * kScanColumns;
  const int64_t c1 = std::min(a.dv, c0 + kScanColumns);
  int64_t c = c0;
  if (a.g_rows == 1) {
    for (; c + 32 <= c1; c += 32) delta_scan_columns<4, false, false>(a, h, c, 8);
    for (; c + 8 <= c1; c += 8) delta_scan_columns<1, false, false>(a, h, c, 8);
    if (c < c1) delta_scan_columns<1, true, false>(a, h, c, c1 - c);
    return;
  }
  for (; c + 32 <= c1; c += 32) delta_scan_columns<4, false, true>(a, h, c, 8);
  for (; c + 8 <= c1; c += 8) delta_scan_columns<1, false, true>(a, h, c, 8);
  if (c < c1) delta_scan_columns<1, true, true>(a, h, c, c1 - c);
}

}  // namespace

template <typename T>
void conv_step_vec8(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1) {
  conv_rows<T>(a, b, c0, c1);
}
template <typename T>
void conv_scan_vec8(const ConvScanArgs& a, int64_t c0, int64_t c1) {
  conv_scan_rows<T>(a, c0, c1);
}
template <typename T>
void mamba2_heads_vec8(const Mamba2StepArgs& a, int64_t task0, int64_t task1) {
  for (int64_t t = task0; t < task1; ++t) mamba2_head<T>(a, t / a.H, t % a.H);
}
template <typename T>
void delta_heads_vec8(const DeltaStepArgs& a, int64_t task0, int64_t task1) {
  for (int64_t t = task0; t < task1; ++t) delta_head<T>(a, t / a.Hv, t % a.Hv);
}

void mamba2_scan_vec8(const Mamba2ScanArgs& a, int64_t h0, int64_t h1) {
  for (int64_t h = h0; h < h1; ++h) mamba2_scan_head(a, h);
}
void delta_scan_vec8(const DeltaScanArgs& a, int64_t task0, int64_t task1) {
  for (int64_t t = task0; t < task1; ++t) delta_scan_task(a, t);
}

#define PDS_INSTANTIATE(T)                                                                 \
  template void conv_step_vec8<T>(const ConvStepArgs&, int64_t, int64_t, int64_t);         \
  template void mamba2_heads_vec8<T>(const Mamba2StepArgs&, int64_t, int64_t);             \
  template void delta_heads_vec8<T>(const DeltaStepArgs&, int64_t, int64_t);             \
  template void conv_scan_vec8<T>(const ConvScanArgs&, int64_t, int64_t);
PDS_INSTANTIATE(float)
PDS_INSTANTIATE(uint16_t)
#undef PDS_INSTANTIATE

}  // namespace pds
#endif
