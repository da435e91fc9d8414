// Attention over the paged pool on 8 lanes (AVX2 + FMA, NEON): the paged decode kernel
// (paged_attention.cpp's contract) and the bf16 flash kernel (flash_attention.cpp's contract).
//
// A query-key score is one dot product: 8 lanes of partial sums over head_dim, each in order of
// the dims it holds, then reduce_add's fixed tree; scores of 8 keys come out together
// (reduce_add8). A row's softmax is online, over blocks of keys at fixed positions, and its
// output sums the rows of V in key order. Nothing a row computes depends on the other rows of its
// task or on how its request's rows are split into tasks and forwards: keys a row cannot see add
// exact zeros (skipped), so a decode row and the same row inside a prefill give the same bits.
#include "vec8.h"
#include "attention_span.h"
#include "vec8_kernels.h"


#if PDS_HAS_V8
namespace pds {
namespace {
using namespace v8;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// a row's elements d .. d + 8, or the ones before `end` (Whole: every row has whole vectors)
template <bool Whole, typename T>
PDS_VI F8 load_row(const T* row, int64_t d, int64_t end) {
  return Whole ? load(row + d) : load_upto(row + d, end - d);
}

// r[j] = the dot product of q (float32, zero padded to whole vectors) with key row j (float32, or
// bf16 when KT is uint16_t), over d dims
template <bool Whole, typename KT>
PDS_VI F8 dots8(const float* q, const KT* const* keys, int64_t d) {
  F8 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = zero();
  for (int64_t c = 0; c < d; c += 8) {
    const F8 qc = load(q + c);
    for (int j = 0; j < 8; ++j) acc[j] = fma(qc, load_row<Whole>(keys[j], c, d), acc[j]);
  }
  return reduce_add8(acc);
}

// o[0 .. d) = o * alpha + sum over j < n of p[j] v_j, in j order (v_j = rows[j], d dims)
template <bool Whole, typename VT>
PDS_VI void accumulate_pv(float* o, float alpha, const float* p, const VT* const* rows, int n, int64_t d) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {  // 8 vectors of o in registers at a time
    const int nc = int(std::min<int64_t>(8, (d - c0 + 7) / 8));
    F8 acc[8];
    const F8 va = set1(alpha);
    for (int c = 0; c < nc; ++c) acc[c] = mul(load(o + c0 + 8 * c), va);
    for (int j = 0; j < n; ++j) {
      const F8 w = set1(p[j]);
      for (int c = 0; c < nc; ++c) acc[c] = fma(w, load_row<Whole>(rows[j], c0 + 8 * c, d), acc[c]);
    }
    for (int c = 0; c < nc; ++c) store(o + c0 + 8 * c, acc[c]);
  }
}

// ---- paged decode attention: blocks of 16 keys from the first visible position -----------------
constexpr int kBlock = 16;
constexpr int kMaxD = 256;
constexpr int kMaxGroup = 32;

template <bool Whole, typename KT>
PDS_V8 void decode_tasks(const DecodeArgs& a, int64_t task_begin, int64_t task_end) {
  const int64_t D = a.head_dim, G = a.heads / a.kv_heads, NC = (D + 7) / 8;
  // per query head: the scaled query and the output accumulators, zero padded to NC vectors
  alignas(32) float qs[kMaxGroup * kMaxD];
  alignas(32) float acc[kMaxGroup * kMaxD];
  float m[kMaxGroup], l[kMaxGroup];
  alignas(32) float p[kBlock];
  alignas(32) float ks[kBlock], vs[kBlock];  // a quantized cache's scales of the block's rows
  const KT* krow[kBlock];
  const KT* vrow[kBlock];
  const KT* kc = static_cast<const KT*>(a.k);
  const KT* vc = static_cast<const KT*>(a.v);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    const int64_t len = a.lens[b];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t off = b * a.q_stride_b + (h * G + g) * a.q_stride_h;
      for (int64_t c = 0; c < NC; ++c) {
        const F8 x = a.q_bf16 ? load_upto(static_cast<const uint16_t*>(a.q) + off + 8 * c, D - 8 * c)
                              : load_upto(static_cast<const float*>(a.q) + off + 8 * c, D - 8 * c);
        store(qs + g * kMaxD + 8 * c, mul(x, set1(a.scale)));
      }
      for (int64_t d = 0; d < NC * 8; ++d) acc[g * kMaxD + d] = 0.f;
      m[g] = a.sinks ? a.sinks[h * G + g] : kNegInf;
      l[g] = a.sinks ? 1.f : 0.f;
    }
    const int32_t* pages = a.table + b * a.table_stride;
    const int64_t first = first_visible_key(len - 1, a.window);
    for (int64_t pos = first; pos < len; pos += kBlock) {
      const int n = int(std::min<int64_t>(kBlock, len - pos));
      for (int j = 0; j < kBlock; ++j) {  // past n: the first row again, masked below
        const int64_t t = pos + (j < n ? j : 0);
        const int64_t row = (int64_t(pages[t / a.page_size]) * a.kv_heads + h) * a.page_size + t % a.page_size;
        krow[j] = kc + row * D;
        vrow[j] = vc + row * D;
        if constexpr (kQuantKV<KT>) {
          ks[j] = a.sc.k_at(row);
          vs[j] = a.sc.v_at(row);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        F8 s[2];
        for (int half = 0; half < 2; ++half) {
          F8 d = dots8<Whole>(qs + g * kMaxD, krow + 8 * half, D);
          if constexpr (kQuantKV<KT>) d = mul(d, load(ks + 8 * half));  // q . k = (q . k_raw) k_scale
          s[half] = select(range_mask(8 * half, 0, n - 1, 8), d, set1(kNegInf));
        }
        const float mb = std::max(m[g], std::max(reduce_max(s[0]), reduce_max(s[1])));
        const F8 vmb = set1(mb);
        const F8 p0 = exp(sub(s[0], vmb)), p1 = exp(sub(s[1], vmb));
        store(p, p0);
        store(p + 8, p1);
        const float alpha = std::exp(m[g] - mb);
        l[g] = l[g] * alpha + (reduce_add(p0) + reduce_add(p1));
        m[g] = mb;
        if constexpr (kQuantKV<KT>) {  // p v = (p v_scale) v_raw
          store(p, mul(p0, load(vs)));
          store(p + 8, mul(p1, load(vs + 8)));
        }
        accumulate_pv<Whole>(acc + g * kMaxD, alpha, p, vrow, n, D);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const F8 inv = set1(l[g] > 0.f ? 1.f / l[g] : 0.f);
      const int64_t off = b * a.out_stride_b + (h * G + g) * a.out_stride_h;
      for (int64_t c = 0; c < NC; ++c) {
        const F8 o = mul(load(acc + g * kMaxD + 8 * c), inv);
        if (a.q_bf16)
          store_upto(static_cast<uint16_t*>(a.out) + off + 8 * c, o, D - 8 * c);
        else
          store_upto(static_cast<float*>(a.out) + off + 8 * c, o, D - 8 * c);
      }
    }
  }
}

}  // namespace

