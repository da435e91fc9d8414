// Fused mixture-of-experts MLP: for every (token, slot) routed to a local expert e,
//   a = act(round(x W13[e]^T + b13[e])), y = round(a W2[e]^T + b2[e]), out[t] = sum_k w[t,k] y[t,k]
// in bf16 (vdpbf16ps) or w8a8_int8 (vpdpbusd), one call for the whole layer.
//
// Steps: the (token, slot) pairs are counting-sorted by expert (ascending pair index within an
// expert, so the order is fixed); work items are (expert, up to kRowChunk of its rows, one weight
// panel), split over the threads by cost; an item runs register tiles of up to kTileRows rows x
// 64 outputs over the panel (read once from memory, then from L2 by the other row tiles). The
// first matmul's panels hold 32 gate and the matching 32 up outputs, so the activation runs on the
// tile's accumulators and only `a` is stored. The second matmul writes each pair's y to its own
// row of a scratch buffer; the combine then sums a token's slots in slot order. Every output is
// one accumulator summed over k in order, written by exactly one item: results do not depend on
// the thread count, the tiling, or which other tokens share the call.
//
// Weight layout (moe_pack_experts, in the row order layers/moe/fused.py gives): per expert,
// panels of 64 outputs, each k step 256 bytes = 4 lines of 16 outputs: bf16 [E, NP, K/2, 4, 16,
// 2] (pairs of k), int8 [E, NP, K/4, 4, 16, 4] (quads of k). W13's panel p holds gate rows
// [32p, 32p+32) then up rows [32p, 32p+32), each half zero padded to a multiple of 32. Biases,
// colsums and scales: float32/int32 [E, NP*64] in panel order. int8 as in int8_gemm.cpp: x
// stored as xq + 128, each sum corrected by 128 colsum.
#include "common.h"
#include "vec8_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

namespace pds {

namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kStep = 256;  // bytes of a panel per k step
constexpr int kTileRows = kMoeTileRows;  // AVX-512: 6 x 4 accumulators + 4 weight vectors of 32 registers
constexpr int64_t kRowChunk = 128;  // rows per item (64 to 512 measured alike)
constexpr int64_t kPrefetchBytes = 2048;

using Act = MoeAct;

// Runs fn(part) for part in [0, parts) side by side: at::parallel_for in a build with OpenMP
// (pdserve's, where torch has it). Without OpenMP at::parallel_for runs the whole range on the
// calling thread, so parts 1.. go to torch's inter-op thread pool while the caller runs part 0.
template <typename Fn>
void run_parts(int64_t parts, const Fn& fn) {
#ifdef INTRA_OP_PARALLEL
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) fn(p);
  });
#else
  if (parts <= 1) {
    if (parts == 1) fn(0);
    return;
  }
  int64_t pending = parts - 1;
  std::mutex m;
  std::condition_variable done;
  for (int64_t p = 1; p < parts; ++p)
    at::launch([&, p] {
      fn(p);
      std::lock_guard<std::mutex> lock(m);
      if (--pending == 0) done.notify_one();
    });
  fn(0);
  std::unique_lock<std::mutex> lock(m);
  done.wait(lock, [&] { return pending == 0; });
#endif
}

// fn(b, e) over [0, n) in at most one contiguous range per thread, ranges of at least `grain`
template <typename Fn>
void parallel_ranges(int64_t n, int64_t grain, const Fn& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(grain, 1)));
  run_parts(parts, [&](int64_t p) { fn(n * p / parts, n * (p + 1) / parts); });
}

// One of the two matmuls over all experts.
struct Gemm {
  const uint8_t* w;  // [E, NP, KS, 256 B]
  int64_t NP, KS;
  const float* bias;  // [E, NP * 64] or null
  const int32_t* colsum;  // int8 only: [E, NP * 64]
  const float* w_scale;  // int8 only: [E, NP * 64]
  const uint32_t* x;  // input rows: bf16 pairs or (int8 + 128) quads, x_stride apart
  int64_t x_stride;
  const float* x_scale;  // int8 only: per input row
  const int32_t* x_row;  // input row of each sorted pair (null: the sorted position itself)
};

