// AMX detection, the Linux tile permission, the switches and the self-check's state; the emulated
// tile backend; the Python bindings of all of these (see amx.h for what runs where).
#include <torch/csrc/utils/pybind.h>  // the tensor type caster of the functions it binds

#include "amx.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

#if PDS_X86
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pds {

namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_emulate{false};
std::atomic<int64_t> g_linear_min_rows{1};
std::atomic<int64_t> g_attention_min_rows{1};
std::atomic<int> g_fault{0};  // tests: 1 corrupts emulated TDPBF16PS results, 2 TDPBUSD / TDPBSSD

// self-check per backend (index: TileBackend): 0 not run, 1 passed, 2 failed
std::atomic<int> g_check[3] = {};
std::string g_check_reason[3];  // guarded by g_check_mu
std::mutex g_check_mu;
thread_local int t_forced = -1;  // ScopedTileBackend

void log_to_python(const char* level, const std::string& msg) {
  pybind11::gil_scoped_acquire gil;
  try {
    pybind11::module_::import("logging").attr("getLogger")("pdserve.kernels").attr(level)(msg);
  } catch (const pybind11::error_already_set&) {  // logging is best effort
  }
}

// "" when this process may use the tile data registers, else why not
std::string request_tile_permission() {
#if defined(__linux__) && PDS_X86
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && (granted >> kXfeatureXtileData & 1)) return "";
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0) return "";
  return std::string("Linux refused tile data: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): ") +
         std::strerror(errno);
#else
  return "tile data permission is only requested on Linux";
#endif
}

// whether the hardware backend can run: CPU, OS and permission (asked once, refusal logged once)
bool hardware_usable() {
  static const bool yes = [] {
    if (!cpu_has_amx()) return false;
    const std::string why = request_tile_permission();
    if (why.empty()) return true;
    log_to_python("warning", "AMX not used (" + why + "); the AVX-512 kernels run instead");
    return false;
  }();
  return yes;
}

int run_self_check(TileBackend tb) {
  const int i = int(tb);
  std::string why;
  {
    std::lock_guard<std::mutex> lock(g_check_mu);
    if (int s = g_check[i].load(std::memory_order_acquire)) return s;
    try {
      why = amx_self_check(tb);
    } catch (const std::exception& e) {
      why = std::string("the AMX kernels failed: ") + e.what();
    }
    g_check_reason[i] = why;
    g_check[i].store(why.empty() ? 1 : 2, std::memory_order_release);
  }
  // logged outside the lock: the GIL may be held by a thread waiting for it
  const char* name = tb == TileBackend::kHardware ? "hardware" : "emulated";
  if (why.empty())
    log_to_python("info", std::string("AMX self-check passed (") + name + " tiles): the AMX kernels are used");
  else
    log_to_python("error", std::string("AMX self-check failed (") + name + " tiles), AMX disabled for this process: " +
                               why);
  return why.empty() ? 1 : 2;
}

}  // namespace

bool cpu_has_amx() { return (cpu_features() & kAmx) != 0; }

ScopedTileBackend::ScopedTileBackend(TileBackend tb) : saved(t_forced) { t_forced = int(tb); }
ScopedTileBackend::~ScopedTileBackend() { t_forced = saved; }

TileBackend amx_backend() {
  if (t_forced >= 0) return TileBackend(t_forced);
  if (!g_enabled.load(std::memory_order_relaxed) || !use_avx512_bf16()) return TileBackend::kNone;
  const TileBackend tb = g_emulate.load(std::memory_order_relaxed)      ? TileBackend::kEmulated
                         : use_amx_tiles() && hardware_usable()         ? TileBackend::kHardware
                                                                        : TileBackend::kNone;
  if (tb == TileBackend::kNone) return tb;
  int s = g_check[int(tb)].load(std::memory_order_acquire);
  if (s == 0) s = run_self_check(tb);
  return s == 1 ? tb : TileBackend::kNone;
}

int64_t amx_linear_min_rows(int64_t per_call) { return per_call >= 0 ? per_call : g_linear_min_rows.load(); }
int64_t amx_attention_min_rows(int64_t per_call) { return per_call >= 0 ? per_call : g_attention_min_rows.load(); }

