// The linear-attention kernels on AVX-512, 16 lanes (masked at the tails) over channels or over the
// state's inner dimension: the decode step (linear_attention.cpp's contract and rounding) and the
// prefill scans (linear_attention_scan.cpp's).
#include "common.h"
#include "linear_attention.h"

#include <algorithm>

#if PDS_X86
namespace pds {
namespace {

template <typename T>
PDS_AVX512 inline __m512 round16(__m512 v);
template <>
PDS_AVX512 inline __m512 round16<float>(__m512 v) { return v; }
template <>
PDS_AVX512 inline __m512 round16<uint16_t>(__m512 v) { return bf16x16_to_f32(f32x16_to_bf16(v)); }

template <typename T>
PDS_AVX512 void conv_avx512(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1) {
  const int64_t K = a.K, K1 = K - 1;
  const T* x = static_cast<const T*>(a.x) + b * a.x_stride;
  T* state = static_cast<T*>(a.state) + a.slots[b] * a.C * K1;
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t c = c0; c < c1; c += 16) {
    const int64_t n = std::min<int64_t>(16, c1 - c);
    const __mmask16 mk = tail_mask(n);
    alignas(64) float tap[kConvMaxTaps][16], wt[kConvMaxTaps][16];
    if (n < 16) {  // lanes past the last channel: computed, not stored
      std::memset(tap, 0, sizeof(tap));
      std::memset(wt, 0, sizeof(wt));
    }
    for (int64_t i = 0; i < n; ++i) {
      T* s = state + (c + i) * K1;
      const T* wc = w + (c + i) * K;
      for (int64_t k = 0; k < K1; ++k) tap[k][i] = load_f32(s + k);
      tap[K1][i] = load_f32(x + c + i);
      for (int64_t k = 0; k < K; ++k) wt[k][i] = load_f32(wc + k);
      for (int64_t k = 0; k + 1 < K1; ++k) s[k] = s[k + 1];
      s[K1 - 1] = x[c + i];
    }
    __m512 acc = _mm512_mul_ps(_mm512_load_ps(tap[0]), _mm512_load_ps(wt[0]));
    for (int64_t k = 1; k < K; ++k)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_load_ps(tap[k]), _mm512_load_ps(wt[k])));
    if (bias) acc = _mm512_add_ps(acc, load16(bias + c, mk));
    acc = round16<T>(acc);
    if (a.silu) acc = round16<T>(_mm512_div_ps(acc, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc)))));
    _mm512_mask_storeu_ps(a.out + b * a.C + c, mk, acc);
  }
}

template <typename T>
PDS_AVX512 void mamba2_avx512(const Mamba2StepArgs& a, int64_t b, int64_t h) {
  const int64_t P = a.P, N = a.N;
  const float* row = a.xbc + b * a.C;
  const float* x = row + h * P;
  const float* bv = row + a.H * P + (h / (a.H / a.G)) * N;
  const float* cv = bv + a.G * N;
  float* S = a.state + (a.slots[b] * a.H + h) * P * N;
  T* out = static_cast<T*>(a.out) + (b * a.H + h) * P;
  alignas(64) float db[kMamba2MaxState];  // round(dt B)
  const __m512 dt = _mm512_set1_ps(a.dt[b * a.H + h]), decay = _mm512_set1_ps(a.decay[b * a.H + h]);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 mk = tail_mask(N - n);
    _mm512_mask_storeu_ps(db + n, mk, round16<T>(_mm512_mul_ps(dt, _mm512_maskz_loadu_ps(mk, bv + n))));
  }
  for (int64_t p = 0; p < P; ++p) {
    float* s = S + p * N;
    const __m512 xp = _mm512_set1_ps(x[p]);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 mk = tail_mask(N - n);
      const __m512 u = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, db + n), xp));
      const __m512 sn = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, s + n), decay), u);
      _mm512_mask_storeu_ps(s + n, mk, sn);
      acc = _mm512_fmadd_ps(round16<T>(sn), _mm512_maskz_loadu_ps(mk, cv + n), acc);
    }
    const float y = round_to<T>(_mm512_reduce_add_ps(acc));
    store_f32(out + p, y + round_to<T>(x[p] * a.d[h]));
  }
}

PDS_AVX512 void l2_normalise_avx512(const float* v, int64_t n, float scale, bool scaled, float* out) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 t = _mm512_maskz_loadu_ps(tail_mask(n - i), v + i);
    ss = _mm512_fmadd_ps(t, t, ss);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) + 1e-6f));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = tail_mask(n - i);
    __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, v + i), r);
    if (scaled) t = _mm512_mul_ps(t, _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out + i, mk, t);
  }
}

