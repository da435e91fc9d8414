// One task of paged_attention_bf16 (flash_attention.cpp) on AMX tiles: request b, KV head h, up to
// 16 query positions, rows = positions x the G query heads of h.
//
// Keys go in blocks of 64 at fixed positions (0-63, 64-127, ...): a block no key of which a row
// sees leaves that row untouched, so a row's result depends only on its query, position and
// keys, never on which other rows share the task or the call (the AVX-512 kernel starts its blocks
// at the task's first visible key). Per block, as the AVX-512 kernel does, K and V are read from
// their pages into small scratch layouts (there is no tile layout in which both read in place):
//   S = Q K^T   A: Q rows [16 rows][32 dims] (copied once per task, zero padded to 32 dims)
//               B: K pairs transposed, kt[pair p][key t] (16 pairs x 16 keys a tile)
//   online softmax per row in fp32 (the AVX-512 kernel's code and masks: causal, sliding window,
//   sinks as the initial max and sum), P rounded to bf16, the sum over the rounded values
//   O += P V    A: P [16 rows][32 keys]; B: V pairs interleaved, vt[key pair][dim][2]
// with O in memory (up to 256 dims: 16 accumulator tiles, 4 at a time). Rows are padded to a
// multiple of 16 with zero queries whose results are dropped.
#include "amx.h"
#include "attention_span.h"

#include <algorithm>
#include <limits>
#include <memory>

namespace pds {

#if PDS_X86
namespace {

constexpr int kKeys = 64;
constexpr int kMaxD = 256;
constexpr int kMaxRows = 128;  // 16 positions x GQA groups up to 8

struct Scratch {
  alignas(64) uint16_t q[kMaxRows * kMaxD];  // [row][Dp], Dp = D rounded up to 32
  alignas(64) uint32_t kt[kMaxD / 2 * kKeys];  // [pair][key]
  alignas(64) uint16_t vt[kKeys / 2 * kMaxD * 2];  // [key pair][dim][2]
  alignas(64) float s[16 * kKeys];  // one row block's scores
  alignas(64) uint16_t p[kMaxRows * kKeys];  // [row][key] bf16
  alignas(64) float o[kMaxRows * kMaxD];  // [row][dim]
  float m[kMaxRows], l[kMaxRows];
  int32_t pos[kMaxRows], lo[kMaxRows];
  int64_t rows[kKeys];
};

// 16 x 16 transpose of 32-bit elements in place: r[i] is row i on entry, column i on exit
PDS_AMX inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4g + c] now holds, in 128-bit lane L, element 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 2; ++g)
    for (int c = 0; c < 4; ++c) {
      t[8 * g + c] = _mm512_shuffle_i32x4(r[8 * g + c], r[8 * g + 4 + c], 0x88);  // lanes 0, 2 of each
      t[8 * g + 4 + c] = _mm512_shuffle_i32x4(r[8 * g + c], r[8 * g + 4 + c], 0xdd);  // lanes 1, 3
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
  }
}

template <class Tiles, int C, int B>
PDS_AMX inline void score_tile(Tiles& t, const Scratch& s, int64_t kb, int nv) {
  if (C >= nv) return;
  t.template load<B>(s.kt + kb * 16 * kKeys + C * 16, kKeys * 4);
  t.template dpbf16ps<C, 4, B>();
}

template <class Tiles, int C, int B>
PDS_AMX inline void pv_tile(Tiles& t, const Scratch& s, int64_t D, int64_t kp, int64_t c0, int64_t nc) {
  if (c0 + C >= nc) return;
  t.template load<B>(s.vt + kp * 16 * 2 * D + (c0 + C) * 32, D * 4);
  t.template dpbf16ps<C, 4, B>();
}

template <class Tiles, int C>
PDS_AMX inline void o_tile(Tiles& t, Scratch& s, int64_t r0, int64_t c0, int64_t nc, bool store) {
  if (c0 + C >= nc) return;
  float* p = s.o + r0 * kMaxD + (c0 + C) * 16;
  if (store)
    t.template store<C>(p, kMaxD * 4);
  else
    t.template load<C>(p, kMaxD * 4);
}