// One register tile (vec8_kernels.h): up to kTileRows input rows against a whole panel; float
// results [rows][64] (int8: dequantized). The panel is read from memory by the first tile of an
// item (prefetched into L2 ahead of the reads), from L2 by the others: splitting k into chunks
// that stay in L1 or L2 measured no faster on Zen 4, also at hidden size 7168.
using Tile = MoeTile;

void tile_bf16_scalar(const Tile& t) {
  for (int r = 0; r < t.rows; ++r)
    for (int o = 0; o < kPanel; ++o) {
      float acc = 0.f;
      for (int64_t s = 0; s < t.KS; ++s) {
        const uint32_t xp = t.xr[r][s];
        const uint16_t* w = reinterpret_cast<const uint16_t*>(t.panel + s * kStep) + o * 2;
        acc += bf16_to_f32(uint16_t(xp)) * bf16_to_f32(w[0]) + bf16_to_f32(uint16_t(xp >> 16)) * bf16_to_f32(w[1]);
      }
      t.res[r * kPanel + o] = acc;
    }
}

void tile_int8_scalar(const Tile& t) {
  for (int r = 0; r < t.rows; ++r)
    for (int o = 0; o < kPanel; ++o) {
      int32_t acc = 0;
      for (int64_t s = 0; s < t.KS; ++s) {
        const uint8_t* x = reinterpret_cast<const uint8_t*>(t.xr[r] + s);
        const int8_t* w = reinterpret_cast<const int8_t*>(t.panel + s * kStep) + o * 4;
        for (int e = 0; e < 4; ++e) acc += int32_t(x[e]) * int32_t(w[e]);
      }
      t.res[r * kPanel + o] = float(acc - 128 * t.colsum[o]) * (t.xs[r] * t.w_scale[o]);
    }
}

#if PDS_X86

// baseline SSE: inlines into every target
inline void prefetch_ahead(const uint8_t* step) {
  _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 128, _MM_HINT_T1);
}

template <int R>
PDS_AVX512_BF16 void tile_bf16_dp(const Tile& t) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < t.KS; ++s) {
    const uint8_t* step = t.panel + s * kStep;
    if (t.prefetch) prefetch_ahead(step);
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_load_si512(step + j * 64);
    for (int r = 0; r < R; ++r) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(int32_t(t.xr[r][s]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xp, (__m512bh)wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(t.res + r * kPanel + j * 16, acc[r][j]);
}

// AVX-512 without bf16 dot products: the pair's even and odd k widened to fp32 separately
template <int R>
PDS_AVX512 void tile_bf16_fma(const Tile& t) {
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < t.KS; ++s) {
    const uint8_t* step = t.panel + s * kStep;
    if (t.prefetch) prefetch_ahead(step);
    __m512 even[4], odd[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i wv = _mm512_load_si512(step + j * 64);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(wv, hi));
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t xp = t.xr[r][s];
      const __m512 x0 = _mm512_set1_ps(bf16_to_f32(uint16_t(xp))), x1 = _mm512_set1_ps(bf16_to_f32(uint16_t(xp >> 16)));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(x1, odd[j], _mm512_fmadd_ps(x0, even[j], acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(t.res + r * kPanel + j * 16, acc[r][j]);
}

// the int32 sums of a tile (in place) -> float: (sum - 128 colsum) * x_scale * w_scale
PDS_AVX512 void dequantize_avx512(const Tile& t) {
  for (int j = 0; j < 4; ++j) {
    const __m512i fix = _mm512_slli_epi32(_mm512_loadu_si512(t.colsum + j * 16), 7);
    const __m512 ws = _mm512_loadu_ps(t.w_scale + j * 16);
    for (int r = 0; r < t.rows; ++r) {
      float* p = t.res + r * kPanel + j * 16;
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(p), fix));
      _mm512_store_ps(p, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(t.xs[r]), ws)));
    }
  }
}

