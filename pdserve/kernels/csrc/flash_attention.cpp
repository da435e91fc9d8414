// bf16 attention over the paged pool with AVX512-BF16 dot products, for decode and prefill rows.
//
// One task is (request, KV head, block of up to kQueries query positions); its rows are the G
// query heads of that KV head at each position, so K and V are read once for all of them. Keys
// go in blocks of 64, in the layout of a small GEMM:
//   S[r][t] = sum_p (q_r[2p], q_r[2p+1]) . (k_t[2p], k_t[2p+1])   vdpbf16ps, 16 keys per vector
// with K's 32-bit pairs transposed so one vector holds pair p of 16 keys, then an online softmax
// in float32 and
//   O[r][d] += sum_t (p_rt, p_r,t+1) . (v_t[d], v_t+1[d])           vdpbf16ps, 16 dims per vector
// with two V rows interleaved. The probabilities are rounded to bf16 for the second product (as
// GPU flash attention does) and the normaliser sums those rounded values, so the output is an
// exact convex combination of V rows up to float32 accumulation. Causal and sliding-window masks
// apply per row: row at position pos sees keys [pos - window + 1, pos] (window 0: [0, pos]).
// Attention sinks (optional, one float32 logit per query head) add exp(sink) to the softmax's
// denominator only: a row's online softmax starts with max = sink and sum = 1 instead of -inf, 0.
//
// On AMX hosts tasks of at least amx_min_rows rows run on tiles instead (amx_attention.cpp: the
// same per-row arithmetic, key blocks at fixed positions). Without avx512_bf16 the 8-lane kernel
// of attention_vec8.cpp runs (AVX2, NEON): float32 products, key blocks of 64 at fixed positions,
// the same masks and sinks.
//
// A quantized cache (int8, fp8: kv_quant.h) is dequantized block by block as the block's rows are
// staged (rounded to bf16 here, for the bf16 products; float32 in the 8-lane kernel); such calls
// never take the AMX tiles.
#include "amx.h"
#include "attention_span.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

namespace pds {

bool flash_supported(int64_t head_dim);
const float* checked_sinks(const c10::optional<at::Tensor>& sinks, int64_t heads, const char* kernel);
KVScales checked_scales(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scales,
                        const c10::optional<at::Tensor>& v_scales, double k_scale, double v_scale, const char* kernel);
#if PDS_X86
void dequantize_kv_bf16(const FlashArgs& a, const int64_t* rows, int n, int64_t D, uint16_t* kd, uint16_t* vd);
#endif

constexpr int kQueries = 16;  // query positions per task

#if PDS_X86
namespace {

constexpr int kMaxD = 256;
constexpr int kMaxRows = 16 * 8;  // kQueries * (largest GQA group this kernel takes)

// 16x16 transpose of 32-bit elements: r[i] holds row i on entry, column i on exit.
PDS_AVX512_BF16 inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // per 128-bit lane j: u[4g + k] holds element 4j + k of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    // lanes of u[k], u[4 + k], u[8 + k], u[12 + k]: lane j of each is element 4j + k of 4 rows
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);  // lanes 0, 2 of each
    const __m512i b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);  // lanes 1, 3
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(a, c, 0x88);  // element k (lane 0)
    r[8 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);  // element 8 + k (lane 2)
    r[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);  // element 4 + k (lane 1)
    r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);  // element 12 + k (lane 3)
  }
}

// Output dims are accumulated in an interleaved order: within a chunk of 32 dims starting at d0,
// lane 4L + i of the "lo" vector is dim d0 + 8L + i and of the "hi" vector dim d0 + 8L + 4 + i.
// These indices put them back in order (first and second 16 dims of the chunk).
PDS_AVX512_BF16 inline void deinterleave(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  first = _mm512_permutex2var_ps(lo, i0, hi);
  second = _mm512_permutex2var_ps(lo, i1, hi);
}

constexpr int kKeys = 64;  // keys per block: 4 vectors of 16

