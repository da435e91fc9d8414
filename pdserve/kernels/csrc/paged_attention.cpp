// Paged decode attention: one query token per request against that request's KV pages, read in
// place from the pool (no gather), with an online softmax over blocks of 16 tokens.
//
// Pool layout of one layer's K (and V): [num_pages, kv_heads, page_size, head_dim], so the row of
// token `pos` of request b for KV head h is ((table[b][pos / page_size] * kv_heads + h) *
// page_size + pos % page_size). Each task is one (request, KV head): the G = heads / kv_heads
// query heads that share the KV head are computed together, so every K/V row is read once.
//
// Attention sinks (optional, one float32 logit per query head): the softmax gets one more term
// exp(sink) in its denominator and none in the numerator. The online softmax starts from it: the
// running max is the sink and the running sum exp(sink - sink) = 1, instead of -inf and 0.
//
// A quantized cache (int8, fp8: kv_quant.h) is widened to float32 as it is read; its scales
// multiply the block's scores (per key row) and its weights of the value rows, outside the dot
// products.
#include "common.h"
#include "attention_span.h"
#include "kv_quant.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace pds {
namespace {

constexpr int kBlock = 16;  // tokens per softmax block
constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 32;

// Rows (in units of head_dim elements) of positions [pos, pos + n) of request b, KV head h.
inline void block_rows(const DecodeArgs& a, int64_t b, int64_t h, int64_t pos, int n, int64_t* rows) {
  const int32_t* pages = a.table + b * a.table_stride;
  int64_t page = pos / a.page_size, off = pos % a.page_size;
  int64_t base = (int64_t(pages[page]) * a.kv_heads + h) * a.page_size;
  for (int j = 0; j < n; ++j, ++off) {
    if (off == a.page_size) {  // only read the table entry of a page the block reaches
      off = 0;
      base = (int64_t(pages[++page]) * a.kv_heads + h) * a.page_size;
    }
    rows[j] = base + off;
  }
}

inline int64_t first_position(const DecodeArgs& a, int64_t len) {
  return first_visible_key(len - 1, a.window);
}

// Running max and sum of query head `head` before any key: its sink, or nothing.
inline void softmax_start(const DecodeArgs& a, int64_t head, float& m, float& l) {
  m = a.sinks ? a.sinks[head] : -std::numeric_limits<float>::infinity();
  l = a.sinks ? 1.f : 0.f;
}

// ---- portable scalar version ------------------------------------------------------------------
template <typename KT>
void decode_scalar(const DecodeArgs& a, int64_t task_begin, int64_t task_end) {
  const int64_t D = a.head_dim, G = a.heads / a.kv_heads;
  std::vector<float> qf(G * D), acc(G * D), s(G * kBlock), m(G), l(G);
  int64_t rows[kBlock];
  const KT* kc = static_cast<const KT*>(a.k);
  const KT* vc = static_cast<const KT*>(a.v);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    const int64_t len = a.lens[b];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t off = b * a.q_stride_b + (h * G + g) * a.q_stride_h;
      for (int64_t d = 0; d < D; ++d) {
        float x = a.q_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(a.q)[off + d])
                           : static_cast<const float*>(a.q)[off + d];
        qf[g * D + d] = x * a.scale;
        acc[g * D + d] = 0.f;
      }
      softmax_start(a, h * G + g, m[g], l[g]);
    }
    for (int64_t pos = first_position(a, len); pos < len; pos += kBlock) {
      const int n = int(std::min<int64_t>(kBlock, len - pos));
      block_rows(a, b, h, pos, n, rows);
      for (int j = 0; j < n; ++j) {
        const KT* kr = kc + rows[j] * D;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * load_f32(kr + d);
          if constexpr (kQuantKV<KT>) dot *= a.sc.k_at(rows[j]);
          s[g * kBlock + j] = dot;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float mb = m[g];
        for (int j = 0; j < n; ++j) mb = std::max(mb, s[g * kBlock + j]);
        const float alpha = std::exp(m[g] - mb);
        float sum = 0.f;
        for (int j = 0; j < n; ++j) {
          s[g * kBlock + j] = std::exp(s[g * kBlock + j] - mb);
          sum += s[g * kBlock + j];
        }
        l[g] = l[g] * alpha + sum;
        m[g] = mb;
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
      }
      for (int j = 0; j < n; ++j) {
        const KT* vr = vc + rows[j] * D;
        const float vscale = kQuantKV<KT> ? a.sc.v_at(rows[j]) : 1.f;
        for (int64_t g = 0; g < G; ++g) {
          const float p = kQuantKV<KT> ? s[g * kBlock + j] * vscale : s[g * kBlock + j];
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * load_f32(vr + d);
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      const int64_t off = b * a.out_stride_b + (h * G + g) * a.out_stride_h;
      for (int64_t d = 0; d < D; ++d) {
        if (a.q_bf16)
          static_cast<uint16_t*>(a.out)[off + d] = f32_to_bf16(acc[g * D + d] * inv);
        else
          static_cast<float*>(a.out)[off + d] = acc[g * D + d] * inv;
      }
    }
  }
}

