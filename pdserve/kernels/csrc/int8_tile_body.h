// The int8 register tile of the 8-lane kernels, included once per dot-product flavour by
// int8_vec8.cpp (deliberately without #pragma once). Each inclusion is inside a namespace that
// first defines, with the flavour's target attribute PDS_DOT_TARGET:
//   XB prep_x(uint32_t x4)                     4 bytes of a row of x (as stored: x + 128), broadcast
//   WB prep_w(const int8_t* w)                 32 bytes of a panel line: 8 outputs x 4 k
//   I8 dot(I8 acc, XB x, WB w)                 acc[i] += sum_e x[e] w[i][e] (in the flavour's form)
//   constexpr bool kUnsigned                   true: sums of (x + 128) w; false: of x w
// and gets `tile<R, J>`: rows x J lines of 16 outputs of one panel, every k, int32 sums to
// sums[r][16 j0 + ...] (row stride 64), in order of k (integers: any order gives the same).

template <int R, int J>
PDS_DOT_TARGET void tile(const uint32_t* const* x, int64_t KQ, const int8_t* panel, int j0, int32_t* sums) {
  v8::I8 acc[R][2 * J];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * J; ++c) acc[r][c] = v8::izero();
  for (int64_t kq = 0; kq < KQ; ++kq) {
    const int8_t* step = panel + kq * 256 + j0 * 64;
    XB xb[R];
    for (int r = 0; r < R; ++r) xb[r] = prep_x(x[r][kq]);
    for (int c = 0; c < 2 * J; ++c) {
      const WB w = prep_w(step + c * 32);
      for (int r = 0; r < R; ++r) acc[r][c] = dot(acc[r][c], xb[r], w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * J; ++c) v8::istore(sums + r * 64 + j0 * 16 + c * 8, acc[r][c]);
}

inline Int8TileFns tiles() {
  return {&tile<1, 4>, &tile<2, 2>, &tile<1, 1>, &tile<2, 1>, &tile<3, 1>, &tile<4, 1>, kUnsigned};
}