struct Scratch {
  alignas(64) uint16_t kd[kKeys * kMaxD];  // a quantized cache's block, dequantized to bf16 [key][dim]
  alignas(64) uint16_t vd[kKeys * kMaxD];
  int64_t local[kKeys];  // rows of kd / vd
  alignas(64) uint32_t kt[kMaxD / 2 * kKeys];  // [pair p][key t]
  alignas(64) __m512i vi[kKeys / 2 * (kMaxD / 32) * 2];  // [key pair][chunk][lo, hi]
  alignas(64) float o[kMaxRows * kMaxD];  // accumulators, interleaved dim order
  alignas(64) uint32_t pp[kMaxRows * kKeys / 2];  // bf16 probability pairs [row][key pair]
  float m[kMaxRows], l[kMaxRows];
  int32_t pos[kMaxRows];  // position of each row
  int64_t rows[kKeys];
};

// acc[i][kv] = sum over pairs p of q_i's pair p times kt[p][16 kv .. 16 kv + 15]: 4 query rows x
// 64 keys, every loop bound known at compile time so the 16 sums live in registers
PDS_AVX512_BF16 inline void scores_4x64(const uint32_t* const* qrow, const uint32_t* kt, int64_t P, __m512 (&acc)[4][4]) {
  for (int i = 0; i < 4; ++i)
    for (int kv = 0; kv < 4; ++kv) acc[i][kv] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512i k[4];
    for (int kv = 0; kv < 4; ++kv) k[kv] = _mm512_load_si512(kt + p * kKeys + kv * 16);
    for (int i = 0; i < 4; ++i) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(int32_t(qrow[i][p]));
      for (int kv = 0; kv < 4; ++kv) acc[i][kv] = _mm512_dpbf16_ps(acc[i][kv], qp, (__m512bh)k[kv]);
    }
  }
}

