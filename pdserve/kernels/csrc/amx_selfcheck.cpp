// The AMX self-check: before a process first uses a tile backend, a small bf16 GEMM, int8 GEMM and
// attention (tails in every dimension, scattered pages, a window, sinks) run on the AMX kernels
// and on the AVX-512 kernels; results further apart than bf16 rounding mean a kernel bug that
// could not be run where the kernels were written (only the emulation runs on a host without
// AMX), and AMX is then disabled (amx.cpp logs it). The inputs come from a fixed LCG, so the
// check does not draw from torch's random generator.
#include <ATen/ATen.h>  // tensor arithmetic of the reference it checks against

#include "amx.h"

#include <sstream>

namespace pds {

void linear_vnni(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias,
                 int64_t amx_min_rows);
void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                 const at::Tensor& w_scale, c10::optional<at::Tensor> bias, int64_t amx_min_rows);
void paged_attention_bf16(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                          double scale, int64_t window, const c10::optional<at::Tensor>& sinks, int64_t amx_min_rows,
                          const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                          double k_scale, double v_scale);

namespace {

struct Lcg {
  uint64_t s = 0x2545f4914f6cdd1dULL;
  float uniform() {  // [-1, 1)
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return float(int32_t(s >> 32)) * (1.f / 2147483648.f);
  }
  at::Tensor tensor(at::IntArrayRef shape, float amp = 1.f) {
    at::Tensor t = at::empty(shape, at::kFloat);
    float* p = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = amp * uniform();
    return t;
  }
};

// [N, K] -> [ceil(N/64), ceil(K/g), 4, 16, g] zero padded (pdserve/layers/linear.py's pack_panels)
at::Tensor pack_panels(const at::Tensor& w, int64_t g) {
  const int64_t N = w.size(0), K = w.size(1), NP = (N + 63) / 64, KG = (K + g - 1) / g;
  at::Tensor padded = at::zeros({NP * 64, KG * g}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({NP, 4, 16, KG, g}).permute({0, 3, 1, 2, 4}).contiguous();
}

// "" when |got - want| <= tol max|want| everywhere, else the finding
std::string compare(const char* what, const at::Tensor& got, const at::Tensor& want, double tol) {
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  const double bound = tol * want.to(at::kDouble).abs().max().item<double>();
  if (err <= bound) return "";
  std::ostringstream os;
  os << what << ": AMX and AVX-512 results differ by up to " << err << " (allowed " << bound << "); ";
  return os.str();
}

template <typename Fn>
at::Tensor run_on(TileBackend tb, const Fn& fn) {
  ScopedTileBackend forced(tb);
  return fn();
}

std::string check_bf16_linear(TileBackend tb, Lcg& rng) {
  const int64_t M = 19, N = 133, K = 71;
  const at::Tensor x = rng.tensor({M, K}), w = rng.tensor({N, K}).to(at::kBFloat16), bias = rng.tensor({N});
  const at::Tensor packed = pack_panels(w, 2);
  auto run = [&] {
    at::Tensor out = at::empty({M, N}, at::kFloat);
    linear_vnni(out, x, packed, bias, 1);
    return out;
  };
  return compare("bf16 linear", run_on(tb, run), run_on(TileBackend::kNone, run), 1.0 / 256);
}

std::string check_int8_linear(TileBackend tb, Lcg& rng) {
  const int64_t M = 19, N = 133, K = 150, NP = (N + 63) / 64;
  const at::Tensor x = rng.tensor({M, K}, 2.f).to(at::kBFloat16);
  const at::Tensor wq = (rng.tensor({N, K}) * 127.f).round().to(at::kChar);
  at::Tensor colsum = at::zeros({NP * 64}, at::kInt), w_scale = at::full({NP * 64}, 1.f / 127, at::kFloat);
  colsum.narrow(0, 0, N).copy_(wq.to(at::kInt).sum(1));
  const at::Tensor packed = pack_panels(wq, 4);
  auto run = [&] {
    at::Tensor out = at::empty({M, N}, at::kFloat);
    linear_w8a8(out, x, packed, colsum, w_scale, c10::nullopt, 1);
    return out;
  };
  return compare("int8 linear", run_on(tb, run), run_on(TileBackend::kNone, run), 1.0 / 256);
}

// two requests (a prompt of 40, 21 new tokens after a prefix of 69) over scattered pages of 16;
// head_dim 80 (not a multiple of 32), 4 query heads on 2 KV heads
std::string check_attention(TileBackend tb, Lcg& rng, int64_t window, bool sinks) {
  const int64_t H = 4, KVH = 2, D = 80, PS = 16, pages = 12;
  const at::Tensor lens = at::tensor({40, 90}, at::kInt), starts = at::tensor({0, 40, 61}, at::kInt);
  const at::Tensor table = at::tensor({7, 2, 9, 0, 0, 0, 4, 11, 1, 5, 8, 3}, at::kInt).view({2, 6});
  const at::Tensor q = rng.tensor({61, H, D}, 2.f).to(at::kBFloat16);
  const at::Tensor kc = rng.tensor({pages, KVH, PS, D}, 2.f).to(at::kBFloat16);
  const at::Tensor vc = rng.tensor({pages, KVH, PS, D}, 2.f).to(at::kBFloat16);
  const c10::optional<at::Tensor> sk = sinks ? c10::optional<at::Tensor>(rng.tensor({H}, 2.f)) : c10::nullopt;
  auto run = [&] {
    at::Tensor out = at::zeros({61, H, D}, at::kBFloat16);
    paged_attention_bf16(out, q, kc, vc, table, lens, starts, 1.0 / std::sqrt(double(D)), window, sk, 1, c10::nullopt,
                         c10::nullopt, 1.0, 1.0);
    return out;
  };
  return compare(sinks ? "attention (window, sinks)" : "attention", run_on(tb, run), run_on(TileBackend::kNone, run),
                 1.0 / 64);
}

}  // namespace

std::string amx_self_check(TileBackend tb) {
  Lcg rng;
  return check_bf16_linear(tb, rng) + check_int8_linear(tb, rng) + check_attention(tb, rng, 0, false) +
         check_attention(tb, rng, 30, true);
}

}  // namespace pds