// ---- AVX-512 version: NC = ceil(head_dim / 16) chunks of 16 lanes, known at compile time ------
#if PDS_X86
// r[j] = sum of the 16 lanes of v[j], for 16 vectors at once (a transpose-and-add tree instead of
// 16 horizontal reductions).
PDS_AVX512 inline __m512 sum_lanes16(const __m512* v) {
  __m512 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 partial sums of v[2i], 8-15 of v[2i+1]
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit blocks: 4 partial sums each of v[4i..4i+3]
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: 2 partials of v[8i+k] then 2 of v[8i+4+k]
    l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0xEE));
  // block k: the sums of v[k], v[4+k], v[8+k], v[12+k]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
  // lane 4k + m holds v[4m + k]: put v[j] in lane j
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

template <int NC, typename KT>
PDS_AVX512 void decode_avx512(const DecodeArgs& a, int64_t task_begin, int64_t task_end) {
  const int64_t D = a.head_dim, G = a.heads / a.kv_heads;
  const __mmask16 last = tail_mask(D - (NC - 1) * 16);
  alignas(64) float qf[kMaxGroup * NC * 16];
  alignas(64) float acc[kMaxGroup * NC * 16];
  alignas(64) float p[kBlock];
  float m[kMaxGroup], l[kMaxGroup];
  int64_t rows[kBlock];
  const KT* kc = static_cast<const KT*>(a.k);
  const KT* vc = static_cast<const KT*>(a.v);
  const __m512 vscale = _mm512_set1_ps(a.scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    const int64_t len = a.lens[b];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t off = b * a.q_stride_b + (h * G + g) * a.q_stride_h;
      for (int c = 0; c < NC; ++c) {
        const __mmask16 mk = c == NC - 1 ? last : __mmask16(0xffff);
        __m512 x = a.q_bf16 ? load16(static_cast<const uint16_t*>(a.q) + off + c * 16, mk)
                            : load16(static_cast<const float*>(a.q) + off + c * 16, mk);
        _mm512_store_ps(qf + (g * NC + c) * 16, _mm512_mul_ps(x, vscale));
        _mm512_store_ps(acc + (g * NC + c) * 16, _mm512_setzero_ps());
      }
      softmax_start(a, h * G + g, m[g], l[g]);
    }
    for (int64_t pos = first_position(a, len); pos < len; pos += kBlock) {
      const int n = int(std::min<int64_t>(kBlock, len - pos));
      block_rows(a, b, h, pos, n, rows);
      for (int j = n; j < kBlock; ++j) rows[j] = rows[0];  // padding rows, masked out below
      const __mmask16 valid = tail_mask(n);
      __m512 ks = _mm512_set1_ps(1.f), vs = ks;  // a quantized cache's scales of the rows
      if constexpr (kQuantKV<KT>) {
        alignas(64) float kb[kBlock], vb[kBlock];
        for (int j = 0; j < kBlock; ++j) {
          kb[j] = a.sc.k_at(rows[j]);
          vb[j] = a.sc.v_at(rows[j]);
        }
        ks = _mm512_load_ps(kb);
        vs = _mm512_load_ps(vb);
      }
      for (int64_t g = 0; g < G; ++g) {
        // scores of the block's 16 tokens for query head g
        __m512 q[NC], dots[kBlock];
        for (int c = 0; c < NC; ++c) q[c] = _mm512_load_ps(qf + (g * NC + c) * 16);
        for (int j = 0; j < kBlock; ++j) {
          const KT* kr = kc + rows[j] * D;
          __m512 d = _mm512_mul_ps(q[0], load16(kr, NC == 1 ? last : __mmask16(0xffff)));
          for (int c = 1; c < NC; ++c)
            d = _mm512_fmadd_ps(q[c], load16(kr + c * 16, c == NC - 1 ? last : __mmask16(0xffff)), d);
          dots[j] = d;
        }
        __m512 raw = sum_lanes16(dots);
        if constexpr (kQuantKV<KT>) raw = _mm512_mul_ps(raw, ks);
        const __m512 sv = _mm512_mask_mov_ps(neg_inf, valid, raw);
        // online softmax: new running max, rescale what was accumulated, this block's weights
        const float mb = std::max(m[g], _mm512_reduce_max_ps(sv));
        const __m512 pv = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mb))));
        const float alpha = std::exp(m[g] - mb);
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(pv);
        m[g] = mb;
        _mm512_store_ps(p, kQuantKV<KT> ? _mm512_mul_ps(pv, vs) : pv);
        __m512 o[NC];
        const __m512 va = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) o[c] = _mm512_mul_ps(_mm512_load_ps(acc + (g * NC + c) * 16), va);
        for (int j = 0; j < n; ++j) {
          const KT* vr = vc + rows[j] * D;
          const __m512 w = _mm512_set1_ps(p[j]);
          for (int c = 0; c < NC; ++c)
            o[c] = _mm512_fmadd_ps(w, load16(vr + c * 16, c == NC - 1 ? last : __mmask16(0xffff)), o[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_store_ps(acc + (g * NC + c) * 16, o[c]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);
      const int64_t off = b * a.out_stride_b + (h * G + g) * a.out_stride_h;
      for (int c = 0; c < NC; ++c) {
        const __mmask16 mk = c == NC - 1 ? last : __mmask16(0xffff);
        const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc + (g * NC + c) * 16), inv);
        if (a.q_bf16)
          store16(static_cast<uint16_t*>(a.out) + off + c * 16, o, mk);
        else
          store16(static_cast<float*>(a.out) + off + c * 16, o, mk);
      }
    }
  }
}