// o[i] += sum over key pairs of p_i's pair times V's interleaved pair, for NR rows x CH chunks
template <int NR, int CH>
PDS_AVX512_BF16 inline void pv_rows(float* o, const uint32_t* pp, const __m512i* vi, int pairs) {
  __m512 acc[NR][CH][2];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < CH; ++c) {
      acc[i][c][0] = _mm512_load_ps(o + i * kMaxD + c * 32);
      acc[i][c][1] = _mm512_load_ps(o + i * kMaxD + c * 32 + 16);
    }
  for (int tp = 0; tp < pairs; ++tp) {
    __m512bh p[NR];
    for (int i = 0; i < NR; ++i) p[i] = (__m512bh)_mm512_set1_epi32(int32_t(pp[i * (kKeys / 2) + tp]));
    for (int c = 0; c < CH; ++c) {
      const __m512i vlo = vi[(tp * CH + c) * 2], vhi = vi[(tp * CH + c) * 2 + 1];
      for (int i = 0; i < NR; ++i) {
        acc[i][c][0] = _mm512_dpbf16_ps(acc[i][c][0], p[i], (__m512bh)vlo);
        acc[i][c][1] = _mm512_dpbf16_ps(acc[i][c][1], p[i], (__m512bh)vhi);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < CH; ++c) {
      _mm512_store_ps(o + i * kMaxD + c * 32, acc[i][c][0]);
      _mm512_store_ps(o + i * kMaxD + c * 32 + 16, acc[i][c][1]);
    }
}

// CH = ceil(D / 32): chunks of 32 output dims, known at compile time so the P V accumulators of
// a group of rows stay in registers
template <int CH>
PDS_AVX512_BF16 void flash_task(const FlashArgs& a, int64_t b, int64_t h, int64_t q0, int64_t nq, Scratch& s) {
  const int64_t D = a.D, G = a.heads / a.kv_heads, P = D / 2;
  const int64_t nrows = nq * G;
  constexpr int64_t chunks = CH;  // V chunks of 32 dims
  const int64_t pchunks = (P + 15) / 16;  // K pair chunks of 16 pairs
  const int64_t len = a.lens[b];
  const int64_t first_row = a.q_starts[b], ext = a.q_starts[b + 1] - first_row;
  // row r = (query i, head g): query position len - ext + q0 + i
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) s.pos[i * G + g] = int32_t(len - ext + q0 + i);
  for (int64_t r = 0; r < nrows; ++r) {
    s.m[r] = a.sinks ? a.sinks[h * G + r % G] : -std::numeric_limits<float>::infinity();
    s.l[r] = a.sinks ? 1.f : 0.f;
    for (int64_t c = 0; c < chunks * 32; c += 16) _mm512_store_ps(s.o + r * kMaxD + c, _mm512_setzero_ps());
  }
  const int64_t last_pos = s.pos[nrows - 1];
  // key blocks start at multiples of kKeys whatever the task's first row, so a row's keys fall into
  // the same blocks (the same online-softmax steps) however the rows of its request are split
  // into tasks and forwards: chunked prefill, a prefix-cache hit and decode give the same bits
  const int64_t first_key = first_visible_key(s.pos[0], a.window) / kKeys * kKeys;
  const int32_t* pages = a.table + b * a.table_stride;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // page and offset of the next key, advanced incrementally (no division per key)
  int64_t page = first_key / a.page_size, off = first_key % a.page_size;
  // A request's KV is a few short runs (one per page and head) scattered over the pool: too short
  // for the hardware prefetcher, so the rows of the next block are prefetched into L2 while this
  // one is computed (and the first block's before it starts).
  const int64_t row_bytes = D * 2;
  auto prefetch_block = [&](int64_t from) {
    int64_t pg = from / a.page_size, of = from % a.page_size;
    const int64_t until = std::min(last_pos + 1, from + kKeys);
    for (int64_t key = from; key < until;) {
      const int64_t run = std::min(a.page_size - of, until - key);  // keys left in this page
      const int64_t row = (int64_t(pages[pg]) * a.kv_heads + h) * a.page_size + of;
      const char* kp = reinterpret_cast<const char*>(a.k + row * D);
      const char* vp = reinterpret_cast<const char*>(a.v + row * D);
      for (int64_t b = 0; b < run * row_bytes; b += 64) {
        _mm_prefetch(kp + b, _MM_HINT_T1);
        _mm_prefetch(vp + b, _MM_HINT_T1);
      }
      key += run;
      of = 0;
      ++pg;
    }
  };
  const bool quant = a.kind != KVKind::kPlain;
  // where the block's K and V rows are read: the pool's rows, or a quantized block's bf16 copy
  const uint16_t* kbase = quant ? s.kd : a.k;
  const uint16_t* vbase = quant ? s.vd : a.v;
  const int64_t* krows = quant ? s.local : s.rows;
  if (!quant) prefetch_block(first_key);
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += kKeys) {
    const int n = int(std::min<int64_t>(kKeys, last_pos + 1 - k0));
    const int nv = (n + 15) / 16;  // key vectors in this block
    if (!quant && k0 + kKeys <= last_pos) prefetch_block(k0 + kKeys);
    for (int j = 0; j < n;) {  // one run of consecutive rows per page
      const int64_t base = (int64_t(pages[page]) * a.kv_heads + h) * a.page_size;
      const int run = int(std::min<int64_t>(a.page_size - off, n - j));
      for (int t = 0; t < run; ++t) s.rows[j + t] = base + off + t;
      j += run;
      off += run;
      if (off == a.page_size) {
        off = 0;
        ++page;
      }
    }
    for (int j = n; j < kKeys; ++j) s.rows[j] = s.rows[n - 1];  // padding keys, masked below
    if (quant) {
      dequantize_kv_bf16(a, s.rows, n, D, s.kd, s.vd);
      for (int j = 0; j < kKeys; ++j) s.local[j] = std::min(j, n - 1);
    }
    // K pairs transposed: kt[p][t]; the score kernel always computes 64 keys, unused ones are zero
    for (int kv = nv; kv < 4; ++kv)
      for (int64_t p = 0; p < P; ++p) _mm512_store_si512(s.kt + p * kKeys + kv * 16, _mm512_setzero_si512());
    for (int kv = 0; kv < nv; ++kv) {
      for (int64_t pc = 0; pc < pchunks; ++pc) {
        const __mmask16 mk = tail_mask(P - pc * 16);
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = _mm512_maskz_loadu_epi32(mk, reinterpret_cast<const uint32_t*>(kbase + krows[kv * 16 + j] * D) + pc * 16);
        transpose16(r);
        for (int w = 0; w < 16 && pc * 16 + w < P; ++w) _mm512_store_si512(s.kt + (pc * 16 + w) * kKeys + kv * 16, r[w]);
      }
    }
    // V rows interleaved by key pair
    const int pairs = (n + 1) / 2;
    for (int tp = 0; tp < pairs; ++tp) {
      const uint16_t* v0 = vbase + krows[2 * tp] * D;
      const uint16_t* v1 = vbase + krows[2 * tp + 1] * D;
      for (int64_t c = 0; c < chunks; ++c) {
        const __mmask32 mk = D - c * 32 >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (D - c * 32)) - 1);
        const __m512i x0 = _mm512_maskz_loadu_epi16(mk, v0 + c * 32);
        const __m512i x1 = _mm512_maskz_loadu_epi16(mk, v1 + c * 32);
        s.vi[(tp * chunks + c) * 2] = _mm512_unpacklo_epi16(x0, x1);
        s.vi[(tp * chunks + c) * 2 + 1] = _mm512_unpackhi_epi16(x0, x1);
      }
    }
    for (int64_t r0 = 0; r0 < nrows; r0 += 4) {
      const int nr = int(std::min<int64_t>(4, nrows - r0));
      // S = Q K^T for 4 rows x 64 keys, in registers (rows past nrows repeat the last one, keys
      // past n are padding; both are dropped below)
      __m512 acc[4][4];
      const uint32_t* qrow[4];
      for (int i = 0; i < 4; ++i) {
        const int64_t r = r0 + std::min(i, nr - 1), qi = r / G, g = r % G;
        qrow[i] = reinterpret_cast<const uint32_t*>(a.q + (first_row + q0 + qi) * a.q_stride_t + (h * G + g) * a.q_stride_h);
      }
      scores_4x64(qrow, s.kt, P, acc);
      // online softmax per row over the block's keys (m is kept in scaled units)
      const __m512 vscale = _mm512_set1_ps(a.scale);
      for (int i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        const int32_t pos = s.pos[r];
        const int32_t lo = int32_t(first_visible_key(pos, a.window));
        // interior block (every key visible to this row): no masks
        const bool full = n == nv * 16 && k0 >= lo && k0 + n - 1 <= pos;
        __mmask16 valid[4];
        __m512 mx = neg_inf;
        bool any = full;
        for (int kv = 0; kv < nv; ++kv) {
          if (full) {
            valid[kv] = 0xffff;
          } else {
            const __m512i kpos = _mm512_add_epi32(_mm512_set1_epi32(int32_t(k0 + kv * 16)), lane);
            valid[kv] = _mm512_cmple_epi32_mask(kpos, _mm512_set1_epi32(pos)) &
                        _mm512_cmpge_epi32_mask(kpos, _mm512_set1_epi32(lo)) & tail_mask(n - kv * 16);
            any |= valid[kv] != 0;
          }
          mx = _mm512_mask_max_ps(mx, valid[kv], mx, acc[i][kv]);
        }
        uint32_t* pr = s.pp + r * (kKeys / 2);
        if (!any) {
          for (int tp = 0; tp < nv * 8; ++tp) pr[tp] = 0;
          continue;
        }
        const float mb = std::max(s.m[r], _mm512_reduce_max_ps(mx) * a.scale);  // scale > 0
        const __m512 vmb = _mm512_set1_ps(mb);
        __m512 psum = _mm512_setzero_ps();
        for (int kv = 0; kv < nv; ++kv) {
          const __m512 e = exp16(_mm512_fmsub_ps(acc[i][kv], vscale, vmb));
          const __m256i pb = (__m256i)_mm512_cvtneps_pbh(full ? e : _mm512_maskz_mov_ps(valid[kv], e));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + kv * 8), pb);
          psum = _mm512_add_ps(psum, bf16x16_to_f32(pb));
        }
        const float alpha = std::exp(s.m[r] - mb);
        s.l[r] = s.l[r] * alpha + _mm512_reduce_add_ps(psum);
        s.m[r] = mb;
        if (alpha != 1.f) {
          const __m512 va = _mm512_set1_ps(alpha);
          for (int64_t c = 0; c < chunks * 32; c += 16)
            _mm512_store_ps(s.o + r * kMaxD + c, _mm512_mul_ps(_mm512_load_ps(s.o + r * kMaxD + c), va));
        }
      }
    }
    // O += P V: RG rows x all CH chunks (lo and hi) of accumulators in registers, 16 at most
    constexpr int RG = CH >= 8 ? 1 : 8 / CH;
    for (int64_t r0 = 0; r0 < nrows; r0 += RG) {
      float* o = s.o + r0 * kMaxD;
      const uint32_t* pr = s.pp + r0 * (kKeys / 2);
      switch (std::min<int64_t>(RG, nrows - r0)) {
        case 1: pv_rows<1, CH>(o, pr, s.vi, pairs); break;
        case 2: pv_rows<(RG >= 2 ? 2 : 1), CH>(o, pr, s.vi, pairs); break;
        case 3: pv_rows<(RG >= 3 ? 3 : 1), CH>(o, pr, s.vi, pairs); break;
        case 4: pv_rows<(RG >= 4 ? 4 : 1), CH>(o, pr, s.vi, pairs); break;
        case 5: pv_rows<(RG >= 5 ? 5 : 1), CH>(o, pr, s.vi, pairs); break;
        case 6: pv_rows<(RG >= 6 ? 6 : 1), CH>(o, pr, s.vi, pairs); break;
        case 7: pv_rows<(RG >= 7 ? 7 : 1), CH>(o, pr, s.vi, pairs); break;
        default: pv_rows<(RG >= 8 ? 8 : 1), CH>(o, pr, s.vi, pairs); break;
      }
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t qi = r / G, g = r % G;
    uint16_t* o = a.out + (first_row + q0 + qi) * a.out_stride_t + (h * G + g) * a.out_stride_h;
    const __m512 inv = _mm512_set1_ps(s.l[r] > 0.f ? 1.f / s.l[r] : 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 first, second;
      deinterleave(_mm512_load_ps(s.o + r * kMaxD + c * 32), _mm512_load_ps(s.o + r * kMaxD + c * 32 + 16), first,
                   second);
      store16(o + c * 32, _mm512_mul_ps(first, inv), tail_mask(D - c * 32));
      if (D - c * 32 > 16) store16(o + c * 32 + 16, _mm512_mul_ps(second, inv), tail_mask(D - c * 32 - 16));
    }
  }
}

}  // namespace
#endif