template <typename KT>
void decode_attention_vec8(const DecodeArgs& a, int64_t task_begin, int64_t task_end) {
  if (a.head_dim % 8 == 0)
    decode_tasks<true, KT>(a, task_begin, task_end);
  else
    decode_tasks<false, KT>(a, task_begin, task_end);
}
template void decode_attention_vec8<float>(const DecodeArgs&, int64_t, int64_t);
template void decode_attention_vec8<uint16_t>(const DecodeArgs&, int64_t, int64_t);
template void decode_attention_vec8<int8_t>(const DecodeArgs&, int64_t, int64_t);
template void decode_attention_vec8<Fp8E4M3>(const DecodeArgs&, int64_t, int64_t);
template void decode_attention_vec8<Fp8E5M2>(const DecodeArgs&, int64_t, int64_t);

// ---- flash attention (bf16): key blocks of 64 at multiples of 64 --------------------------------
namespace {
constexpr int kKeys = 64;
constexpr int kMaxRows = 16 * 8;  // query positions per task x the largest GQA group
}  // namespace

struct FlashScratchVec8 {
  alignas(32) float kf[kKeys * kMaxD];  // the block's K rows in float32 [key][dim]
  alignas(32) float vf[kKeys * kMaxD];
  alignas(32) float qf[kMaxRows * kMaxD];  // the task's query rows in float32
  alignas(32) float o[kMaxRows * kMaxD];  // output accumulators
  alignas(32) float p[kKeys];
  float m[kMaxRows], l[kMaxRows];
  int32_t pos[kMaxRows];
};

FlashScratchVec8* flash_scratch_vec8() { return new FlashScratchVec8; }
void flash_scratch_free_vec8(FlashScratchVec8* s) { delete s; }

