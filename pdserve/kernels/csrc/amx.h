// Intel AMX (tile matrix multiply) for pdserve's CPU kernels: when to use it, and the two tile
// backends every AMX kernel is written against.
//
// What runs where
// - Hardware: a CPU with amx_tile, amx_bf16 and amx_int8 (Sapphire Rapids and later Xeons), an OS
//   that enables the tile state in XCR0, and Linux granting the process tile data
//   (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once before the first tile
//   instruction). The first use then runs a self-check (amx_selfcheck.cpp): a small bf16 GEMM,
//   int8 GEMM and attention on the AMX kernels and on the AVX-512 kernels; if they disagree
//   beyond bf16 rounding, AMX is disabled for the process with an error in the log.
// - Emulation (tests): `EmuTiles` does what the tile instructions do, in plain C++, following the
//   pseudo-code of Intel's SDM; `set_amx_emulation(True)` runs the same AMX kernels on it through
//   the same dispatch, self-check included, on any CPU with avx512_bf16 (the kernels' code around
//   the tiles is AVX-512). Hardware may round TDPBF16PS differently in the last bit (it is not
//   documented whether the two products of a pair are added one at a time); the integer
//   instructions are exact either way.
// - Otherwise (no AMX, permission refused, self-check failed, `set_amx(False)`, forced scalar):
//   the AVX-512 (or scalar) kernels, unchanged.
//
// Every AMX kernel here configures one shape, 8 tiles of 16 rows x 64 bytes (palette 1), with
// fixed roles: tiles 0-3 accumulate (C), 4-5 hold the left operand (A), 6-7 the right one (B).
// Inputs are padded (rows to 16, k to a full tile) in the kernels' own buffers, never read past.
#pragma once

#include "common.h"

#include <string>

namespace pds {

enum class TileBackend : int { kNone = 0, kHardware = 1, kEmulated = 2 };

// What the AMX kernels run on now, from the calling thread (never from a parallel_for body);
// kNone: use the AVX-512 code. The first call for a backend runs its self-check.
TileBackend amx_backend();
bool cpu_has_amx();  // the CPU's flags and XCR0, not the permission
// The row count from which a kernel call takes AMX: `per_call` when >= 0 (0 and 1: every call),
// else the process default set by set_amx_min_rows (1: AMX at every row count).
int64_t amx_linear_min_rows(int64_t per_call);
int64_t amx_attention_min_rows(int64_t per_call);
const char* amx_isa_name();  // "amx_bf16", "amx_bf16_emulated", or nullptr when AMX is not used

// The self-check (amx_selfcheck.cpp): "" when the AMX kernels on `tb` agree with the AVX-512 ones,
// else what differed. It runs them with the calling thread's backend forced:
std::string amx_self_check(TileBackend tb);
// while alive, amx_backend() on this thread answers `tb` (no self-check): kNone is the AVX-512 code
struct ScopedTileBackend {
  explicit ScopedTileBackend(TileBackend tb);
  ~ScopedTileBackend();
  ScopedTileBackend(const ScopedTileBackend&) = delete;
  ScopedTileBackend& operator=(const ScopedTileBackend&) = delete;
  int saved;
};

// The AMX kernels (amx_gemm.cpp, amx_attention.cpp); inputs already checked by their callers.
void amx_linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, TileBackend tb);
// xq: [round_up(M, 16), round_up(4 KQ, 64)] quantized x + 128, as int8_gemm.cpp's quantize writes it
struct AmxInt8Gemm {
  const int8_t* w;  // [NP, KQ, 4, 16, 4]
  const int32_t* colsum;  // [NP * 64]
  const float* w_scale;  // [NP * 64]
  const uint8_t* xq;
  const float* x_scale;  // [M]
  const void* bias;  // [N] in out's dtype, or null
  void* out;
  int64_t M, N, KQ, NP, xq_stride, out_stride;
  bool out_bf16;
};
void amx_linear_w8a8(const AmxInt8Gemm& g, TileBackend tb);
struct AmxAttention {  // as flash_attention.cpp's FlashArgs
  const uint16_t* q;
  uint16_t* out;
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* table;
  const int32_t* lens;
  const int32_t* q_starts;
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride;
  int64_t heads, kv_heads, page_size, D, window;
  float scale;
  const float* sinks;
};
// one task of paged_attention_bf16: request b, KV head h, query positions q0 .. q0 + nq
void amx_attention_task(const AmxAttention& a, int64_t b, int64_t h, int64_t q0, int64_t nq, TileBackend tb);

#if PDS_X86
#define PDS_AMX                                                                                     \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "fma,avx2,f16c")))

// Palette 1: rows and bytes per row of each of the 8 tiles (64 bytes, the ldtilecfg layout).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

inline TileConfig full_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