template <typename KT>
void decode_avx512_dispatch(const DecodeArgs& a, int64_t begin, int64_t end) {
  switch ((a.head_dim + 15) / 16) {
#define PDS_CASE(nc) \
  case nc:           \
    return decode_avx512<nc, KT>(a, begin, end);
    PDS_CASE(1) PDS_CASE(2) PDS_CASE(3) PDS_CASE(4) PDS_CASE(5) PDS_CASE(6) PDS_CASE(7) PDS_CASE(8)
    PDS_CASE(9) PDS_CASE(10) PDS_CASE(11) PDS_CASE(12) PDS_CASE(13) PDS_CASE(14) PDS_CASE(15) PDS_CASE(16)
#undef PDS_CASE
  }
  TORCH_CHECK(false, "paged_decode_attention: head_dim ", a.head_dim, " is not supported");
}
#endif

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

bool is_kv_dtype(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return is_float_or_bf16(t) || s == at::kChar || s == at::kFloat8_e4m3fn || s == at::kFloat8_e5m2;
}

// Runs fn(KT{}) with KT the C++ element type of a cache of `type`.
template <typename Fn>
void with_kv_type(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kBFloat16:
      return fn(uint16_t{});
    case at::kChar:
      return fn(int8_t{});
    case at::kFloat8_e4m3fn:
      return fn(Fp8E4M3{});
    case at::kFloat8_e5m2:
      return fn(Fp8E5M2{});
    default:
      return fn(float{});
  }
}

}  // namespace