const char* amx_isa_name() {
  switch (amx_backend()) {
    case TileBackend::kHardware: return "amx_bf16";
    case TileBackend::kEmulated: return "amx_bf16_emulated";
    default: return nullptr;
  }
}

#if PDS_X86
// ---- the emulated tiles ----

EmuTiles::EmuTiles(const TileConfig& c) {
  TORCH_CHECK(c.palette == 1, "AMX emulation: palette ", int(c.palette), " (palette 1 has 8 tiles)");
  for (int t = 0; t < 16; ++t) {
    if (t >= 8) {
      TORCH_CHECK(c.rows[t] == 0 && c.colsb[t] == 0, "AMX emulation: palette 1 has no tile ", t);
      continue;
    }
    TORCH_CHECK(c.rows[t] <= 16 && c.colsb[t] <= 64 && c.colsb[t] % 4 == 0 && (c.rows[t] == 0) == (c.colsb[t] == 0),
                "AMX emulation: tile ", t, " configured as ", int(c.rows[t]), " rows x ", c.colsb[t],
                " bytes (at most 16 x 64, bytes a multiple of 4)");
    rows_[t] = c.rows[t];
    colsb_[t] = c.colsb[t];
  }
  std::memset(data_, 0, sizeof data_);  // ldtilecfg zeroes the tiles
}

void EmuTiles::load_tile(int t, const void* p, int64_t stride) {
  TORCH_CHECK(rows_[t] > 0, "AMX emulation: tile ", t, " is not configured");
  std::memset(data_[t], 0, sizeof data_[t]);
  for (int r = 0; r < rows_[t]; ++r) std::memcpy(data_[t][r], static_cast<const uint8_t*>(p) + r * stride, colsb_[t]);
}

void EmuTiles::store_tile(int t, void* p, int64_t stride) const {
  TORCH_CHECK(rows_[t] > 0, "AMX emulation: tile ", t, " is not configured");
  for (int r = 0; r < rows_[t]; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, data_[t][r], colsb_[t]);
}

void EmuTiles::zero_tile(int t) { std::memset(data_[t], 0, sizeof data_[t]); }

void EmuTiles::check_dp(int c, int a, int b) const {
  TORCH_CHECK(c != a && c != b && a != b, "AMX emulation: a tile product needs three different tiles");
  TORCH_CHECK(rows_[c] > 0 && rows_[a] > 0 && rows_[b] > 0, "AMX emulation: product of unconfigured tiles");
  TORCH_CHECK(rows_[c] == rows_[a] && colsb_[a] / 4 == rows_[b] && colsb_[c] == colsb_[b],
              "AMX emulation: tile shapes do not agree: C ", int(rows_[c]), " x ", colsb_[c], ", A ", int(rows_[a]),
              " x ", colsb_[a], ", B ", int(rows_[b]), " x ", colsb_[b], " (rows x bytes)");
}