template <int R>
PDS_AVX512_VNNI void tile_int8_vnni(const Tile& t) {
  // int32 lanes as the builtin takes them: with __m512i (64-bit lanes) GCC keeps the array in memory
  __v16si acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = __v16si(_mm512_setzero_si512());
  for (int64_t s = 0; s < t.KS; ++s) {
    const uint8_t* step = t.panel + s * kStep;
    if (t.prefetch) prefetch_ahead(step);
    __v16si wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = __v16si(_mm512_load_si512(step + j * 64));
    for (int r = 0; r < R; ++r) {
      const __v16si xv = __v16si(_mm512_set1_epi32(int32_t(t.xr[r][s])));
      for (int j = 0; j < 4; ++j) acc[r][j] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[r][j]), __m512i(xv), __m512i(wv[j])));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_si512(t.res + r * kPanel + j * 16, __m512i(acc[r][j]));
  dequantize_avx512(t);
}

template <template <int> class F>
struct ByRows {
  static void run(const Tile& t) {
    switch (t.rows) {
      case 1: return F<1>::run(t);
      case 2: return F<2>::run(t);
      case 3: return F<3>::run(t);
      case 4: return F<4>::run(t);
      case 5: return F<5>::run(t);
      default: return F<6>::run(t);
    }
  }
};
template <int R> struct DpTile { static void run(const Tile& t) { tile_bf16_dp<R>(t); } };
template <int R> struct FmaTile { static void run(const Tile& t) { tile_bf16_fma<R>(t); } };
template <int R> struct VnniTile { static void run(const Tile& t) { tile_int8_vnni<R>(t); } };
static_assert(kTileRows == 6, "ByRows instantiates tiles of 1..6 rows");

PDS_AVX512 inline __m512 round_bf16(__m512 v) { return bf16x16_to_f32(f32x16_to_bf16(v)); }

PDS_AVX512 inline __m512 activate16(__m512 g, __m512 u, Act act, float alpha, float limit) {
  const __m512 one = _mm512_set1_ps(1.f);
  if (act == Act::kSilu) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
  }
  g = _mm512_min_ps(g, _mm512_set1_ps(limit));
  u = _mm512_min_ps(_mm512_max_ps(u, _mm512_set1_ps(-limit)), _mm512_set1_ps(limit));
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(g, _mm512_set1_ps(alpha))));
  const __m512 glu = _mm512_mul_ps(g, _mm512_div_ps(one, _mm512_add_ps(one, e)));
  return _mm512_mul_ps(_mm512_add_ps(u, one), glu);
}

// first matmul: 32 gate and 32 up results (+ bias) -> 32 values of a
PDS_AVX512 void finish_act_avx512(const float* res, const float* bias, uint16_t* a, Act act, float alpha, float limit) {
  for (int h = 0; h < 2; ++h) {
    __m512 g = _mm512_load_ps(res + 16 * h), u = _mm512_load_ps(res + 32 + 16 * h);
    if (bias) {
      g = _mm512_add_ps(g, _mm512_loadu_ps(bias + 16 * h));
      u = _mm512_add_ps(u, _mm512_loadu_ps(bias + 32 + 16 * h));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 16 * h),
                        f32x16_to_bf16(activate16(round_bf16(g), round_bf16(u), act, alpha, limit)));
  }
}

// second matmul: 64 results (+ bias) -> y, the first n of them
PDS_AVX512 void finish_out_avx512(const float* res, const float* bias, uint16_t* y, int64_t n) {
  for (int j = 0; j < 4 && 16 * j < n; ++j) {
    __m512 v = _mm512_load_ps(res + 16 * j);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
    store16(y + 16 * j, v, tail_mask(n - 16 * j));
  }
}

// out[t] = sum over the token's routed slots, in slot order, of weight * y
PDS_AVX512 void combine_avx512(float* out, const uint16_t* y, const int32_t* ids, const float* w, int64_t K, int64_t H) {
  for (int64_t n = 0; n < H; n += 16) {
    const __mmask16 mk = tail_mask(H - n);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k)
      if (ids[k] >= 0) acc = _mm512_add_ps(acc, _mm512_mul_ps(load16(y + k * H + n, mk), _mm512_set1_ps(w[k])));
    _mm512_mask_storeu_ps(out + n, mk, acc);
  }
}

