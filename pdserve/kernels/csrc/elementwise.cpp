// The dense per-token parts of a decoder layer, one kernel each instead of five to ten ATen ops:
// RMSNorm (optionally with the residual add before it), rotary embedding of q and k in place, and
// SiLU(gate) * up. Rounding follows HF transformers' eager code step by step: in bfloat16 every
// intermediate that HF rounds to bf16 is rounded here too; statistics are taken in float32.
#include "common.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace pds {
namespace {

#if PDS_X86
template <typename T>
PDS_AVX512 inline __m512 round16(__m512 v);
template <>
PDS_AVX512 inline __m512 round16<float>(__m512 v) { return v; }
template <>
PDS_AVX512 inline __m512 round16<uint16_t>(__m512 v) { return bf16x16_to_f32(f32x16_to_bf16(v)); }
#endif

// ---- RMSNorm -------------------------------------------------------------------------------------
// Per row: if residual: r = round(x + r) (stored back into residual); y = round(w * round(r * rstd)).
template <typename T>
void rms_rows_scalar(T* x, int64_t x_stride, T* res, int64_t res_stride, T* out, int64_t out_stride, const T* w,
                     int64_t H, float eps, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    T* xr = x + i * x_stride;
    T* rr = res ? res + i * res_stride : nullptr;
    float sumsq = 0.f;
    for (int64_t d = 0; d < H; ++d) {
      float v = load_f32(xr + d);
      if (rr) {
        v = round_to<T>(v + load_f32(rr + d));
        store_f32(rr + d, v);
      }
      sumsq += v * v;
    }
    const float rstd = 1.f / std::sqrt(sumsq / float(H) + eps);
    const T* src = rr ? rr : xr;
    T* o = out + i * out_stride;
    for (int64_t d = 0; d < H; ++d) store_f32(o + d, load_f32(w + d) * round_to<T>(load_f32(src + d) * rstd));
  }
}

#if PDS_X86
template <typename T>
PDS_AVX512 void rms_rows_avx512(T* x, int64_t x_stride, T* res, int64_t res_stride, T* out, int64_t out_stride,
                                const T* w, int64_t H, float eps, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    T* xr = x + i * x_stride;
    T* rr = res ? res + i * res_stride : nullptr;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < H; d += 16) {
      const __mmask16 mk = tail_mask(H - d);
      __m512 v = load16(xr + d, mk);
      if (rr) {
        v = round16<T>(_mm512_add_ps(v, load16(rr + d, mk)));
        store16(rr + d, v, mk);
      }
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float rstd = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / float(H) + eps);
    const __m512 vr = _mm512_set1_ps(rstd);
    const T* src = rr ? rr : xr;
    T* o = out + i * out_stride;
    for (int64_t d = 0; d < H; d += 16) {
      const __mmask16 mk = tail_mask(H - d);
      const __m512 y = round16<T>(_mm512_mul_ps(load16(src + d, mk), vr));
      store16(o + d, _mm512_mul_ps(load16(w + d, mk), y), mk);
    }
  }
}
#endif

template <typename T>
void rms_norm_impl(at::Tensor& out, at::Tensor& x, at::Tensor* residual, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), H = x.size(1);
  T* xp = data<T>(x);
  T* rp = residual ? data<T>(*residual) : nullptr;
  const int64_t rs = residual ? residual->stride(0) : 0;
  T* op = data<T>(out);
  const T* wp = data<T>(w);
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (simd) return rms_rows_avx512<T>(xp, x.stride(0), rp, rs, op, out.stride(0), wp, H, eps, b, e);
#endif
    if (v8) return rms_rows_vec8<T>(xp, x.stride(0), rp, rs, op, out.stride(0), wp, H, eps, b, e);
    rms_rows_scalar<T>(xp, x.stride(0), rp, rs, op, out.stride(0), wp, H, eps, b, e);
  });
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, "rms_norm: ", name,
              " must be a CPU [rows, hidden] tensor with contiguous rows");
  TORCH_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), "rms_norm: ", name,
              " must match x in shape and dtype");
}

// ---- rotary embedding (rotate-half convention) -----------------------------------------------------
// x[d] <- x[d] * cos[d] - x[d + D/2] * sin[d]          (d < D/2)
// x[d] <- x[d] * cos[d] + x[d - D/2] * sin[d]          (d >= D/2)
// each product and the sum rounded to T, with cos/sin first rounded to T (as HF does).
template <typename T>
void rope_rows_scalar(T* x, int64_t s_tok, int64_t s_head, int64_t heads, int64_t D, const float* cos,
                      const float* sin, int64_t begin, int64_t end) {
  const int64_t half = D / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      T* r = x + t * s_tok + h * s_head;
      for (int64_t d = 0; d < half; ++d) {
        const float a = load_f32(r + d), b = load_f32(r + d + half);
        const float c1 = round_to<T>(c[d]), s1 = round_to<T>(s[d]);
        const float c2 = round_to<T>(c[d + half]), s2 = round_to<T>(s[d + half]);
        store_f32(r + d, round_to<T>(a * c1) - round_to<T>(b * s1));
        store_f32(r + d + half, round_to<T>(b * c2) + round_to<T>(a * s2));
      }
    }
  }
}

