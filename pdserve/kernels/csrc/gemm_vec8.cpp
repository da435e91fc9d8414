// linear_f32 and linear_vnni (bf16 weights) on 8 lanes (AVX2 + FMA, NEON).
//
// Both sum every output over k in order, one fused multiply-add per k, in float32: the float32
// kernel gives the bits of the scalar loop (std::fma) and of the AVX-512 tiles; the bf16 one those
// of the AVX-512 FMA tiles (gemv.cpp's tile_fma), whatever the rows in the call.
//
// Register tiles are R rows x 16 outputs (2 vectors): 6 x 16 is 12 accumulators, 2 weight
// vectors and a broadcast of x, within the 16 registers of AVX2 (NEON: 16 pairs). A panel's 64
// outputs are 4 such column blocks.
// - float32 (weights [NP, K, 64]): the column block of a panel is read per row tile, rows in
//   blocks of kRowBlock whose x stays in cache across the panels.
// - bf16 with few rows (decode): the packed pairs are widened in registers as they stream in
//   (one row: all 64 outputs per step, the panel read once; 2 rows: 32; 3-4 rows: 16).
// - bf16 with more rows (prefill): a chunk of kChunkPairs k-pairs of a panel is widened once into
//   a float32 buffer [2 kc][64] and the float32 tiles run on it, partial sums carried between
//   chunks in float32 (exact: the same sums as one pass).
// - bf16 on Arm with BFDOT (neon_bf16): one BFDOT per pair of k and 4 outputs, x as bf16 pairs, at
//   every row count (its rounding of the pair differs from two FMAs: one kind of step for all rows).
#include "vec8.h"
#include "vec8_kernels.h"

#include <vector>

#if PDS_HAS_V8
namespace pds {
namespace {
using namespace v8;

constexpr int64_t kPanel = 64;
constexpr int kTileRows = 6;
constexpr int64_t kRowBlock = 96;
constexpr int64_t kChunkPairs = 128;  // 256 k: a widened chunk of a panel is 64 KiB
constexpr int64_t kStreamRows = 16;  // up to this many rows, bf16 pairs are widened in registers

// acc[r] += sum over k < kn of x[r][k] w[k][0 .. 16), in k order; x rows xs apart, w rows ws apart
template <int R>
PDS_VI void tile16(const float* x, int64_t xs, const float* w, int64_t ws, int64_t kn, F8 (&acc)[R][2]) {
  for (int64_t k = 0; k < kn; ++k) {
    const F8 w0 = load(w + k * ws), w1 = load(w + k * ws + 8);
    for (int r = 0; r < R; ++r) {
      const F8 xv = set1(x[r * xs + k]);
      acc[r][0] = fma(xv, w0, acc[r][0]);
      acc[r][1] = fma(xv, w1, acc[r][1]);
    }
  }
}

// out[r][n0 .. n0 + min(16, N - n0)) = acc[r] + bias
template <typename T, int R>
PDS_VI void store16(const F8 (&acc)[R][2], const T* bias, T* out, int64_t out_stride, int64_t n0, int64_t N) {
  const int64_t n = std::min<int64_t>(16, N - n0);
  for (int h = 0; h < 2 && 8 * h < n; ++h) {
    const F8 b = bias ? load_upto(bias + n0 + 8 * h, n - 8 * h) : zero();
    for (int r = 0; r < R; ++r) store_upto(out + r * out_stride + n0 + 8 * h, add(acc[r][h], b), n - 8 * h);
  }
}

// ---- float32 ------------------------------------------------------------------------------------
template <int R>
PDS_V8 void f32_tile(const F32Args& a, int64_t np, int64_t j, int64_t m0) {
  F8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  tile16<R>(a.x + m0 * a.x_stride, a.x_stride, a.w + np * a.K * kPanel + 16 * j, kPanel, a.K, acc);
  store16<float, R>(acc, a.bias, a.out + m0 * a.out_stride, a.out_stride, np * kPanel + 16 * j, a.N);
}

void f32_rows(const F32Args& a, int64_t np, int64_t j, int64_t m0, int rows) {
  switch (rows) {
    case 1: return f32_tile<1>(a, np, j, m0);
    case 2: return f32_tile<2>(a, np, j, m0);
    case 3: return f32_tile<3>(a, np, j, m0);
    case 4: return f32_tile<4>(a, np, j, m0);
    case 5: return f32_tile<5>(a, np, j, m0);
    default: return f32_tile<6>(a, np, j, m0);
  }
}

// ---- bf16, few rows: widened in registers --------------------------------------------------------
// The panel goes in chunks of kStreamPairs pair steps (16 KiB, in L1): the first pass over a chunk
// reads it from memory, prefetching whole steps ahead (the stream stays sequential whatever the
// tile shape), the others from L1; tiles of rows x lines of 16 outputs carry their sums between
// chunks in `carry` [M][64].
constexpr int64_t kStreamPairs = 64;

// the sums of a tile of rows m0 .. m0 + R, lines j0 .. j0 + J of panel np: to `carry` [M][64] when
// more k follows, else (+ bias) to out
template <int R, int J>
PDS_VI void finish_tile(const GemvArgs& a, const F8 (&acc)[R][2 * J], int64_t np, int j0, int64_t m0, float* carry,
                        bool last) {
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * J; ++c) store(carry + (m0 + r) * kPanel + j0 * 16 + c * 8, acc[r][c]);
    return;
  }
  for (int j = 0; j < J; ++j) {
    F8 part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = acc[r][2 * j], part[r][1] = acc[r][2 * j + 1];
    const int64_t n0 = np * kPanel + (j0 + j) * 16;
    if (n0 >= a.N) break;
    if (a.out_bf16)
      store16<uint16_t, R>(part, static_cast<const uint16_t*>(a.bias), static_cast<uint16_t*>(a.out) + m0 * a.out_stride,
                           a.out_stride, n0, a.N);
    else
      store16<float, R>(part, static_cast<const float*>(a.bias), static_cast<float*>(a.out) + m0 * a.out_stride,
                        a.out_stride, n0, a.N);
  }
}