// J vectors of columns of a head's state from column c (the last vector masked by `last`)
template <int J>
PDS_AVX512 inline void delta_columns_avx512(float* S, int64_t dk, int64_t dv, __mmask16 last, const float* q,
                                            const float* k, const float* v, const float* decay, int64_t step,
                                            float beta, float* o) {
  __m512 acc[J], delta[J];
  __mmask16 mk[J];
  for (int j = 0; j < J; ++j) {
    acc[j] = _mm512_setzero_ps();
    mk[j] = j + 1 < J ? __mmask16(0xffff) : last;
  }
  for (int64_t r = 0; r < dk; ++r) {
    const __m512 kr = _mm512_set1_ps(k[r]), g = _mm512_set1_ps(decay[r * step]);
    for (int j = 0; j < J; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk[j], S + r * dv + 16 * j), g), kr, acc[j]);
  }
  for (int j = 0; j < J; ++j) {
    delta[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk[j], v + 16 * j), acc[j]), _mm512_set1_ps(beta));
    acc[j] = _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < dk; ++r) {
    const __m512 kr = _mm512_set1_ps(k[r]), qr = _mm512_set1_ps(q[r]), g = _mm512_set1_ps(decay[r * step]);
    float* s = S + r * dv;
    for (int j = 0; j < J; ++j) {
      const __m512 t =
          _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk[j], s + 16 * j), g), _mm512_mul_ps(kr, delta[j]));
      _mm512_mask_storeu_ps(s + 16 * j, mk[j], t);
      acc[j] = _mm512_fmadd_ps(t, qr, acc[j]);
    }
  }
  for (int j = 0; j < J; ++j) _mm512_mask_storeu_ps(o + 16 * j, mk[j], acc[j]);
}

template <typename T>
PDS_AVX512 void delta_avx512(const DeltaStepArgs& a, int64_t b, int64_t h) {
  const int64_t dk = a.dk, dv = a.dv, hk = h / (a.Hv / a.G);
  const float* row = a.qkv + b * a.C;
  alignas(64) float q[kDeltaMaxKeyDim], k[kDeltaMaxKeyDim], o[64];
  l2_normalise_avx512(row + hk * dk, dk, a.scale, true, q);
  l2_normalise_avx512(row + (a.G + hk) * dk, dk, 1.f, false, k);
  const float* v = row + 2 * a.G * dk + h * dv;
  float* S = a.state + (a.slots[b] * a.Hv + h) * dk * dv;
  T* out = static_cast<T*>(a.out) + (b * a.Hv + h) * dv;
  const float* decay = a.decay + (b * a.Hv + h) * a.decay_rows;
  const int64_t step = a.decay_step();
  const float beta = a.beta[b * a.Hv + h];
  for (int64_t c = 0; c < dv; c += 64) {  // 4 vectors of columns: their S^T k, delta and o in registers
    const int64_t n = std::min<int64_t>(64, dv - c);
    const int J = int((n + 15) / 16);
    const __mmask16 last = tail_mask(n - 16 * (J - 1));
    if (J == 4)
      delta_columns_avx512<4>(S + c, dk, dv, last, q, k, v + c, decay, step, beta, o);
    else if (J == 3)
      delta_columns_avx512<3>(S + c, dk, dv, last, q, k, v + c, decay, step, beta, o);
    else if (J == 2)
      delta_columns_avx512<2>(S + c, dk, dv, last, q, k, v + c, decay, step, beta, o);
    else
      delta_columns_avx512<1>(S + c, dk, dv, last, q, k, v + c, decay, step, beta, o);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 mk = tail_mask(n - i);
      store16(out + c + i, _mm512_maskz_loadu_ps(mk, o + i), mk);
    }
  }
}