#if PDS_X86
template <typename T>
PDS_AVX512 void rope_rows_avx512(T* x, int64_t s_tok, int64_t s_head, int64_t heads, int64_t D, const float* cos,
                                 const float* sin, int64_t begin, int64_t end) {
  const int64_t half = D / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t d = 0; d < half; d += 16) {
      const __mmask16 mk = tail_mask(half - d);
      const __m512 c1 = round16<T>(_mm512_maskz_loadu_ps(mk, c + d));
      const __m512 s1 = round16<T>(_mm512_maskz_loadu_ps(mk, s + d));
      const __m512 c2 = round16<T>(_mm512_maskz_loadu_ps(mk, c + d + half));
      const __m512 s2 = round16<T>(_mm512_maskz_loadu_ps(mk, s + d + half));
      for (int64_t h = 0; h < heads; ++h) {
        T* r = x + t * s_tok + h * s_head;
        const __m512 a = load16(r + d, mk), b = load16(r + d + half, mk);
        const __m512 lo = _mm512_sub_ps(round16<T>(_mm512_mul_ps(a, c1)), round16<T>(_mm512_mul_ps(b, s1)));
        const __m512 hi = _mm512_add_ps(round16<T>(_mm512_mul_ps(b, c2)), round16<T>(_mm512_mul_ps(a, s2)));
        store16(r + d, lo, mk);
        store16(r + d + half, hi, mk);
      }
    }
  }
}
#endif

template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T_ = x.size(0), heads = x.size(1), D = x.size(2);
  T* xp = data<T>(x);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (simd) return rope_rows_avx512<T>(xp, x.stride(0), x.stride(1), heads, D, cp, sp, b, e);
#endif
    if (v8) return rope_rows_vec8<T>(xp, x.stride(0), x.stride(1), heads, D, cp, sp, b, e);
    rope_rows_scalar<T>(xp, x.stride(0), x.stride(1), heads, D, cp, sp, b, e);
  });
}

// ---- SiLU(gate) * up --------------------------------------------------------------------------------
// out[i] = round(round(silu(gate[i])) * up[i]) with gate = gate_up[:, :I], up = gate_up[:, I:].
template <typename T>
void silu_rows_scalar(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t I, int64_t begin,
                      int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = in + r * in_stride;
    const T* u = g + I;
    T* o = out + r * out_stride;
    for (int64_t i = 0; i < I; ++i) {
      const float x = load_f32(g + i);
      store_f32(o + i, round_to<T>(x / (1.f + std::exp(-x))) * load_f32(u + i));
    }
  }
}

#if PDS_X86
template <typename T>
PDS_AVX512 void silu_rows_avx512(const T* in, int64_t in_stride, T* out, int64_t out_stride, int64_t I,
                                 int64_t begin, int64_t end) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* g = in + r * in_stride;
    const T* u = g + I;
    T* o = out + r * out_stride;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 mk = tail_mask(I - i);
      const __m512 x = load16(g + i, mk);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 s = round16<T>(_mm512_div_ps(x, _mm512_add_ps(one, e)));
      store16(o + i, _mm512_mul_ps(s, load16(u + i, mk)), mk);
    }
  }
}
#endif

template <typename T>
void silu_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), I = out.size(1);
  const T* ip = data<T>(gate_up);
  T* op = data<T>(out);
  const bool simd = use_avx512(), v8 = use_vec8();
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
#if PDS_X86
    if (simd) return silu_rows_avx512<T>(ip, gate_up.stride(0), op, out.stride(0), I, b, e);
#endif
    if (v8) return silu_rows_vec8<T>(ip, gate_up.stride(0), op, out.stride(0), I, b, e);
    silu_rows_scalar<T>(ip, gate_up.stride(0), op, out.stride(0), I, b, e);
  });
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 tensors only, got ", t.scalar_type());
}

}  // namespace

// out = RMSNorm(x) * weight; or, with residual: residual += x, out = RMSNorm(residual) * weight.
// out may be x itself.
void rms_norm(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& weight,
              double eps) {
  check_dtype(x, "rms_norm");
  check_rows(out, "out", x);
  check_rows(x, "x", x);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [hidden] in x's dtype");
  at::Tensor* rp = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "residual", x);
    rp = &residual.value();
  }
  if (is_bf16(x))
    rms_norm_impl<uint16_t>(out, x, rp, weight, float(eps));
  else
    rms_norm_impl<float>(out, x, rp, weight, float(eps));
}

// q: [T, heads, D], k: [T, kv_heads, D] (last dim contiguous), rotated in place; cos/sin: [T, D] float32.
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(q, "rotary_embedding");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  q.scalar_type() == k.scalar_type(),
              "rotary_embedding: q and k must be [T, heads, head_dim] of one dtype with contiguous head_dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "rotary_embedding: cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(cos.size(0) == q.size(0) && k.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                  k.size(2) == q.size(2) && q.size(2) % 2 == 0,
              "rotary_embedding: shapes of q ", q.sizes(), ", k ", k.sizes(), ", cos ", cos.sizes(), " do not agree");
  if (is_bf16(q)) {
    rope_impl<uint16_t>(q, cos, sin);
    rope_impl<uint16_t>(k, cos, sin);
  } else {
    rope_impl<float>(q, cos, sin);
    rope_impl<float>(k, cos, sin);
  }
}

// out: [T, I]; gate_up: [T, 2 I] (gate first). Rows contiguous.
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_dtype(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.stride(1) == 1 && out.stride(1) == 1 &&
                  gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) &&
                  out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul: expected gate_up [T, 2I] and out [T, I] of one dtype");
  if (is_bf16(out))
    silu_impl<uint16_t>(out, gate_up);
  else
    silu_impl<float>(out, gate_up);
}

}  // namespace pds