template <int R, int J>
PDS_VI void start_tile(F8 (&acc)[R][2 * J], int j0, int64_t m0, const float* carry, bool first) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * J; ++c) acc[r][c] = first ? zero() : load(carry + (m0 + r) * kPanel + j0 * 16 + c * 8);
}

template <int R, int J>
PDS_V8 void stream_tile(const GemvArgs& a, const float* const* x, int64_t np, int64_t kp0, int64_t kp1, int j0,
                        int64_t m0, float* carry, bool streams) {
  const uint16_t* panel = a.w + np * a.KP * 128;
  F8 acc[R][2 * J];
  start_tile<R, J>(acc, j0, m0, carry, kp0 == 0);
  if (streams)
    pair_panel_tile<R, J, true>(x + m0, panel, kp0, kp1, j0, acc);
  else
    pair_panel_tile<R, J, false>(x + m0, panel, kp0, kp1, j0, acc);
  finish_tile<R, J>(a, acc, np, j0, m0, carry, kp1 == a.KP);
}

// tile(a, x rows, np, kp0, kp1, j0, m0, carry, streams)
template <typename X>
using StreamTile = void (*)(const GemvArgs&, const X* const*, int64_t, int64_t, int64_t, int, int64_t, float*, bool);

// Every row, every panel of np0 .. np1, chunk by chunk: one row takes all 64 outputs in one pass,
// two rows halves, more rows lines of 16 outputs in tiles of up to kMaxLineRows rows, as even as
// can be (7 = 4 + 3 for 5 at most)
template <typename X, int kMaxLineRows>
void stream_panels(const GemvArgs& a, const X* const* x, int64_t np0, int64_t np1, float* carry, StreamTile<X> one,
                   StreamTile<X> two, const StreamTile<X>* line) {
  const int64_t tiles = (a.M + kMaxLineRows - 1) / kMaxLineRows;
  for (int64_t np = np0; np < np1; ++np)
    for (int64_t kp0 = 0; kp0 < a.KP; kp0 += kStreamPairs) {
      const int64_t kp1 = std::min(a.KP, kp0 + kStreamPairs);
      if (a.M == 1) {
        one(a, x, np, kp0, kp1, 0, 0, carry, true);
      } else if (a.M == 2) {
        two(a, x, np, kp0, kp1, 0, 0, carry, true);
        two(a, x, np, kp0, kp1, 2, 0, carry, false);
      } else {
        for (int j = 0; j < 4; ++j)
          for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
            const int64_t rows = a.M / tiles + (t < a.M % tiles);
            line[rows](a, x, np, kp0, kp1, j, m0, carry, j == 0 && m0 == 0);
            m0 += rows;
          }
      }
    }
}