namespace {
inline float bf16_daz(uint16_t h) { return bf16_to_f32((h & 0x7f80u) == 0 ? uint16_t(h & 0x8000u) : h); }
inline float ftz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

void EmuTiles::dp_bf16(int c, int a, int b) {
  check_dp(c, a, b);
  const int K = colsb_[a] / 4, N = colsb_[c] / 4;
  for (int m = 0; m < rows_[c]; ++m) {
    float acc[16];
    uint16_t ar[32];
    std::memcpy(acc, data_[c][m], 64);
    std::memcpy(ar, data_[a][m], 64);
    for (int k = 0; k < K; ++k) {
      uint16_t br[32];
      std::memcpy(br, data_[b][k], 64);
      const float a0 = bf16_daz(ar[2 * k]), a1 = bf16_daz(ar[2 * k + 1]);
      for (int n = 0; n < N; ++n) {
        acc[n] = ftz(acc[n] + a0 * bf16_daz(br[2 * n]));
        acc[n] = ftz(acc[n] + a1 * bf16_daz(br[2 * n + 1]));
      }
    }
    if (m == 0 && g_fault.load(std::memory_order_relaxed) == 1) acc[0] += 1.f;
    std::memset(data_[c][m], 0, 64);
    std::memcpy(data_[c][m], acc, N * 4);
  }
  for (int m = rows_[c]; m < 16; ++m) std::memset(data_[c][m], 0, 64);
}

void EmuTiles::dp_int8(int c, int a, int b, bool a_signed) {
  check_dp(c, a, b);
  const int K = colsb_[a] / 4, N = colsb_[c] / 4;
  for (int m = 0; m < rows_[c]; ++m) {
    int32_t acc[16];
    std::memcpy(acc, data_[c][m], 64);
    const uint8_t* ar = data_[a][m];
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) {
        int32_t dot = 0;
        for (int e = 0; e < 4; ++e) {
          const int32_t x = a_signed ? int32_t(int8_t(ar[4 * k + e])) : int32_t(ar[4 * k + e]);
          dot += x * int32_t(int8_t(data_[b][k][4 * n + e]));
        }
        acc[n] = int32_t(uint32_t(acc[n]) + uint32_t(dot));  // int32 wraps
      }
    if (m == 0 && g_fault.load(std::memory_order_relaxed) == 2) acc[0] += 1000;
    std::memset(data_[c][m], 0, 64);
    std::memcpy(data_[c][m], acc, N * 4);
  }
  for (int m = rows_[c]; m < 16; ++m) std::memset(data_[c][m], 0, 64);
}

namespace {
// one tile product C += A . B (tiles 0, 4, 6), from and to row-major tensors: the bindings' test op
template <class Tiles>
PDS_AMX void tile_product(Tiles& t, int op, void* c, int64_t cs, const void* a, int64_t as, const void* b, int64_t bs) {
  t.template load<0>(c, cs);
  t.template load<4>(a, as);
  t.template load<6>(b, bs);
  if (op == 0)
    t.template dpbf16ps<0, 4, 6>();
  else if (op == 1)
    t.template dpbusd<0, 4, 6>();
  else
    t.template dpbssd<0, 4, 6>();
  t.template store<0>(c, cs);
}

void tile_dp_op(const std::string& op, at::Tensor c, const at::Tensor& a, const at::Tensor& b, bool hardware) {
  const int kind = op == "bf16" ? 0 : op == "usd" ? 1 : op == "ssd" ? 2 : -1;
  TORCH_CHECK(kind >= 0, "amx_tile_dp: op must be bf16, usd or ssd, got ", op);
  const auto in = kind == 0 ? at::kBFloat16 : kind == 1 ? at::kByte : at::kChar;
  TORCH_CHECK(c.dim() == 2 && a.dim() == 2 && b.dim() == 2 && c.is_contiguous() && a.is_contiguous() &&
                  b.is_contiguous() && a.scalar_type() == in && b.scalar_type() == (kind == 0 ? at::kBFloat16 : at::kChar) &&
                  c.scalar_type() == (kind == 0 ? at::kFloat : at::kInt),
              "amx_tile_dp: contiguous 2-D c (float32 / int32), a and b (bf16, or uint8 / int8 and int8)");
  TileConfig cfg;
  const int64_t esz = kind == 0 ? 2 : 1;
  const int64_t c_rows = c.size(0), c_bytes = c.size(1) * 4, a_bytes = a.size(1) * esz, b_bytes = b.size(1) * esz;
  cfg.rows[0] = uint8_t(std::min<int64_t>(c_rows, 255));
  cfg.colsb[0] = uint16_t(std::min<int64_t>(c_bytes, 65535));
  cfg.rows[4] = uint8_t(std::min<int64_t>(a.size(0), 255));
  cfg.colsb[4] = uint16_t(std::min<int64_t>(a_bytes, 65535));
  cfg.rows[6] = uint8_t(std::min<int64_t>(b.size(0), 255));
  cfg.colsb[6] = uint16_t(std::min<int64_t>(b_bytes, 65535));
  if (hardware) {
    TORCH_CHECK(cpu_has_amx() && hardware_usable(), "amx_tile_dp: this CPU or OS gives no AMX tiles");
    // the emulation checks these itself; hardware would fault
    TORCH_CHECK(c_rows <= 16 && a.size(0) == c_rows && b.size(0) * 4 == a_bytes && a_bytes <= 64 && c_bytes <= 64 &&
                    b_bytes == c_bytes && a_bytes % 4 == 0,
                "amx_tile_dp: shapes beyond one tile or not agreeing");
    HwTiles t(cfg);
    tile_product(t, kind, c.data_ptr(), c_bytes, a.data_ptr(), a_bytes, b.data_ptr(), b_bytes);
  } else {
    EmuTiles t(cfg);
    tile_product(t, kind, c.data_ptr(), c_bytes, a.data_ptr(), a_bytes, b.data_ptr(), b_bytes);
  }
}
}  // namespace
#endif