// the online softmax of row r over the block's scores (s row i): the AVX-512 kernel's arithmetic
PDS_AMX inline void softmax_row(const AmxAttention& a, Scratch& s, int64_t r, int i, int64_t k0, int n, int nv) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int32_t pos = s.pos[r], lo = s.lo[r];
  uint16_t* pr = s.p + r * kKeys;
  const bool full = n == nv * 16 && k0 >= lo && k0 + n - 1 <= pos;
  __mmask16 valid[4];
  __m512 acc[4];
  __m512 mx = neg_inf;
  bool any = full;
  for (int kv = 0; kv < nv; ++kv) {
    acc[kv] = _mm512_load_ps(s.s + i * kKeys + kv * 16);
    if (full) {
      valid[kv] = 0xffff;
    } else {
      const __m512i kpos = _mm512_add_epi32(_mm512_set1_epi32(int32_t(k0 + kv * 16)), lane);
      valid[kv] = _mm512_cmple_epi32_mask(kpos, _mm512_set1_epi32(pos)) &
                  _mm512_cmpge_epi32_mask(kpos, _mm512_set1_epi32(lo)) & tail_mask(n - kv * 16);
      any |= valid[kv] != 0;
    }
    mx = _mm512_mask_max_ps(mx, valid[kv], mx, acc[kv]);
  }
  std::memset(pr + nv * 16, 0, (kKeys - nv * 16) * 2);
  if (!any) {
    std::memset(pr, 0, nv * 16 * 2);
    return;
  }
  const float mb = std::max(s.m[r], _mm512_reduce_max_ps(mx) * a.scale);  // scale > 0
  const __m512 vmb = _mm512_set1_ps(mb), vscale = _mm512_set1_ps(a.scale);
  __m512 psum = _mm512_setzero_ps();
  for (int kv = 0; kv < nv; ++kv) {
    const __m512 e = exp16(_mm512_fmsub_ps(acc[kv], vscale, vmb));
    const __m256i pb = (__m256i)_mm512_cvtneps_pbh(full ? e : _mm512_maskz_mov_ps(valid[kv], e));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pr + kv * 16), pb);
    psum = _mm512_add_ps(psum, bf16x16_to_f32(pb));
  }
  const float alpha = std::exp(s.m[r] - mb);
  s.l[r] = s.l[r] * alpha + _mm512_reduce_add_ps(psum);
  s.m[r] = mb;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < a.D; c += 16)
      _mm512_store_ps(s.o + r * kMaxD + c, _mm512_mul_ps(_mm512_load_ps(s.o + r * kMaxD + c), va));
  }
}

// K and V of keys k0 .. k0 + n into kt and vt
PDS_AMX void load_block(const AmxAttention& a, Scratch& s, int64_t h, const int32_t* pages, int64_t k0, int n) {
  const int64_t D = a.D, P = D / 2;
  int64_t page = k0 / a.page_size, off = k0 % a.page_size;
  for (int j = 0; j < n;) {  // one run of consecutive rows per page
    const int64_t base = (int64_t(pages[page]) * a.kv_heads + h) * a.page_size;
    const int run = int(std::min<int64_t>(a.page_size - off, n - j));
    for (int t = 0; t < run; ++t) s.rows[j + t] = base + off + t;
    j += run;
    off = 0;
    ++page;
  }
  for (int j = n; j < kKeys; ++j) s.rows[j] = s.rows[n - 1];  // padding keys: masked
  const int nv = (n + 15) / 16;
  for (int kv = 0; kv < nv; ++kv)
    for (int64_t pc = 0; pc < P; pc += 16) {
      const __mmask16 mk = tail_mask(P - pc);
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = _mm512_maskz_loadu_epi32(mk, reinterpret_cast<const uint32_t*>(a.k + s.rows[kv * 16 + j] * D) + pc);
      transpose16x16(r);
      for (int w = 0; w < 16 && pc + w < P; ++w) _mm512_store_si512(s.kt + (pc + w) * kKeys + kv * 16, r[w]);
    }
  // V: key pairs of every 32-key tile the block touches, keys past n zero
  const int pairs = (n + 31) / 32 * 16;
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int tp = 0; tp < pairs; ++tp) {
    const bool has0 = 2 * tp < n, has1 = 2 * tp + 1 < n;
    const uint16_t* v0 = a.v + s.rows[std::min(2 * tp, n - 1)] * D;
    const uint16_t* v1 = a.v + s.rows[std::min(2 * tp + 1, n - 1)] * D;
    uint16_t* dst = s.vt + tp * 2 * D;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __mmask32 mk = D - d0 >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (D - d0)) - 1);
      const __m512i x0 = _mm512_maskz_loadu_epi16(has0 ? mk : 0, v0 + d0);
      const __m512i x1 = _mm512_maskz_loadu_epi16(has1 ? mk : 0, v1 + d0);
      _mm512_storeu_si512(dst + 2 * d0, _mm512_permutex2var_epi16(x0, lo_idx, x1));  // dims d0 .. d0 + 15
      if (D - d0 > 16) _mm512_storeu_si512(dst + 2 * d0 + 32, _mm512_permutex2var_epi16(x0, hi_idx, x1));
    }
  }
}