// The data of an attention kernel's optional sinks argument after checking it ([heads] float32
// contiguous on the CPU), or nullptr without one. Shared with flash_attention.cpp.
KVScales checked_scales(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scales,
                        const c10::optional<at::Tensor>& v_scales, double k_scale, double v_scale, const char* kernel);

const float* checked_sinks(const c10::optional<at::Tensor>& sinks, int64_t heads, const char* kernel) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& t = *sinks;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(), kernel,
              ": sinks must be a contiguous float32 CPU tensor [heads]");
  TORCH_CHECK(t.size(0) == heads, kernel, ": sinks has ", t.size(0), " values for ", heads, " query heads");
  return t.data_ptr<float>();
}

// out[b, :, :] = softmax(q[b] k^T * scale) v over positions [start, seq_lens[b]) of request b,
// start = max(0, seq_lens[b] - window) when window > 0, else 0; with sinks, the softmax's
// denominator also has exp(sinks[head]).
//   q, out: [B, heads, head_dim] (last dim contiguous), float32 or bfloat16, same dtype
//   k_cache, v_cache: [num_pages, kv_heads, page_size, head_dim] contiguous, float32 or bfloat16
//   page_table: [B, max_pages] int32 (row stride free, last dim contiguous); seq_lens: [B] int32
//   sinks: [heads] float32 contiguous, or none
//   k_cache, v_cache may also be quantized (kv_quant.h): int8 with k_scales, v_scales [num_pages,
//   kv_heads, page_size] float32 (x = q * scale of its row), or float8 e4m3fn / e5m2 with
//   k_scale, v_scale (x = q * scale)
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& page_table, const at::Tensor& seq_lens,
                            double scale, int64_t window, const c10::optional<at::Tensor>& sinks,
                            const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                            double k_scale, double v_scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_decode_attention: q and out must be [B, heads, head_dim]");
  TORCH_CHECK(is_float_or_bf16(q) && out.scalar_type() == q.scalar_type(),
              "paged_decode_attention: q and out must both be float32 or both bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode_attention: head_dim must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_decode_attention: k_cache and v_cache must be contiguous [pages, kv_heads, page_size, head_dim]");
  TORCH_CHECK(is_kv_dtype(k_cache) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: the KV cache must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: page_table and seq_lens must be int32");
  TORCH_CHECK(page_table.dim() == 2 && page_table.stride(1) == 1 && seq_lens.is_contiguous(),
              "paged_decode_attention: bad page_table / seq_lens layout");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D, "paged_decode_attention: head_dim of q (", D, ") and cache (", k_cache.size(3),
              ") differ");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "paged_decode_attention: heads (", H,
              ") must be a multiple of kv_heads (", KVH, ") with at most ", kMaxGroup, " per group");
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, "paged_decode_attention: head_dim must be in [1, ", kMaxHeadDim, "]");
  TORCH_CHECK(page_table.size(0) == B && seq_lens.size(0) == B, "paged_decode_attention: batch sizes differ");
  const float* sink_ptr = checked_sinks(sinks, H, "paged_decode_attention");
  if (B == 0) return;
  DecodeArgs a{q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
               page_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
               q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
               H, KVH, k_cache.size(2), D, window, float(scale), q.scalar_type() == at::kBFloat16, sink_ptr};
  a.sc = checked_scales(k_cache, k_scales, v_scales, k_scale, v_scale, "paged_decode_attention");
  const bool simd = use_avx512(), v8 = use_vec8();
  with_kv_type(k_cache.scalar_type(), [&](auto tag) {
    using KT = decltype(tag);
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
#if PDS_X86
      if (simd) return decode_avx512_dispatch<KT>(a, begin, end);
#endif
      if (v8) return decode_attention_vec8<KT>(a, begin, end);
      decode_scalar<KT>(a, begin, end);
    });
  });
}

// Without sinks (the fused decoder stack's call).
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& page_table, const at::Tensor& seq_lens,
                            double scale, int64_t window) {
  paged_decode_attention(out, q, k_cache, v_cache, page_table, seq_lens, scale, window, c10::nullopt,
                         c10::nullopt, c10::nullopt, 1.0, 1.0);
}

}  // namespace pds