PDS_AVX512 void quantize_row_avx512(const uint16_t* x, int64_t K, int64_t K4, uint8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + k, tail_mask(K - k))));
  const float mx = _mm512_reduce_max_ps(amax);
  const float s = mx > 0.f ? mx / 127.f : 1.f;
  *scale = s;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  for (int64_t k = 0; k < K4; k += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + k, tail_mask(K - k)), inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i iv = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f)));
    _mm_mask_storeu_epi8(q + k, tail_mask(K4 - k), _mm512_cvtepi32_epi8(_mm512_add_epi32(iv, _mm512_set1_epi32(128))));
  }
}
#endif

float activate(float g, float u, Act act, float alpha, float limit) {
  if (act == Act::kSilu) return g / (1.f + std::exp(-g)) * u;
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
}

inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

void finish_act_scalar(const float* res, const float* bias, uint16_t* a, Act act, float alpha, float limit) {
  for (int i = 0; i < 32; ++i) {
    const float g = res[i] + (bias ? bias[i] : 0.f), u = res[32 + i] + (bias ? bias[32 + i] : 0.f);
    a[i] = f32_to_bf16(activate(round_bf16(g), round_bf16(u), act, alpha, limit));
  }
}

void finish_out_scalar(const float* res, const float* bias, uint16_t* y, int64_t n) {
  for (int64_t o = 0; o < std::min(n, kPanel); ++o) y[o] = f32_to_bf16(res[o] + (bias ? bias[o] : 0.f));
}

void combine_scalar(float* out, const uint16_t* y, const int32_t* ids, const float* w, int64_t K, int64_t H) {
  for (int64_t n = 0; n < H; ++n) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k)
      if (ids[k] >= 0) acc += bf16_to_f32(y[k * H + n]) * w[k];
    out[n] = acc;
  }
}

