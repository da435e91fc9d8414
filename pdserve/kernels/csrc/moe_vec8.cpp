// The fused MoE kernel's per-ISA parts on 8 lanes (AVX2, NEON): the bf16 register tile, the
// activation on the first matmul's results, the second matmul's output, and the combine over a
// token's slots, each in the order moe.cpp's other paths use (the int8 tile and the row
// quantization are in int8_vec8.cpp).
#include "vec8.h"
#include "vec8_kernels.h"

#if PDS_HAS_V8
namespace pds {
namespace {
using namespace v8;

// rows r0 .. r0 + R of the tile, all 64 outputs of the panel (one row: in one pass)
template <int R, int J>
PDS_V8 void bf16_rows(const MoeTile& t, int r0) {
  for (int j0 = 0; j0 < 4; j0 += J) {
    F8 acc[R][2 * J];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * J; ++c) acc[r][c] = zero();
    if (t.prefetch && r0 == 0 && j0 == 0)
      pair_panel_tile<R, J, true>(t.xr + r0, reinterpret_cast<const uint16_t*>(t.panel), 0, t.KS, j0, acc);
    else
      pair_panel_tile<R, J, false>(t.xr + r0, reinterpret_cast<const uint16_t*>(t.panel), 0, t.KS, j0, acc);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * J; ++c) store(t.res + (r0 + r) * 64 + j0 * 16 + c * 8, acc[r][c]);
  }
}

PDS_VI F8 activate(F8 g, F8 u, MoeAct act, float alpha, float limit) {
  const F8 one = set1(1.f);
  if (act == MoeAct::kSilu) return mul(div(g, add(one, exp(sub(zero(), g)))), u);  // silu(g) u
  g = min(g, set1(limit));
  u = min(max(u, set1(-limit)), set1(limit));
  const F8 glu = mul(g, div(one, add(one, exp(sub(zero(), mul(g, set1(alpha)))))));
  return mul(add(u, one), glu);
}

PDS_V8 void finish_act(const float* res, const float* bias, uint16_t* a, MoeAct act, float alpha, float limit) {
  for (int h = 0; h < 4; ++h) {
    F8 g = load(res + 8 * h), u = load(res + 32 + 8 * h);
    if (bias) {
      g = add(g, load(bias + 8 * h));
      u = add(u, load(bias + 32 + 8 * h));
    }
    store(a + 8 * h, activate(round_bf16(g), round_bf16(u), act, alpha, limit));
  }
}

PDS_V8 void finish_out(const float* res, const float* bias, uint16_t* y, int64_t n) {
  for (int64_t c = 0; c < 64 && c < n; c += 8) {
    F8 v = load(res + c);
    if (bias) v = add(v, load(bias + c));
    store_upto(y + c, v, n - c);
  }
}

PDS_V8 void combine(float* out, const uint16_t* y, const int32_t* ids, const float* w, int64_t K, int64_t H) {
  for (int64_t n = 0; n < H; n += 8) {
    F8 acc = zero();
    for (int64_t k = 0; k < K; ++k)
      if (ids[k] >= 0) acc = add(acc, mul(load_upto(y + k * H + n, H - n), set1(w[k])));
    store_upto(out + n, acc, H - n);
  }
}

}  // namespace

void moe_tile_bf16_vec8(const MoeTile& t) {
  for (int r0 = 0; r0 < t.rows; r0 += 4) {
    switch (std::min(4, t.rows - r0)) {
      case 1: bf16_rows<1, 4>(t, r0); break;
      case 2: bf16_rows<2, 2>(t, r0); break;
      case 3: bf16_rows<3, 1>(t, r0); break;
      default: bf16_rows<4, 1>(t, r0); break;
    }
  }
}

void moe_finish_act_vec8(const float* res, const float* bias, uint16_t* a, MoeAct act, float alpha, float limit) {
  finish_act(res, bias, a, act, alpha, limit);
}
void moe_finish_out_vec8(const float* res, const float* bias, uint16_t* y, int64_t n) { finish_out(res, bias, y, n); }
void moe_combine_vec8(float* out, const uint16_t* y, const int32_t* ids, const float* w, int64_t K, int64_t H) {
  combine(out, y, ids, w, K, H);
}

}  // namespace pds
#endif