// ---- prefill scans ------------------------------------------------------------------------------
// channels c0 .. c1 through every token, 16 at a time, their window carried from token to token
template <typename T>
PDS_AVX512 void conv_scan_avx512_rows(const ConvScanArgs& a, int64_t c0, int64_t c1) {
  const int64_t K = a.K, K1 = K - 1;
  const T* x = static_cast<const T*>(a.x);
  T* state = static_cast<T*>(a.state);
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t c = c0; c < c1; c += 16) {
    const int64_t n = std::min<int64_t>(16, c1 - c);
    const __mmask16 mk = tail_mask(n);
    alignas(64) float buf[kConvMaxTaps][16] = {}, wbuf[kConvMaxTaps][16] = {};
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < K1; ++k) buf[k][i] = load_f32(state + (c + i) * K1 + k);
      for (int64_t k = 0; k < K; ++k) wbuf[k][i] = load_f32(w + (c + i) * K + k);
    }
    __m512 win[kConvMaxTaps], wt[kConvMaxTaps];
    for (int64_t k = 0; k < K; ++k) {
      win[k] = _mm512_load_ps(buf[k]);
      wt[k] = _mm512_load_ps(wbuf[k]);
    }
    const __m512 b = bias ? load16(bias + c, mk) : _mm512_setzero_ps();
    for (int64_t t = 0; t < a.n; ++t) {
      win[K1] = load16(x + t * a.x_stride + c, mk);
      __m512 acc = _mm512_mul_ps(win[0], wt[0]);  // taps in order, each product rounded
      for (int64_t k = 1; k < K; ++k) acc = _mm512_add_ps(acc, _mm512_mul_ps(win[k], wt[k]));
      if (bias) acc = _mm512_add_ps(acc, b);
      acc = round16<T>(acc);
      if (a.silu) acc = round16<T>(_mm512_div_ps(acc, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc)))));
      _mm512_mask_storeu_ps(a.out + t * a.C + c, mk, acc);
      for (int64_t k = 0; k < K1; ++k) win[k] = win[k + 1];
    }
    for (int64_t k = 0; k < K1; ++k) _mm512_store_ps(buf[k], win[k]);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K1; ++k) store_f32(state + (c + i) * K1 + k, buf[k][i]);
  }
}

PDS_AVX512 void mamba2_scan_head(const Mamba2ScanArgs& a, int64_t h) {
  const int64_t P = a.P, N = a.N;
  float* S = a.state + h * P * N;
  for (int64_t t = 0; t < a.n; ++t) {
    const float* x = a.xbc + t * a.C + h * P;
    const float* bv = a.xbc + t * a.C + a.H * P + (h / (a.H / a.G)) * N;
    const float* cv = bv + a.G * N;
    const float dt = a.dt[t * a.H + h];
    const __m512 decay = _mm512_set1_ps(std::exp(dt * a.a[h]));
    float* y = a.y + (t * a.H + h) * P;
    for (int64_t p = 0; p < P; ++p) {  // S = S decay + (dt x) B^T, y = S C + D x
      float* s = S + p * N;
      const __m512 u = _mm512_set1_ps(dt * x[p]);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t n = 0; n < N; n += 16) {
        const __mmask16 mk = tail_mask(N - n);
        const __m512 sn = _mm512_fmadd_ps(u, _mm512_maskz_loadu_ps(mk, bv + n),
                                          _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, s + n), decay));
        _mm512_mask_storeu_ps(s + n, mk, sn);
        acc = _mm512_fmadd_ps(sn, _mm512_maskz_loadu_ps(mk, cv + n), acc);
      }
      y[p] = _mm512_reduce_add_ps(acc) + a.d[h] * x[p];
    }
  }
}

// J vectors of columns of value head h from column c (the last masked by `last`) through every token;
// PerRow: a decay per row of S (Kimi Delta Attention), else one per head, applied to S^T k once
template <int J, bool PerRow>
PDS_AVX512 inline void delta_scan_columns(const DeltaScanArgs& a, int64_t h, int64_t c, __mmask16 last) {
  const int64_t dk = a.dk, dv = a.dv, hk = h / (a.Hv / a.G);
  float* S = a.state + h * dk * dv + c;
  alignas(64) float q[kDeltaMaxKeyDim], k[kDeltaMaxKeyDim];
  __mmask16 mk[J];
  for (int j = 0; j < J; ++j) mk[j] = j + 1 < J ? __mmask16(0xffff) : last;
  for (int64_t t = 0; t < a.n; ++t) {
    const float* row = a.qkv + t * a.C;
    l2_normalise_avx512(row + hk * dk, dk, a.scale, true, q);
    l2_normalise_avx512(row + (a.G + hk) * dk, dk, 1.f, false, k);
    const float* v = row + 2 * a.G * dk + h * dv + c;
    alignas(64) float decay[kDeltaMaxKeyDim];
    a.decays(t, h, decay);
    const __m512 beta = _mm512_set1_ps(a.beta[t * a.Hv + h]), g0 = _mm512_set1_ps(decay[0]);
    __m512 acc[J], delta[J];
    for (int j = 0; j < J; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < dk; ++r) {  // S^T k of the decayed state
      const __m512 kr = _mm512_set1_ps(k[r]);
      for (int j = 0; j < J; ++j) {
        const __m512 s = _mm512_maskz_loadu_ps(mk[j], S + r * dv + 16 * j);
        acc[j] = _mm512_fmadd_ps(PerRow ? _mm512_mul_ps(s, _mm512_set1_ps(decay[r])) : s, kr, acc[j]);
      }
    }
    for (int j = 0; j < J; ++j) {  // delta = (v - S^T k) beta
      const __m512 kv = PerRow ? acc[j] : _mm512_mul_ps(acc[j], g0);
      delta[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk[j], v + 16 * j), kv), beta);
      acc[j] = _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < dk; ++r) {  // S = S decay + k delta^T, o = S^T q
      const __m512 kr = _mm512_set1_ps(k[r]), qr = _mm512_set1_ps(q[r]);
      const __m512 g = PerRow ? _mm512_set1_ps(decay[r]) : g0;
      float* s = S + r * dv;
      for (int j = 0; j < J; ++j) {
        const __m512 st = _mm512_fmadd_ps(kr, delta[j], _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[j], s + 16 * j), g));
        _mm512_mask_storeu_ps(s + 16 * j, mk[j], st);
        acc[j] = _mm512_fmadd_ps(st, qr, acc[j]);
      }
    }
    float* o = a.o + (t * a.Hv + h) * dv + c;
    for (int j = 0; j < J; ++j) _mm512_mask_storeu_ps(o + 16 * j, mk[j], acc[j]);
  }
}