// per row: scale = max|x| / 127, q = round(x / scale) + 128, zero padded (as 128) to K4
void quantize_row_scalar(const uint16_t* x, int64_t K, int64_t K4, uint8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(bf16_to_f32(x[k])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  *scale = s;
  const float inv = 1.f / s;
  for (int64_t k = 0; k < K4; ++k) {
    const float v = k < K ? std::nearbyint(bf16_to_f32(x[k]) * inv) : 0.f;
    q[k] = uint8_t(int32_t(std::max(-127.f, std::min(127.f, v))) + 128);
  }
}

struct Isa {
  void (*tile)(const Tile&);
  void (*finish_act)(const float*, const float*, uint16_t*, Act, float, float);
  void (*finish_out)(const float*, const float*, uint16_t*, int64_t);
  void (*combine)(float*, const uint16_t*, const int32_t*, const float*, int64_t, int64_t);
  void (*quantize_row)(const uint16_t*, int64_t, int64_t, uint8_t*, float*);
};

Isa pick_isa(bool int8) {
#if PDS_X86
  if (use_avx512()) {
    void (*tile)(const Tile&) = int8 ? (use_avx512_vnni() ? &ByRows<VnniTile>::run : &moe_tile_int8_vec8)
                                     : (use_avx512_bf16() ? &ByRows<DpTile>::run : &ByRows<FmaTile>::run);
    return {tile, &finish_act_avx512, &finish_out_avx512, &combine_avx512, &quantize_row_avx512};
  }
#endif
#if PDS_HAS_V8
  if (use_vec8())
    return {int8 ? &moe_tile_int8_vec8 : &moe_tile_bf16_vec8, &moe_finish_act_vec8, &moe_finish_out_vec8,
            &moe_combine_vec8, &moe_quantize_row_vec8};
#endif
  return {int8 ? &tile_int8_scalar : &tile_bf16_scalar, &finish_act_scalar, &finish_out_scalar, &combine_scalar,
          &quantize_row_scalar};
}

// (token, slot) pairs grouped by expert
struct Routing {
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are sorted[start[e], start[e+1])
  std::vector<int32_t> pair;  // t * K + k, ascending within an expert
  std::vector<int32_t> token;
};

Routing sort_pairs(const int32_t* ids, int64_t T, int64_t K, int64_t E) {
  Routing r;
  r.start.assign(E + 1, 0);
  for (int64_t p = 0; p < T * K; ++p) {
    TORCH_CHECK(ids[p] < E, "moe_experts: ids[", p / K, ", ", p % K, "] = ", ids[p], " but there are ", E,
                " local experts (ids must be in [0, ", E, ") or -1)");
    if (ids[p] >= 0) ++r.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  r.pair.resize(r.start[E]);
  r.token.resize(r.start[E]);
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t p = 0; p < T * K; ++p)
    if (ids[p] >= 0) {
      const int64_t s = fill[ids[p]]++;
      r.pair[s] = int32_t(p);
      r.token[s] = int32_t(p / K);
    }
  return r;
}

struct Item {
  int64_t e, row0, rows, np;
};

// Runs fn(item) for every (expert, row chunk, panel), the items split over the threads in
// contiguous runs of about equal cost (rows plus the weight read, in row equivalents).
template <typename Fn>
void for_items(const Routing& rt, int64_t NP, const Fn& fn) {
  std::vector<Item> items;
  std::vector<int64_t> cost{0};
  for (int64_t e = 0; e + 1 < int64_t(rt.start.size()); ++e)
    for (int64_t r0 = rt.start[e]; r0 < rt.start[e + 1]; r0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, rt.start[e + 1] - r0);
      for (int64_t np = 0; np < NP; ++np) {
        items.push_back({e, r0, rows, np});
        cost.push_back(cost.back() + rows + 8);
      }
    }
  if (items.empty()) return;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), int64_t(items.size()));
  run_parts(parts, [&](int64_t p) {
    const auto lo = std::lower_bound(cost.begin(), cost.end() - 1, cost.back() * p / parts) - cost.begin();
    const auto hi = std::lower_bound(cost.begin(), cost.end() - 1, cost.back() * (p + 1) / parts) - cost.begin();
    for (int64_t i = lo; i < (p + 1 == parts ? int64_t(items.size()) : hi); ++i) fn(items[i]);
  });
}

// The tiles of one item: rows row0 .. row0 + rows (sorted positions) against panel np of expert e;
// done(s, res) gets each row's 64 float results. The first tile streams the panel from memory: as
// many rows as fit, so that the stream meets the most products; the rest (from L2) in tiles of
// equal size (7 rows: 6 + 1, 13: 6 + 4 + 3).
template <typename Done>
void run_item(const Isa& isa, const Gemm& g, const Item& it, const Done& done) {
  alignas(64) float res[kTileRows * kPanel];
  Tile t;
  t.panel = g.w + (it.e * g.NP + it.np) * g.KS * kStep;
  t.KS = g.KS;
  t.colsum = g.colsum ? g.colsum + (it.e * g.NP + it.np) * kPanel : nullptr;
  t.w_scale = g.w_scale ? g.w_scale + (it.e * g.NP + it.np) * kPanel : nullptr;
  t.res = res;
  const int64_t rest = std::max<int64_t>(it.rows - kTileRows, 0), tiles = (rest + kTileRows - 1) / kTileRows;
  for (int64_t i = -1, m0 = 0; m0 < it.rows; ++i, m0 += t.rows) {
    t.rows = int(i < 0 ? std::min<int64_t>(kTileRows, it.rows) : rest / tiles + (i < rest % tiles));
    t.prefetch = m0 == 0;
    for (int r = 0; r < t.rows; ++r) {
      const int64_t s = it.row0 + m0 + r;
      const int64_t row = g.x_row ? g.x_row[s] : s;
      t.xr[r] = g.x + row * g.x_stride;
      t.xs[r] = g.x_scale ? g.x_scale[row] : 1.f;
    }
    isa.tile(t);
    for (int r = 0; r < t.rows; ++r) done(it.row0 + m0 + r, res + r * kPanel);
  }
}