void bind_amx(pybind11::module& m) {
  m.def("set_amx", [](bool on) { g_enabled = on; },
        "use the AMX kernels where the CPU has them (default) or never (False: the AVX-512 kernels)");
  m.def("set_amx_emulation", [](bool on) {
        TORCH_CHECK(!on || use_avx512_bf16(), "set_amx_emulation: the AMX kernels' code around the tiles is AVX-512 BF16: ",
                    (cpu_features() & kAvx512Bf16) ? "the tier in force (" + isa_tier() + ") is below avx512_bf16"
                                                   : std::string("this CPU has no avx512_bf16"));
        g_emulate = on;
      },
      "tests: run the AMX kernels on emulated tiles (plain C++), through the same dispatch");
  m.def("set_amx_min_rows", [](int64_t linear, int64_t attention) {
        TORCH_CHECK(linear >= 1 && attention >= 1, "set_amx_min_rows: row counts must be >= 1");
        g_linear_min_rows = linear;
        g_attention_min_rows = attention;
      },
      "process defaults of the amx_min_rows argument: rows from which linear_vnni / linear_w8a8 and "
      "paged_attention_bf16 (rows of one task: query positions x GQA group) take AMX (default 1, 1)",
      pybind11::arg("linear"), pybind11::arg("attention"));
  m.def("set_amx_fault_injection", [](const std::string& op) {
        TORCH_CHECK(op.empty() || op == "bf16" || op == "int8", "set_amx_fault_injection: '', 'bf16' or 'int8'");
        g_fault = op.empty() ? 0 : op == "bf16" ? 1 : 2;
      },
      "tests: emulated tile products of that kind add an error to their first result");
  m.def("reset_amx_self_check", []() {
        std::lock_guard<std::mutex> lock(g_check_mu);
        for (int i = 0; i < 3; ++i) {
          g_check[i] = 0;
          g_check_reason[i].clear();
        }
      },
      "tests: the next AMX use runs the self-check again");
  m.def("amx_status", []() {
        pybind11::dict d;
        d["cpu"] = cpu_has_amx();
        d["enabled"] = g_enabled.load();
        d["emulation"] = g_emulate.load();
        const TileBackend tb = amx_backend();
        d["backend"] = tb == TileBackend::kHardware ? "hardware" : tb == TileBackend::kEmulated ? "emulated" : "none";
        std::lock_guard<std::mutex> lock(g_check_mu);
        for (int i = 1; i < 3; ++i) {
          const int s = g_check[i].load();
          d[i == 1 ? "self_check_hardware" : "self_check_emulated"] =
              s == 0 ? std::string("not run") : s == 1 ? std::string("passed") : "failed: " + g_check_reason[i];
        }
        d["linear_min_rows"] = g_linear_min_rows.load();
        d["attention_min_rows"] = g_attention_min_rows.load();
        return d;
      },
      "what the AMX kernels run on and why (runs the self-check if it is due)");
#if PDS_X86
  m.def("amx_tile_dp", &tile_dp_op,
        "tests: one tile product c += a . b (op bf16: TDPBF16PS, usd: TDPBUSD, ssd: TDPBSSD) on emulated or "
        "hardware tiles; a's and b's rows are the tiles' rows",
        pybind11::arg("op"), pybind11::arg("c"), pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("hardware"));
#endif
}

}  // namespace pds