namespace {

PDS_V8 void widen_rows(const uint16_t* src, const int64_t* rows, int n, int64_t D, float* dst) {
  for (int t = 0; t < n; ++t)
    for (int64_t c = 0; c < D; c += 8) store(dst + t * D + c, load(src + rows[t] * D + c));
}

// a quantized cache's rows, dequantized: raw values times their row's (or the layer's) scale
template <typename KT>
PDS_V8 void dequantize_rows(const void* src, const float* row_scales, float scale, const int64_t* rows, int n,
                            int64_t D, float* dst) {
  const KT* base = static_cast<const KT*>(src);
  for (int t = 0; t < n; ++t) {
    const F8 s = set1(row_scales ? row_scales[rows[t]] : scale);
    for (int64_t c = 0; c < D; c += 8) store(dst + t * D + c, mul(load(base + rows[t] * D + c), s));
  }
}

PDS_V8 void widen_kv(const FlashArgs& a, const int64_t* rows, int n, int64_t D, float* kf, float* vf) {
  switch (a.kind) {
    case KVKind::kPlain:
      widen_rows(a.k, rows, n, D, kf);
      return widen_rows(a.v, rows, n, D, vf);
    case KVKind::kInt8:
      dequantize_rows<int8_t>(a.kq, a.sc.k_rows, a.sc.k, rows, n, D, kf);
      return dequantize_rows<int8_t>(a.vq, a.sc.v_rows, a.sc.v, rows, n, D, vf);
    case KVKind::kFp8E4M3:
      dequantize_rows<Fp8E4M3>(a.kq, a.sc.k_rows, a.sc.k, rows, n, D, kf);
      return dequantize_rows<Fp8E4M3>(a.vq, a.sc.v_rows, a.sc.v, rows, n, D, vf);
    case KVKind::kFp8E5M2:
      dequantize_rows<Fp8E5M2>(a.kq, a.sc.k_rows, a.sc.k, rows, n, D, kf);
      return dequantize_rows<Fp8E5M2>(a.vq, a.sc.v_rows, a.sc.v, rows, n, D, vf);
  }
}

PDS_V8 void flash_task(const FlashArgs& a, int64_t b, int64_t h, int64_t q0, int64_t nq, FlashScratchVec8& s) {
  const int64_t D = a.D, G = a.heads / a.kv_heads, nrows = nq * G;
  const int64_t len = a.lens[b];
  const int64_t first_row = a.q_starts[b], ext = a.q_starts[b + 1] - first_row;
  // row r = (query i, head g) at position len - ext + q0 + i
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t i = r / G, g = r % G;
    s.pos[r] = int32_t(len - ext + q0 + i);
    const uint16_t* q = a.q + (first_row + q0 + i) * a.q_stride_t + (h * G + g) * a.q_stride_h;
    for (int64_t c = 0; c < D; c += 8) {
      store(s.qf + r * D + c, load(q + c));
      store(s.o + r * D + c, zero());
    }
    s.m[r] = a.sinks ? a.sinks[h * G + g] : kNegInf;
    s.l[r] = a.sinks ? 1.f : 0.f;
  }
  const int64_t last_pos = s.pos[nrows - 1];
  const int64_t first_key = first_visible_key(s.pos[0], a.window) / kKeys * kKeys;
  const int32_t* pages = a.table + b * a.table_stride;
  int64_t rows[kKeys];
  const float* krow[kKeys];
  const float* vrow[kKeys];
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += kKeys) {
    const int n = int(std::min<int64_t>(kKeys, last_pos + 1 - k0));
    for (int t = 0; t < n; ++t) {
      const int64_t key = k0 + t;
      rows[t] = (int64_t(pages[key / a.page_size]) * a.kv_heads + h) * a.page_size + key % a.page_size;
      krow[t] = s.kf + t * D;
      vrow[t] = s.vf + t * D;
    }
    widen_kv(a, rows, n, D, s.kf, s.vf);
    for (int64_t r = 0; r < nrows; ++r) {
      // keys of this block the row sees: [t0, t1)
      const int64_t lo = first_visible_key(s.pos[r], a.window);
      const int t0 = int(std::max<int64_t>(0, lo - k0)), t1 = int(std::min<int64_t>(n, s.pos[r] - k0 + 1));
      if (t1 <= t0) continue;
      // scores (scaled) of the groups of 8 keys that hold visible ones; the rest of p stays 0
      const int g0 = t0 / 8, g1 = (t1 + 7) / 8;
      F8 sv[kKeys / 8];
      float mx = kNegInf;
      for (int kg = g0; kg < g1; ++kg) {
        const float* k8[8];
        for (int j = 0; j < 8; ++j) k8[j] = krow[std::min(8 * kg + j, n - 1)];
        const M8 visible = range_mask(8 * kg, t0, t1 - 1, 8);
        sv[kg] = select(visible, mul(dots8<true>(s.qf + r * D, k8, D), set1(a.scale)), set1(kNegInf));
        mx = std::max(mx, reduce_max(sv[kg]));
      }
      const float mb = std::max(s.m[r], mx);
      const F8 vmb = set1(mb);
      float sum = 0.f;
      for (int kg = g0; kg < g1; ++kg) {
        const F8 e = exp(sub(sv[kg], vmb));
        store(s.p + 8 * kg, e);
        sum += reduce_add(e);
      }
      const float alpha = std::exp(s.m[r] - mb);
      s.l[r] = s.l[r] * alpha + sum;
      s.m[r] = mb;
      accumulate_pv<true>(s.o + r * D, alpha, s.p + t0, vrow + t0, t1 - t0, D);
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t i = r / G, g = r % G;
    uint16_t* out = a.out + (first_row + q0 + i) * a.out_stride_t + (h * G + g) * a.out_stride_h;
    const F8 inv = set1(s.l[r] > 0.f ? 1.f / s.l[r] : 0.f);
    for (int64_t c = 0; c < D; c += 8) store(out + c, mul(load(s.o + r * D + c), inv));
  }
}

}  // namespace

void flash_task_vec8(const FlashArgs& a, int64_t b, int64_t h, int64_t q0, int64_t nq, FlashScratchVec8& s) {
  flash_task(a, b, h, q0, nq, s);
}

}  // namespace pds
#endif