bool flash_supported(int64_t head_dim) {
  return (use_avx512_bf16() || use_vec8()) && head_dim % 16 == 0 && head_dim <= 256;
}

// Attention of every new token of a batch: request b's rows of q are q_starts[b] .. q_starts[b+1],
// its last tokens at positions seq_lens[b] - (q_starts[b+1] - q_starts[b]) .. seq_lens[b] - 1,
// and its K/V (new tokens included) in the pool pages of page_table[b]. All bf16 but the sinks.
//   q, out: [T, heads, D] (head_dim contiguous); k_cache, v_cache: [pages, kv_heads, page_size, D]
//   sinks: [heads] float32, or none
//   amx_min_rows: tasks of at least this many rows (query positions x GQA group) take AMX where it
//   is used (-1: the process default, see amx.h)
//   k_cache, v_cache may be quantized as paged_decode_attention takes them (int8 with k_scales,
//   v_scales; float8 e4m3fn / e5m2 with k_scale, v_scale)
void paged_attention_bf16(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                          double scale, int64_t window, const c10::optional<at::Tensor>& sinks, int64_t amx_min_rows,
                          const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                          double k_scale, double v_scale) {
  const auto kv_type = k_cache.scalar_type();
  const KVKind kind = kv_type == at::kChar           ? KVKind::kInt8
                      : kv_type == at::kFloat8_e4m3fn ? KVKind::kFp8E4M3
                      : kv_type == at::kFloat8_e5m2   ? KVKind::kFp8E5M2
                                                      : KVKind::kPlain;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  (kv_type == at::kBFloat16 || kind != KVKind::kPlain) && v_cache.scalar_type() == kv_type,
              "paged_attention_bf16: q and out must be bfloat16, the KV cache bfloat16, int8 or float8");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention_bf16: q and out must be [T, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(3) == q.size(2),
              "paged_attention_bf16: k_cache and v_cache must be contiguous [pages, kv_heads, page_size, head_dim]");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  q_starts.scalar_type() == at::kInt && page_table.stride(1) == 1 && seq_lens.is_contiguous() &&
                  q_starts.is_contiguous(),
              "paged_attention_bf16: page_table, seq_lens and q_starts must be int32");
  const int64_t B = seq_lens.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(q_starts.size(0) == B + 1 && page_table.size(0) == B, "paged_attention_bf16: batch sizes differ");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= 8, "paged_attention_bf16: GQA groups of 1 to 8 query heads, got ", H, "/", KVH);
  TORCH_CHECK(flash_supported(D), "paged_attention_bf16: needs AVX2, NEON or avx512_bf16 and head_dim a multiple of 16 "
              "up to 256");
  const float* sink_ptr = checked_sinks(sinks, H, "paged_attention_bf16");
  const int32_t* qs = q_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // tasks: (request, kv head, query block)
  std::vector<int64_t> task_req, task_q0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ext = qs[b + 1] - qs[b];
    TORCH_CHECK(ext >= 0 && ext <= lens[b], "paged_attention_bf16: request ", b, " has ", ext, " new tokens but length ",
                lens[b]);
    TORCH_CHECK(lens[b] <= page_table.size(1) * k_cache.size(2), "paged_attention_bf16: request ", b,
                " is longer than its page table");
    for (int64_t q0 = 0; q0 < ext; q0 += kQueries) {
      task_req.push_back(b);
      task_q0.push_back(q0);
    }
  }
  FlashArgs a{reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
              reinterpret_cast<const uint16_t*>(k_cache.data_ptr()), reinterpret_cast<const uint16_t*>(v_cache.data_ptr()),
              page_table.data_ptr<int32_t>(), lens, qs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
              page_table.stride(0), H, KVH, k_cache.size(2), D, window, float(scale), sink_ptr};
  a.sc = checked_scales(k_cache, k_scales, v_scales, k_scale, v_scale, "paged_attention_bf16");
  if (kind != KVKind::kPlain) {
    a.kind = kind;
    a.kq = k_cache.data_ptr();
    a.vq = v_cache.data_ptr();
  }
  const int64_t ntasks = int64_t(task_req.size()) * KVH;
  if (!use_avx512_bf16()) {  // the 8-lane kernel (AVX2, NEON)
    at::parallel_for(0, ntasks, 1, [&](int64_t begin, int64_t end) {
      std::unique_ptr<FlashScratchVec8, void (*)(FlashScratchVec8*)> scratch(flash_scratch_vec8(), flash_scratch_free_vec8);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t i = t / KVH, b = task_req[i], q0 = task_q0[i];
        flash_task_vec8(a, b, t % KVH, q0, std::min<int64_t>(kQueries, (qs[b + 1] - qs[b]) - q0), *scratch);
      }
    });
    return;
  }