template <bool PerRow>
PDS_AVX512 void delta_scan_block(const DeltaScanArgs& a, int64_t h, int64_t c, int J, __mmask16 last) {
  if (J == 4)
    delta_scan_columns<4, PerRow>(a, h, c, last);
  else if (J == 3)
    delta_scan_columns<3, PerRow>(a, h, c, last);
  else if (J == 2)
    delta_scan_columns<2, PerRow>(a, h, c, last);
  else
    delta_scan_columns<1, PerRow>(a, h, c, last);
}

PDS_AVX512 void delta_scan_task(const DeltaScanArgs& a, int64_t task) {
  const int64_t blocks = (a.dv + kScanColumns - 1) / kScanColumns;
  const int64_t h = task / blocks, c = (task % blocks) * kScanColumns;
  const int64_t n = std::min(kScanColumns, a.dv - c);  // 4 vectors, the last masked
  const int J = int((n + 15) / 16);
  const __mmask16 last = tail_mask(n - 16 * (J - 1));
  if (a.g_rows == 1) return delta_scan_block<false>(a, h, c, J, last);
  delta_scan_block<true>(a, h, c, J, last);
}

}  // namespace

template <typename T>
void conv_step_avx512(const ConvStepArgs& a, int64_t b, int64_t c0, int64_t c1) {
  conv_avx512<T>(a, b, c0, c1);
}
template <typename T>
void conv_scan_avx512(const ConvScanArgs& a, int64_t c0, int64_t c1) {
  conv_scan_avx512_rows<T>(a, c0, c1);
}
template <typename T>
void mamba2_heads_avx512(const Mamba2StepArgs& a, int64_t task0, int64_t task1) {
  for (int64_t t = task0; t < task1; ++t) mamba2_avx512<T>(a, t / a.H, t % a.H);
}
template <typename T>
void delta_heads_avx512(const DeltaStepArgs& a, int64_t task0, int64_t task1) {
  for (int64_t t = task0; t < task1; ++t) delta_avx512<T>(a, t / a.Hv, t % a.Hv);
}

void mamba2_scan_avx512(const Mamba2ScanArgs& a, int64_t h0, int64_t h1) {
  for (int64_t h = h0; h < h1; ++h) mamba2_scan_head(a, h);
}
void delta_scan_avx512(const DeltaScanArgs& a, int64_t task0, int64_t task1) {
  for (int64_t t = task0; t < task1; ++t) delta_scan_task(a, t);
}

#define PDS_INSTANTIATE(T)                                                           \
  template void conv_step_avx512<T>(const ConvStepArgs&, int64_t, int64_t, int64_t); \
  template void mamba2_heads_avx512<T>(const Mamba2StepArgs&, int64_t, int64_t);     \
  template void delta_heads_avx512<T>(const DeltaStepArgs&, int64_t, int64_t);       \
  template void conv_scan_avx512<T>(const ConvScanArgs&, int64_t, int64_t);
PDS_INSTANTIATE(float)
PDS_INSTANTIATE(uint16_t)
#undef PDS_INSTANTIATE

}  // namespace pds
#endif