void bf16_stream(const GemvArgs& a, const float* const* x, int64_t np0, int64_t np1, float* carry) {
  // 5 rows x 2 vectors: 10 accumulators, the line's 4 vectors and a broadcast
  static const StreamTile<float> line[6] = {nullptr, &stream_tile<1, 1>, &stream_tile<2, 1>, &stream_tile<3, 1>,
                                            &stream_tile<4, 1>, &stream_tile<5, 1>};
  stream_panels<float, 5>(a, x, np0, np1, carry, &stream_tile<1, 4>, &stream_tile<2, 2>, line);
}

#if PDS_ARM
// ---- bf16 on Arm's BFDOT (neon_bf16): both k of a pair in one instruction, at every row count ----
// acc[r][q] (4 outputs) += (x[r][2 kp], x[r][2 kp + 1]) . (w[o][2 kp], w[o][2 kp + 1]): the panel's
// lines as they are (a 128-bit register is 4 outputs x one pair), x as bf16 pairs
template <int R, int J>
PDS_NEON_BF16 void bfdot_tile(const GemvArgs& a, const uint32_t* const* x, int64_t np, int64_t kp0, int64_t kp1,
                              int j0, int64_t m0, float* carry, bool streams) {
  const uint16_t* panel = a.w + np * a.KP * 128;
  F8 acc[R][2 * J];
  start_tile<R, J>(acc, j0, m0, carry, kp0 == 0);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const uint16_t* step = panel + kp * 128 + j0 * 32;
    if (streams)
      for (int l = 0; l < 4; ++l) prefetch(panel + kp * 128 + (J == 1 ? 4096 : 3072) + l * 32);
    bfloat16x8_t w[4 * J];
    for (int q = 0; q < 4 * J; ++q) w[q] = vreinterpretq_bf16_u16(vld1q_u16(step + 8 * q));
    for (int r = 0; r < R; ++r) {
      const bfloat16x8_t xp = vreinterpretq_bf16_u32(vdupq_n_u32(x[r + m0][kp]));
      for (int c = 0; c < 2 * J; ++c) {
        acc[r][c].lo = vbfdotq_f32(acc[r][c].lo, w[2 * c], xp);
        acc[r][c].hi = vbfdotq_f32(acc[r][c].hi, w[2 * c + 1], xp);
      }
    }
  }
  finish_tile<R, J>(a, acc, np, j0, m0, carry, kp1 == a.KP);
}

void bfdot_stream(const GemvArgs& a, const uint32_t* const* x, int64_t np0, int64_t np1, float* carry) {
  // 6 rows x 4 registers: 24 accumulators of the 32, the line's 4 and a broadcast
  static const StreamTile<uint32_t> line[7] = {nullptr, &bfdot_tile<1, 1>, &bfdot_tile<2, 1>, &bfdot_tile<3, 1>,
                                               &bfdot_tile<4, 1>, &bfdot_tile<5, 1>, &bfdot_tile<6, 1>};
  stream_panels<uint32_t, 6>(a, x, np0, np1, carry, &bfdot_tile<1, 4>, &bfdot_tile<2, 2>, line);
}
#endif

// ---- bf16, many rows: chunks widened once, float32 tiles on them ---------------------------------
// pairs kp0 .. kp0 + kc of panel np, as float32 rows [2 kc][64]
PDS_V8 void widen_chunk(const GemvArgs& a, int64_t np, int64_t kp0, int64_t kc, float* wf) {
  const uint16_t* p = a.w + (np * a.KP + kp0) * 128;
  for (int64_t kp = 0; kp < kc; ++kp)
    for (int64_t c = 0; c < 8; ++c) {  // 8 outputs per vector
      F8 first, second;
      load_pairs(p + kp * 128 + c * 16, first, second);
      store(wf + (2 * kp) * kPanel + 8 * c, first);
      store(wf + (2 * kp + 1) * kPanel + 8 * c, second);
    }
}

// rows of the float32 copy of x (xf, row stride xs) into output rows m .. m + R, column block j of
// panel np, k of the chunk from k0; sums start from zero (first chunk) or `carry` [M][64] and end
// there or, after the last chunk, in out
template <int R>
PDS_V8 void bf16_chunk_tile(const GemvArgs& a, const float* xf, int64_t xs, const float* wf, int64_t kn,
                            int64_t np, int64_t j, int64_t m, int64_t k0, bool first, bool last, float* carry) {
  F8 acc[R][2];
  start_tile<R, 1>(acc, int(j), m, carry, first);
  tile16<R>(xf + k0, xs, wf + 16 * j, kPanel, kn, acc);
  finish_tile<R, 1>(a, acc, np, int(j), m, carry, last);
}