#if PDS_X86
  const int64_t amx_rows = amx_attention_min_rows(amx_min_rows);
  const TileBackend tb = ntasks > 0 && kind == KVKind::kPlain ? amx_backend() : TileBackend::kNone;
  const AmxAttention amx{a.q, a.out, a.k, a.v, a.table, a.lens, a.q_starts, a.q_stride_t, a.q_stride_h, a.out_stride_t,
                         a.out_stride_h, a.table_stride, a.heads, a.kv_heads, a.page_size, a.D, a.window, a.scale,
                         a.sinks};
  at::parallel_for(0, ntasks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<Scratch> scratch;  // not value-initialised: every field is written before use
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / KVH, h = t % KVH;
      const int64_t b = task_req[i], q0 = task_q0[i];
      const int64_t nq = std::min<int64_t>(kQueries, (qs[b + 1] - qs[b]) - q0);
      if (tb != TileBackend::kNone && nq * (H / KVH) >= amx_rows) {
        amx_attention_task(amx, b, h, q0, nq, tb);
        continue;
      }
      if (!scratch) scratch.reset(new Scratch);
      switch ((D + 31) / 32) {
        case 1: flash_task<1>(a, b, h, q0, nq, *scratch); break;
        case 2: flash_task<2>(a, b, h, q0, nq, *scratch); break;
        case 3: flash_task<3>(a, b, h, q0, nq, *scratch); break;
        case 4: flash_task<4>(a, b, h, q0, nq, *scratch); break;
        case 5: flash_task<5>(a, b, h, q0, nq, *scratch); break;
        case 6: flash_task<6>(a, b, h, q0, nq, *scratch); break;
        case 7: flash_task<7>(a, b, h, q0, nq, *scratch); break;
        default: flash_task<8>(a, b, h, q0, nq, *scratch); break;
      }
    }
  });
#else
  (void)amx_min_rows;
#endif
}

// Without sinks (the fused decoder stack's call).
void paged_attention_bf16(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                          double scale, int64_t window) {
  paged_attention_bf16(out, q, k_cache, v_cache, page_table, seq_lens, q_starts, scale, window, c10::nullopt, -1,
                       c10::nullopt, c10::nullopt, 1.0, 1.0);
}

}  // namespace pds