// The tile instructions take their registers as literals: one case per register a role allows.
#define PDS_TILE_ANY(OP, T, ...)                                       \
  static_assert(T >= 0 && T < 8, "tile register");                     \
  if constexpr (T == 0) OP(0, __VA_ARGS__);                            \
  else if constexpr (T == 1) OP(1, __VA_ARGS__);                       \
  else if constexpr (T == 2) OP(2, __VA_ARGS__);                       \
  else if constexpr (T == 3) OP(3, __VA_ARGS__);                       \
  else if constexpr (T == 4) OP(4, __VA_ARGS__);                       \
  else if constexpr (T == 5) OP(5, __VA_ARGS__);                       \
  else if constexpr (T == 6) OP(6, __VA_ARGS__);                       \
  else OP(7, __VA_ARGS__);
#define PDS_DP_B(OP, c, a) \
  if constexpr (B == 6) OP(c, a, 6); \
  else OP(c, a, 7);
#define PDS_DP_A(OP, c)     \
  if constexpr (A == 4) {   \
    PDS_DP_B(OP, c, 4)      \
  } else {                  \
    PDS_DP_B(OP, c, 5)      \
  }
#define PDS_DP(OP)                                                                    \
  static_assert(C >= 0 && C < 4 && (A == 4 || A == 5) && (B == 6 || B == 7), "roles"); \
  if constexpr (C == 0) {                                                             \
    PDS_DP_A(OP, 0)                                                                   \
  } else if constexpr (C == 1) {                                                      \
    PDS_DP_A(OP, 1)                                                                   \
  } else if constexpr (C == 2) {                                                      \
    PDS_DP_A(OP, 2)                                                                   \
  } else {                                                                            \
    PDS_DP_A(OP, 3)                                                                   \
  }

// The real tiles: configured for the object's lifetime (tilerelease at the end).
struct HwTiles {
  PDS_AMX explicit HwTiles(const TileConfig& c) { _tile_loadconfig(&c); }
  PDS_AMX ~HwTiles() { _tile_release(); }
  HwTiles(const HwTiles&) = delete;
  HwTiles& operator=(const HwTiles&) = delete;
  template <int T>
  PDS_AMX void load(const void* p, int64_t stride) {
    PDS_TILE_ANY(_tile_loadd, T, p, stride)
  }
  template <int T>
  PDS_AMX void store(void* p, int64_t stride) {
    PDS_TILE_ANY(_tile_stored, T, p, stride)
  }
  template <int T>
  PDS_AMX void zero() {
    static_assert(T >= 0 && T < 4, "only accumulators are zeroed");
    if constexpr (T == 0) _tile_zero(0);
    else if constexpr (T == 1) _tile_zero(1);
    else if constexpr (T == 2) _tile_zero(2);
    else _tile_zero(3);
  }
  template <int C, int A, int B>
  PDS_AMX void dpbf16ps() {  // C += A . B, bf16 pairs, fp32 sums
    PDS_DP(_tile_dpbf16ps)
  }
  template <int C, int A, int B>
  PDS_AMX void dpbusd() {  // C += A . B, unsigned x signed bytes in fours, int32 sums
    PDS_DP(_tile_dpbusd)
  }
  template <int C, int A, int B>
  PDS_AMX void dpbssd() {  // signed x signed
    PDS_DP(_tile_dpbssd)
  }
};

// The tiles in memory, instruction by instruction as the SDM's pseudo-code has them (plain C++):
//   TDPBF16PS: for each row m, pair k (in order), column n: C[m][n] += A[m][2k] B[k][2n], then
//              C[m][n] += A[m][2k+1] B[k][2n+1], each addition rounded to fp32 (round to nearest
//              even), bf16 denormal inputs read as zero, denormal results flushed to zero;
//   TDPBUSD / TDPBSSD: C[m][n] += sum of 4 byte products A[m][4k+e] B[k][4n+e] (int32, wrapping).
// A configuration beyond the palette's limits (16 rows, 64 bytes a row) or operands whose shapes
// do not agree (A's bytes per row / 4 == B's rows, C and A rows, C and B bytes per row) throw,
// where hardware would fault. Loads zero what lies past a tile's configured rows and bytes.
struct EmuTiles {
  explicit EmuTiles(const TileConfig& c);
  template <int T>
  void load(const void* p, int64_t stride) {
    load_tile(T, p, stride);
  }
  template <int T>
  void store(void* p, int64_t stride) {
    store_tile(T, p, stride);
  }
  template <int T>
  void zero() {
    zero_tile(T);
  }
  template <int C, int A, int B>
  void dpbf16ps() {
    dp_bf16(C, A, B);
  }
  template <int C, int A, int B>
  void dpbusd() {
    dp_int8(C, A, B, false);
  }
  template <int C, int A, int B>
  void dpbssd() {
    dp_int8(C, A, B, true);
  }

  void load_tile(int t, const void* p, int64_t stride);
  void store_tile(int t, void* p, int64_t stride) const;
  void zero_tile(int t);
  void dp_bf16(int c, int a, int b);
  void dp_int8(int c, int a, int b, bool a_signed);

 private:
  void check_dp(int c, int a, int b) const;
  alignas(64) uint8_t data_[8][16][64];
  uint8_t rows_[8];
  uint16_t colsb_[8];
};

#endif

}  // namespace pds
