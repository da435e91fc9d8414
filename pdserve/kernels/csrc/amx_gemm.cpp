// The bf16 and int8 linear layers on AMX tiles, on the weights packed for linear_vnni (gemv.cpp)
// and linear_w8a8 (int8_gemm.cpp): no second copy.
//
// Both packed layouts are AMX B tiles as they lie. A panel of 64 outputs is [k rows][4][16][e]
// with 256 bytes a k row (bf16: e = 2, a k row is a pair of k; int8: e = 4, four k): rows
// 16 kb .. 16 kb + 15 of column group j are a 16 x 64-byte tile at panel + 4096 kb + 64 j with a
// row stride of 256. A k block is 32 k (bf16) or 64 k (int8); the last one, when the panel has
// fewer k rows, is copied once per panel into a zero-padded tile. x is copied into A tiles of 16
// rows (zero rows past M, zero k past K; int8: x quantized + 128 as the VNNI path has it).
//
// One row block (16 rows) x one panel is 4 accumulator tiles (C0..C3: outputs 16 j .. 16 j + 15),
// summed over the k blocks in order; each output is one accumulator, over k in increasing order
// in every case, so a row's result does not depend on the other rows, M or the thread count
// (threads split the panels). The bf16 order differs from the AVX-512 kernel's only inside a
// pair of k: TDPBF16PS adds the even product, then the odd one (the SDM's order); VDPBF16PS's
// pseudo-code adds the odd one first; which kernel a call takes therefore decides the last bit,
// and amx_min_rows keeps one kernel for every row count. int8 sums are exact: AMX and VNNI results
// are the same bits (the dequantization is the VNNI path's, in the same order).
#include "amx.h"

#include <ATen/Parallel.h>

#include <vector>

namespace pds {

#if PDS_X86
namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kRowBytes = 256;  // a panel's k row
constexpr int64_t kBlockBytes = 16 * kRowBytes;  // a panel's k block

struct PanelGemm {
  const uint8_t* w;  // [NP][KR][256 bytes]
  int64_t KR;  // k rows of a panel (bf16: pairs, int8: quads)
  const uint8_t* a;  // A rows: [Mp][a_stride bytes], a_stride = 64 KB
  int64_t a_stride, KB, M, Mp;
};

// k rows 16 (KR / 16) .. KR of a panel, zero padded to one block of 4 tiles
inline void copy_tail(const PanelGemm& g, const uint8_t* panel, uint8_t (*tail)[16][64]) {
  std::memset(tail, 0, 4 * 16 * 64);
  const int64_t r0 = g.KR / 16 * 16;
  for (int64_t r = r0; r < g.KR; ++r)
    for (int j = 0; j < 4; ++j) std::memcpy(tail[j][r - r0], panel + r * kRowBytes + j * 64, 64);
}

template <class Tiles, bool kInt8, int C, int B>
PDS_AMX inline void dp_j(Tiles& t, const uint8_t* blk, const uint8_t (*tail)[16][64], bool in_place) {
  if (in_place)
    t.template load<B>(blk + C * 64, kRowBytes);
  else
    t.template load<B>(tail[C], 64);
  if constexpr (kInt8)
    t.template dpbusd<C, 4, B>();
  else
    t.template dpbf16ps<C, 4, B>();
}

// rows m0 .. m0 + 16 of A times one panel: c [16][64] (fp32 or int32)
template <class Tiles, bool kInt8>
PDS_AMX void row_block(Tiles& t, const PanelGemm& g, const uint8_t* panel, const uint8_t (*tail)[16][64],
                       int64_t m0, void* c) {
  t.template zero<0>();
  t.template zero<1>();
  t.template zero<2>();
  t.template zero<3>();
  const int64_t full = g.KR / 16;
  for (int64_t kb = 0; kb < g.KB; ++kb) {
    const uint8_t* blk = panel + kb * kBlockBytes;
    // the first row block streams the panel from memory: prefetch two blocks ahead into L2
    if (m0 == 0 && kb + 2 < full)
      for (int i = 0; i < kBlockBytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + 2 * kBlockBytes + i, _MM_HINT_T1);
    t.template load<4>(g.a + m0 * g.a_stride + kb * 64, g.a_stride);
    const bool in_place = kb < full;
    dp_j<Tiles, kInt8, 0, 6>(t, blk, tail, in_place);
    dp_j<Tiles, kInt8, 1, 7>(t, blk, tail, in_place);
    dp_j<Tiles, kInt8, 2, 6>(t, blk, tail, in_place);
    dp_j<Tiles, kInt8, 3, 7>(t, blk, tail, in_place);
  }
  char* cb = static_cast<char*>(c);
  t.template store<0>(cb, 256);
  t.template store<1>(cb + 64, 256);
  t.template store<2>(cb + 128, 256);
  t.template store<3>(cb + 192, 256);
}

struct Out {
  const void* bias;  // [N] in out's dtype, or null
  void* out;
  int64_t N, out_stride;
  bool out_bf16;
};

template <typename T>
PDS_AMX inline void put16(const Out& o, int64_t m, int64_t n0, __m512 r) {
  const __mmask16 mk = tail_mask(o.N - n0);
  if (o.bias) r = _mm512_add_ps(r, load16(static_cast<const T*>(o.bias) + n0, mk));
  store16(static_cast<T*>(o.out) + m * o.out_stride + n0, r, mk);
}

PDS_AMX inline void put(const Out& o, int64_t m, int64_t n0, __m512 r) {
  if (n0 >= o.N) return;
  if (o.out_bf16)
    put16<uint16_t>(o, m, n0, r);
  else
    put16<float>(o, m, n0, r);
}

template <class Tiles>
PDS_AMX void bf16_panels(const PanelGemm& g, const Out& o, int64_t np0, int64_t np1) {
  Tiles t(full_tiles());
  alignas(64) float c[16][64];
  alignas(64) uint8_t tail[4][16][64];
  for (int64_t np = np0; np < np1; ++np) {
    const uint8_t* panel = g.w + np * g.KR * kRowBytes;
    if (g.KR % 16) copy_tail(g, panel, tail);
    for (int64_t m0 = 0; m0 < g.Mp; m0 += 16) {
      row_block<Tiles, false>(t, g, panel, tail, m0, c);
      for (int64_t r = 0; r < 16 && m0 + r < g.M; ++r)
        for (int j = 0; j < 4; ++j) put(o, m0 + r, np * kPanel + j * 16, _mm512_load_ps(&c[r][j * 16]));
    }
  }
}

template <class Tiles>
PDS_AMX void int8_panels(const PanelGemm& g, const AmxInt8Gemm& q, const Out& o, int64_t np0, int64_t np1) {
  Tiles t(full_tiles());
  alignas(64) int32_t c[16][64];
  alignas(64) uint8_t tail[4][16][64];
  for (int64_t np = np0; np < np1; ++np) {
    const uint8_t* panel = g.w + np * g.KR * kRowBytes;
    if (g.KR % 16) copy_tail(g, panel, tail);
    for (int64_t m0 = 0; m0 < g.Mp; m0 += 16) {
      row_block<Tiles, true>(t, g, panel, tail, m0, c);
      // (sum - 128 colsum) * (x_scale * w_scale), as int8_gemm.cpp's finish
      for (int64_t r = 0; r < 16 && m0 + r < g.M; ++r)
        for (int j = 0; j < 4; ++j) {
          const int64_t n0 = np * kPanel + j * 16;
          const __m512i fixed = _mm512_sub_epi32(_mm512_load_si512(&c[r][j * 16]),
                                                 _mm512_slli_epi32(_mm512_loadu_si512(q.colsum + n0), 7));
          const __m512 s = _mm512_mul_ps(_mm512_set1_ps(q.x_scale[m0 + r]), _mm512_loadu_ps(q.w_scale + n0));
          put(o, m0 + r, n0, _mm512_mul_ps(_mm512_cvtepi32_ps(fixed), s));
        }
    }
  }
}

}  // namespace