Act parse_act(const std::string& name) {
  if (name == "silu") return Act::kSilu;
  if (name == "swiglu_oai") return Act::kSwigluOai;
  TORCH_CHECK(false, "moe_experts: activation must be \"silu\" or \"swiglu_oai\", got \"", name, "\"");
}

// Both kinds: w13/w2 packed ([E, NP, KS, 4, 16, 2] bf16 or [E, NP, KS, 4, 16, 4] int8).
void moe_impl(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
              const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
              const c10::optional<at::Tensor>& b2, const c10::optional<at::Tensor>* int8_extra /* cs13, s13, cs2, s2 */,
              const std::string& activation, double alpha, double limit) {
  const bool int8 = int8_extra != nullptr;
  const int kg = int8 ? 4 : 2;  // k per step and lane
  const Act act = parse_act(activation);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_experts: x must be a contiguous [T, H] bfloat16 or float32 tensor");
  const int64_t T = x.size(0), H = x.size(1), K = ids.dim() == 2 ? ids.size(1) : -1;
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == T,
              "moe_experts: ids must be a contiguous int32 [T, K] tensor with T = ", T, ", got ", ids.sizes(), " ",
              ids.scalar_type());
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(),
              "moe_experts: weights must be a contiguous float32 tensor shaped like ids ", ids.sizes(), ", got ",
              weights.sizes(), " ", weights.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == T &&
                  out.size(1) == H,
              "moe_experts: out must be a contiguous float32 [", T, ", ", H, "] tensor, got ", out.sizes());
  const auto et = int8 ? at::kChar : at::kBFloat16;
  for (const at::Tensor* w : {&w13, &w2})
    TORCH_CHECK(w->scalar_type() == et && w->dim() == 6 && w->size(3) == 4 && w->size(4) == 16 && w->size(5) == kg &&
                    w->is_contiguous() && reinterpret_cast<uintptr_t>(w->data_ptr()) % 64 == 0,
                "moe_experts: w13 and w2 must be contiguous, 64-byte aligned [E, N/64, K/", kg, ", 4, 16, ", kg, "] ",
                int8 ? "int8" : "bfloat16", " tensors, got ", w->sizes(), " ", w->scalar_type());
  const int64_t E = w13.size(0), NP1 = w13.size(1), KS1 = w13.size(2), NP2 = w2.size(1), KS2 = w2.size(2);
  const int64_t I32 = NP1 * 32;  // a's row: the padded intermediate size
  TORCH_CHECK(w2.size(0) == E && KS1 == (H + kg - 1) / kg && NP2 == (H + kPanel - 1) / kPanel && KS2 * kg <= I32 &&
                  KS2 * kg > I32 - 32,
              "moe_experts: packed w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not agree with hidden size ", H);
  auto check_vec = [&](const c10::optional<at::Tensor>& v, int64_t np, at::ScalarType dt, const char* name) {
    if (!v.has_value()) return;
    TORCH_CHECK(v->scalar_type() == dt && v->is_contiguous() && v->numel() == E * np * kPanel, "moe_experts: ", name,
                " must be contiguous ", dt, " [E, N/64 * 64] = ", E * np * kPanel, " values, got ", v->sizes(), " ",
                v->scalar_type());
  };
  check_vec(b13, NP1, at::kFloat, "b13");
  check_vec(b2, NP2, at::kFloat, "b2");
  if (int8) {
    TORCH_CHECK(int8_extra[0].has_value() && int8_extra[1].has_value() && int8_extra[2].has_value() &&
                    int8_extra[3].has_value(),
                "moe_experts_w8a8: colsums and scales are required");
    check_vec(int8_extra[0], NP1, at::kInt, "w13_colsum");
    check_vec(int8_extra[1], NP1, at::kFloat, "w13_scale");
    check_vec(int8_extra[2], NP2, at::kInt, "w2_colsum");
    check_vec(int8_extra[3], NP2, at::kFloat, "w2_scale");
  }
  if (T == 0) return;
  const Isa isa = pick_isa(int8);
  const Routing rt = sort_pairs(ids.data_ptr<int32_t>(), T, K, E);
  const int64_t P = rt.start[E];

  // first matmul's input: x itself where it is bf16 with whole pairs, else a bf16 copy (zero
  // padded); for int8 quantized per token
  const int64_t xw = KS1 * kg;  // padded row, in elements
  const bool use_x = x.scalar_type() == at::kBFloat16 && (int8 || H % 2 == 0);
  const int64_t xb_stride = use_x ? H : xw + (xw & 1);
  std::vector<uint16_t> xcopy(use_x ? 0 : T * xb_stride, 0);
  if (!use_x)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < H; ++k)
        xcopy[t * xb_stride + k] = x.scalar_type() == at::kBFloat16 ? data<uint16_t>(x)[t * H + k]
                                                                    : f32_to_bf16(data<float>(x)[t * H + k]);
  const uint16_t* xb = use_x ? data<uint16_t>(x) : xcopy.data();
  std::vector<uint8_t> xq;
  std::vector<float> xs;
  Gemm g1{static_cast<const uint8_t*>(w13.data_ptr()), NP1, KS1, b13 ? b13->data_ptr<float>() : nullptr, nullptr, nullptr,
          reinterpret_cast<const uint32_t*>(xb), xb_stride / 2, nullptr, rt.token.data()};
  if (int8) {
    xq.resize(T * xw);
    xs.resize(T);
    parallel_ranges(T, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) isa.quantize_row(xb + t * xb_stride, H, xw, xq.data() + t * xw, &xs[t]);
    });
    g1.colsum = int8_extra[0]->data_ptr<int32_t>();
    g1.w_scale = int8_extra[1]->data_ptr<float>();
    g1.x = reinterpret_cast<const uint32_t*>(xq.data());
    g1.x_stride = xw / 4;
    g1.x_scale = xs.data();
  }

  // a: [P, I32] bf16 by sorted position
  at::Tensor a = at::empty({std::max<int64_t>(P, 1), I32}, at::kBFloat16);
  uint16_t* ap = data<uint16_t>(a);
  const float fa = float(alpha), fl = float(limit);
  for_items(rt, NP1, [&](const Item& it) {
    const float* bias = g1.bias ? g1.bias + (it.e * NP1 + it.np) * kPanel : nullptr;
    run_item(isa, g1, it, [&](int64_t s, const float* res) {
      isa.finish_act(res, bias, ap + s * I32 + it.np * 32, act, fa, fl);
    });
  });

  Gemm g2{static_cast<const uint8_t*>(w2.data_ptr()), NP2, KS2, b2 ? b2->data_ptr<float>() : nullptr, nullptr, nullptr,
          reinterpret_cast<const uint32_t*>(ap), I32 / 2, nullptr, nullptr};
  std::vector<uint8_t> aq;
  std::vector<float> as;
  if (int8) {
    const int64_t aw = KS2 * 4;
    aq.resize(P * aw);
    as.resize(P);
    parallel_ranges(P, 16, [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) isa.quantize_row(ap + s * I32, aw, aw, aq.data() + s * aw, &as[s]);
    });
    g2.colsum = int8_extra[2]->data_ptr<int32_t>();
    g2.w_scale = int8_extra[3]->data_ptr<float>();
    g2.x = reinterpret_cast<const uint32_t*>(aq.data());
    g2.x_stride = aw / 4;
    g2.x_scale = as.data();
  }

  // y: [T * K, H] bf16 by pair (rows of unrouted slots are never read)
  at::Tensor y = at::empty({T * K, H}, at::kBFloat16);
  uint16_t* yp = data<uint16_t>(y);
  for_items(rt, NP2, [&](const Item& it) {
    const float* bias = g2.bias ? g2.bias + (it.e * NP2 + it.np) * kPanel : nullptr;
    run_item(isa, g2, it, [&](int64_t s, const float* res) {
      isa.finish_out(res, bias, yp + int64_t(rt.pair[s]) * H + it.np * kPanel, H - it.np * kPanel);
    });
  });

  const int32_t* idp = ids.data_ptr<int32_t>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_ranges(T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) isa.combine(op + t * H, yp + t * K * H, idp + t * K, wp + t * K, K, H);
  });
}

}  // namespace