void bf16_chunk_rows(const GemvArgs& a, const float* xf, int64_t xs, const float* wf, int64_t kn, int64_t np,
                     int64_t j, int64_t m, int rows, int64_t k0, bool first, bool last, float* carry) {
  switch (rows) {
    case 1: return bf16_chunk_tile<1>(a, xf, xs, wf, kn, np, j, m, k0, first, last, carry);
    case 2: return bf16_chunk_tile<2>(a, xf, xs, wf, kn, np, j, m, k0, first, last, carry);
    case 3: return bf16_chunk_tile<3>(a, xf, xs, wf, kn, np, j, m, k0, first, last, carry);
    case 4: return bf16_chunk_tile<4>(a, xf, xs, wf, kn, np, j, m, k0, first, last, carry);
    case 5: return bf16_chunk_tile<5>(a, xf, xs, wf, kn, np, j, m, k0, first, last, carry);
    default: return bf16_chunk_tile<6>(a, xf, xs, wf, kn, np, j, m, k0, first, last, carry);
  }
}

PDS_V8 void widen_rows(const uint16_t* xb, int64_t x_stride, int64_t rows, int64_t K2, float* xf) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < K2; k += 8) store_upto(xf + m * K2 + k, load_upto(xb + m * x_stride + k, K2 - k), K2 - k);
}

void bf16_chunked(const GemvArgs& a, const uint16_t* xb, int64_t np0, int64_t np1) {
  const int64_t K2 = 2 * a.KP;
  std::vector<float> xf(std::min(a.M, kRowBlock) * K2), wf(2 * kChunkPairs * kPanel), carry(a.M * kPanel);
  for (int64_t mb = 0; mb < a.M; mb += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, a.M - mb);
    widen_rows(xb + mb * a.x_stride, a.x_stride, rows, K2, xf.data());
    for (int64_t np = np0; np < np1; ++np)
      for (int64_t kp0 = 0; kp0 < a.KP; kp0 += kChunkPairs) {
        const int64_t kc = std::min(kChunkPairs, a.KP - kp0);
        widen_chunk(a, np, kp0, kc, wf.data());
        const bool first = kp0 == 0, last = kp0 + kc == a.KP;
        for (int64_t j = 0; j < 4 && np * kPanel + 16 * j < a.N; ++j)
          for (int64_t m0 = 0; m0 < rows; m0 += kTileRows)
            bf16_chunk_rows(a, xf.data() + m0 * K2, K2, wf.data(), 2 * kc, np, j, mb + m0,
                            int(std::min<int64_t>(kTileRows, rows - m0)), 2 * kp0, first, last, carry.data());
      }
  }
}

}  // namespace

void linear_f32_panels_vec8(const F32Args& a, int64_t np0, int64_t np1) {
  for (int64_t mb = 0; mb < a.M; mb += kRowBlock) {
    const int64_t m1 = std::min(a.M, mb + kRowBlock);
    for (int64_t np = np0; np < np1; ++np) {
      for (int64_t j = 0; j < 4 && np * kPanel + 16 * j < a.N; ++j)
        for (int64_t m0 = mb; m0 < m1; m0 += kTileRows) f32_rows(a, np, j, m0, int(std::min<int64_t>(kTileRows, m1 - m0)));
    }
  }
}

void linear_vnni_panels_vec8(const GemvArgs& a, const uint16_t* xb, int64_t np0, int64_t np1) {
#if PDS_ARM
  if (use_bfdot()) {  // BFDOT's own rounding at every row count: rows stay independent of the batch
    std::vector<const uint32_t*> x(a.M);
    std::vector<float> carry(a.M * kPanel);
    for (int64_t m = 0; m < a.M; ++m) x[m] = reinterpret_cast<const uint32_t*>(xb + m * a.x_stride);
    return bfdot_stream(a, x.data(), np0, np1, carry.data());
  }
#endif
  if (a.M > kStreamRows) return bf16_chunked(a, xb, np0, np1);
  const int64_t K2 = 2 * a.KP;
  std::vector<float> xf(a.M * K2), carry(a.M * kPanel);
  widen_rows(xb, a.x_stride, a.M, K2, xf.data());
  const float* x[kStreamRows];
  for (int64_t m = 0; m < a.M; ++m) x[m] = xf.data() + m * K2;
  bf16_stream(a, x, np0, np1, carry.data());
}

}  // namespace pds
#endif