void amx_linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, TileBackend tb) {
  const int64_t M = x.size(0), K = x.size(1), KP = packed.size(1), NP = packed.size(0);
  const int64_t KB = (KP + 15) / 16, KA = 32 * KB, Mp = (M + 15) / 16 * 16;
  std::vector<uint16_t> xa(Mp * KA, 0);  // A rows: x in bf16, zero padded
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* row = xa.data() + m * KA;
    if (x_bf16)
      std::memcpy(row, data<uint16_t>(x) + m * x.stride(0), K * 2);
    else
      for (int64_t k = 0; k < K; ++k) row[k] = f32_to_bf16(data<float>(x)[m * x.stride(0) + k]);
  }
  const PanelGemm g{reinterpret_cast<const uint8_t*>(packed.data_ptr()), KP,
                    reinterpret_cast<const uint8_t*>(xa.data()), KA * 2, KB, M, Mp};
  const Out o{bias.has_value() ? bias->data_ptr() : nullptr, out.data_ptr(), out.size(1), out.stride(0),
              out.scalar_type() == at::kBFloat16};
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
    if (tb == TileBackend::kHardware)
      bf16_panels<HwTiles>(g, o, b, e);
    else
      bf16_panels<EmuTiles>(g, o, b, e);
  });
}

void amx_linear_w8a8(const AmxInt8Gemm& q, TileBackend tb) {
  TORCH_CHECK(q.xq_stride % 64 == 0 && q.xq_stride >= 4 * q.KQ, "amx_linear_w8a8: x rows must be padded to 64 bytes");
  const int64_t Mp = (q.M + 15) / 16 * 16;
  const PanelGemm g{reinterpret_cast<const uint8_t*>(q.w), q.KQ, q.xq, q.xq_stride, q.xq_stride / 64, q.M, Mp};
  const Out o{q.bias, q.out, q.N, q.out_stride, q.out_bf16};
  at::parallel_for(0, q.NP, 1, [&](int64_t b, int64_t e) {
    if (tb == TileBackend::kHardware)
      int8_panels<HwTiles>(g, q, o, b, e);
    else
      int8_panels<EmuTiles>(g, q, o, b, e);
  });
}
#else
void amx_linear_bf16(at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, TileBackend) {
  TORCH_CHECK(false, "AMX kernels are x86-64 only");
}
void amx_linear_w8a8(const AmxInt8Gemm&, TileBackend) { TORCH_CHECK(false, "AMX kernels are x86-64 only"); }
#endif

}  // namespace pds
