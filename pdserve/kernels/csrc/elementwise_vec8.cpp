// RMSNorm, rotary embedding and SiLU-mul on 8 lanes (AVX2 / NEON), rounding where HF rounds, as
// elementwise.cpp's other paths do.
#include "vec8.h"
#include "vec8_kernels.h"

#if PDS_HAS_V8
namespace pds {
namespace {
using namespace v8;

template <typename T>
PDS_V8 void rms_rows(T* x, int64_t x_stride, T* res, int64_t res_stride, T* out, int64_t out_stride,
                          const T* w, int64_t H, float eps, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    T* xr = x + i * x_stride;
    T* rr = res ? res + i * res_stride : nullptr;
    F8 ss = zero();
    for (int64_t d = 0; d < H; d += 8) {
      F8 v = load_upto(xr + d, H - d);
      if (rr) {
        v = round_to<T>(add(v, load_upto(rr + d, H - d)));
        store_upto(rr + d, v, H - d);
      }
      ss = fma(v, v, ss);
    }
    const float rstd = 1.f / std::sqrt(reduce_add(ss) / float(H) + eps);
    const F8 vr = set1(rstd);
    const T* src = rr ? rr : xr;
    T* o = out + i * out_stride;
    for (int64_t d = 0; d < H; d += 8) {
      const F8 y = round_to<T>(mul(load_upto(src + d, H - d), vr));
      store_upto(o + d, mul(load_upto(w + d, H - d), y), H - d);
    }
  }
}

template <typename T>
PDS_V8 void rope_rows(T* x, int64_t s_tok, int64_t s_head, int64_t heads, int64_t D, const float* cos,
                           const float* sin, int64_t begin, int64_t end) {
  const int64_t half = D / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t d = 0; d < half; d += 8) {
      const int64_t n = half - d;
      const F8 c1 = round_to<T>(load_upto(c + d, n)), s1 = round_to<T>(load_upto(s + d, n));
      const F8 c2 = round_to<T>(load_upto(c + d + half, n)), s2 = round_to<T>(load_upto(s + d + half, n));
      for (int64_t h = 0; h < heads; ++h) {
        T* r = x + t * s_tok + h * s_head;
        const F8 a = load_upto(r + d, n), b = load_upto(r + d + half, n);
        store_upto(r + d, sub(round_to<T>(mul(a, c1)), round_to<T>(mul(b, s1))), n);
        store_upto(r + d + half, add(round_to<T>(mul(b, c2)), round_to<T>(mul(a, s2))), n);
      }
    }
  }
}

template <typename T>
PDS_V8 void silu_rows(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t I, int64_t begin,
                           int64_t end) {
  const F8 one = set1(1.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* g = in + r * in_stride;
    const T* u = g + I;
    T* o = out + r * out_stride;
    for (int64_t i = 0; i < I; i += 8) {
      const F8 x = load_upto(g + i, I - i);
      const F8 s = round_to<T>(div(x, add(one, exp(sub(zero(), x)))));
      store_upto(o + i, mul(s, load_upto(u + i, I - i)), I - i);
    }
  }
}

}  // namespace

template <typename T>
void rms_rows_vec8(T* x, int64_t x_stride, T* res, int64_t res_stride, T* out, int64_t out_stride, const T* w,
                   int64_t H, float eps, int64_t begin, int64_t end) {
  rms_rows(x, x_stride, res, res_stride, out, out_stride, w, H, eps, begin, end);
}
template <typename T>
void rope_rows_vec8(T* x, int64_t s_tok, int64_t s_head, int64_t heads, int64_t D, const float* cos,
                    const float* sin, int64_t begin, int64_t end) {
  rope_rows(x, s_tok, s_head, heads, D, cos, sin, begin, end);
}
template <typename T>
void silu_rows_vec8(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t I, int64_t begin,
                    int64_t end) {
  silu_rows(in, in_stride, out, out_stride, I, begin, end);
}

#define PDS_INSTANTIATE(T)                                                                                         \
  template void rms_rows_vec8<T>(T*, int64_t, T*, int64_t, T*, int64_t, const T*, int64_t, float, int64_t, int64_t); \
  template void rope_rows_vec8<T>(T*, int64_t, int64_t, int64_t, int64_t, const float*, const float*, int64_t,      \
                                  int64_t);                                                                        \
  template void silu_rows_vec8<T>(const T*, int64_t, T*, int64_t, int64_t, int64_t, int64_t);
PDS_INSTANTIATE(float)
PDS_INSTANTIATE(uint16_t)
#undef PDS_INSTANTIATE

}  // namespace pds
#endif