// out [E, NP, KS, 4, 16, kg] <- w [E, N, K] (bf16 with kg 2, int8 with kg 4): output row o of a
// panel np is w's row rows[64 np + o] (-1: zeros), k beyond K zero. A lane group (kg elements of
// one row) is 4 contiguous bytes of w.
void moe_pack_experts(at::Tensor out, const at::Tensor& w, const at::Tensor& rows) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && out.dim() == 6 && out.is_contiguous() &&
                  out.scalar_type() == w.scalar_type() && out.size(0) == w.size(0) && out.size(3) == 4 &&
                  out.size(4) == 16 && out.size(5) * w.element_size() == 4 &&
                  out.size(2) == (w.size(2) + out.size(5) - 1) / out.size(5),
              "moe_pack_experts: out ", out.sizes(), " ", out.scalar_type(), " cannot hold w ", w.sizes(), " ",
              w.scalar_type());
  const int64_t N = w.size(1), K = w.size(2), NP = out.size(1), KS = out.size(2), es = w.element_size();
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.is_contiguous() && rows.numel() == NP * kPanel,
              "moe_pack_experts: rows must be int32 [", NP * kPanel, "]");
  const int32_t* map = rows.data_ptr<int32_t>();
  for (int64_t o = 0; o < NP * kPanel; ++o)
    TORCH_CHECK(map[o] < N, "moe_pack_experts: rows[", o, "] = ", map[o], " but w has ", N, " rows");
  const uint8_t* src = static_cast<const uint8_t*>(w.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t whole = K * es / 4;  // k steps with all of their kg elements inside the row
  parallel_ranges(w.size(0) * NP, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint8_t* row[kPanel];  // the panel's 64 source rows (null: zeros), read side by side
      for (int64_t o = 0; o < kPanel; ++o) {
        const int32_t r = map[(i % NP) * kPanel + o];
        row[o] = r < 0 ? nullptr : src + ((i / NP) * N + r) * K * es;
      }
      uint8_t* lane = dst + i * KS * kStep;  // written in order
      for (int64_t s = 0; s < KS; ++s)
        for (int64_t o = 0; o < kPanel; ++o, lane += 4) {
          if (row[o] && s < whole) {
            std::memcpy(lane, row[o] + s * 4, 4);
          } else {
            std::memset(lane, 0, 4);
            if (row[o]) std::memcpy(lane, row[o] + s * 4, std::max<int64_t>(0, K * es - s * 4));
          }
        }
    }
  });
}

// out [T, H] float32 = sum over slots of weights * expert MLP(x), bf16 experts (layout above).
void moe_experts_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w2, c10::optional<at::Tensor> b13,
                      c10::optional<at::Tensor> b2, const std::string& activation, double alpha, double limit) {
  moe_impl(out, x, ids, weights, w13, w2, b13, b2, nullptr, activation, alpha, limit);
}

// The same with int8 experts (per output channel scales) and int8 activations (per row scales).
void moe_experts_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w13_colsum, const at::Tensor& w13_scale,
                      const at::Tensor& w2, const at::Tensor& w2_colsum, const at::Tensor& w2_scale,
                      c10::optional<at::Tensor> b13, c10::optional<at::Tensor> b2, const std::string& activation,
                      double alpha, double limit) {
  const c10::optional<at::Tensor> extra[4] = {w13_colsum, w13_scale, w2_colsum, w2_scale};
  moe_impl(out, x, ids, weights, w13, w2, b13, b2, extra, activation, alpha, limit);
}

}  // namespace pds