template <class Tiles>
PDS_AMX void task(const AmxAttention& a, Scratch& s, int64_t b, int64_t h, int64_t q0, int64_t nq) {
  Tiles t(full_tiles());
  const int64_t D = a.D, G = a.heads / a.kv_heads, P = D / 2, Dp = (D + 31) / 32 * 32;
  const int64_t nrows = nq * G, nrows_p = (nrows + 15) / 16 * 16, nc = D / 16;
  const int64_t len = a.lens[b], first_row = a.q_starts[b], ext = a.q_starts[b + 1] - first_row;
  for (int64_t r = 0; r < nrows_p; ++r) {
    uint16_t* qr = s.q + r * Dp;
    std::memset(qr, 0, Dp * 2);
    std::memset(s.o + r * kMaxD, 0, D * 4);
    std::memset(s.p + r * kKeys, 0, kKeys * 2);
    if (r >= nrows) continue;
    const int64_t qi = r / G, g = r % G;
    std::memcpy(qr, a.q + (first_row + q0 + qi) * a.q_stride_t + (h * G + g) * a.q_stride_h, D * 2);
    s.pos[r] = int32_t(len - ext + q0 + qi);
    s.lo[r] = int32_t(first_visible_key(s.pos[r], a.window));
    s.m[r] = a.sinks ? a.sinks[h * G + g] : -std::numeric_limits<float>::infinity();
    s.l[r] = a.sinks ? 1.f : 0.f;
  }
  std::memset(s.kt + P * kKeys, 0, (Dp / 2 - P) * kKeys * 4);  // pairs past D
  const int64_t last_pos = s.pos[nrows - 1];
  const int64_t first_key = std::max<int64_t>(0, s.lo[0]);
  const int32_t* pages = a.table + b * a.table_stride;
  for (int64_t k0 = first_key / kKeys * kKeys; k0 <= last_pos; k0 += kKeys) {
    const int n = int(std::min<int64_t>(kKeys, last_pos + 1 - k0));
    const int nv = (n + 15) / 16;
    load_block(a, s, h, pages, k0, n);
    for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
      const int64_t r1 = std::min(nrows, r0 + 16);
      // rows r0 .. r1 see keys [lo, pos]; none of them sees this block: nothing to do
      if (k0 + n - 1 < s.lo[r0] || k0 > s.pos[r1 - 1]) continue;
      t.template zero<0>();
      t.template zero<1>();
      t.template zero<2>();
      t.template zero<3>();
      for (int64_t kb = 0; kb < Dp / 32; ++kb) {
        t.template load<4>(s.q + r0 * Dp + kb * 32, Dp * 2);
        score_tile<Tiles, 0, 6>(t, s, kb, nv);
        score_tile<Tiles, 1, 7>(t, s, kb, nv);
        score_tile<Tiles, 2, 6>(t, s, kb, nv);
        score_tile<Tiles, 3, 7>(t, s, kb, nv);
      }
      t.template store<0>(s.s, kKeys * 4);
      t.template store<1>(s.s + 16, kKeys * 4);
      t.template store<2>(s.s + 32, kKeys * 4);
      t.template store<3>(s.s + 48, kKeys * 4);
      for (int64_t r = r0; r < r1; ++r) softmax_row(a, s, r, int(r - r0), k0, n, nv);
      for (int64_t c0 = 0; c0 < nc; c0 += 4) {
        o_tile<Tiles, 0>(t, s, r0, c0, nc, false);
        o_tile<Tiles, 1>(t, s, r0, c0, nc, false);
        o_tile<Tiles, 2>(t, s, r0, c0, nc, false);
        o_tile<Tiles, 3>(t, s, r0, c0, nc, false);
        for (int64_t kp = 0; kp < (n + 31) / 32; ++kp) {
          t.template load<4>(s.p + r0 * kKeys + kp * 32, kKeys * 2);
          pv_tile<Tiles, 0, 6>(t, s, D, kp, c0, nc);
          pv_tile<Tiles, 1, 7>(t, s, D, kp, c0, nc);
          pv_tile<Tiles, 2, 6>(t, s, D, kp, c0, nc);
          pv_tile<Tiles, 3, 7>(t, s, D, kp, c0, nc);
        }
        o_tile<Tiles, 0>(t, s, r0, c0, nc, true);
        o_tile<Tiles, 1>(t, s, r0, c0, nc, true);
        o_tile<Tiles, 2>(t, s, r0, c0, nc, true);
        o_tile<Tiles, 3>(t, s, r0, c0, nc, true);
      }
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t qi = r / G, g = r % G;
    uint16_t* o = a.out + (first_row + q0 + qi) * a.out_stride_t + (h * G + g) * a.out_stride_h;
    const __m512 inv = _mm512_set1_ps(s.l[r] > 0.f ? 1.f / s.l[r] : 0.f);
    for (int64_t c = 0; c < D; c += 16) store16(o + c, _mm512_mul_ps(_mm512_load_ps(s.o + r * kMaxD + c), inv), 0xffff);
  }
}

}  // namespace

void amx_attention_task(const AmxAttention& a, int64_t b, int64_t h, int64_t q0, int64_t nq, TileBackend tb) {
  TORCH_CHECK(a.D % 16 == 0 && a.D <= kMaxD && nq * (a.heads / a.kv_heads) <= kMaxRows,
              "amx_attention_task: head_dim a multiple of 16 up to 256, at most 128 rows");
  static thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch) scratch.reset(new Scratch);  // not value-initialised: the task writes what it reads
  if (tb == TileBackend::kHardware)
    task<HwTiles>(a, *scratch, b, h, q0, nq);
  else
    task<EmuTiles>(a, *scratch, b, h, q0, nq);
}
#else
void amx_attention_task(const AmxAttention&, int64_t, int64_t, int64_t, int64_t, TileBackend) {
  TORCH_CHECK(false, "AMX kernels are x86-64 only");
}
#endif

}  // namespace pds
