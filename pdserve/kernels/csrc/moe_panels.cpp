// A layer's MoE experts on quantized panels (FP8 blocks, MXFP4, int4: fp8_linear.h) in one call:
// the (token, slot) pairs are grouped by expert (ascending pair index within an expert), and per
// expert with tokens, in ascending expert order:
//   gu = x[tok] W13^T + b13 (linear_codes, rounded to x's dtype),
//   a  = act(gate, up) in float32, rounded once to x's dtype,
//   y  = a W2^T + b2 (linear_codes, rounded to x's dtype),
//   out[t] += float(y) * weight (float32, experts in ascending order from zero)
// which is the reference loop of layers/moe/experts.py over the format's matmuls, without Python
// between the experts (at one row a layer's 8 experts were about 24 small torch calls). Every
// matmul is the format's batch-invariant kernel and a row's result depends on its own pairs only,
// so the output does not depend on which other tokens share the call.
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "fp8_linear.h"
#include "moe_panels.h"

namespace pds {

// int4_w4a8.cpp: the matmul of a weight of the panel formats by its codes
void linear_codes(int codes, at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, int64_t block_k, int64_t amx_min_rows);

namespace {

constexpr const char* kOp = "PanelExperts";

inline float activate(float g, float u, PanelAct act, float alpha, float limit) {
  if (act == PanelAct::kSilu) return g / (1.f + std::exp(-g)) * u;
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
}

template <typename T>
void activate_rows(const T* gu, T* a, int64_t n, int64_t I, PanelAct act, float alpha, float limit) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < I; ++i)
      store_f32(a + r * I + i, activate(load_f32(gu + r * 2 * I + i), load_f32(gu + r * 2 * I + I + i), act, alpha, limit));
}

template <typename T>
void add_weighted(float* out, const T* y, float w, int64_t H) {
  for (int64_t h = 0; h < H; ++h) out[h] += load_f32(y + h) * w;
}

}  // namespace

PanelExperts::PanelExperts(int64_t codes, std::vector<at::Tensor> w13, std::vector<at::Tensor> s13,
                           std::vector<at::Tensor> w2, std::vector<at::Tensor> s2, std::vector<at::Tensor> b13,
                           std::vector<at::Tensor> b2, int64_t block_k13, int64_t block_k2, int64_t hidden,
                           int64_t inter, const std::string& activation, double alpha, double limit)
    : codes_(int(codes)),
      w13_(std::move(w13)),
      s13_(std::move(s13)),
      w2_(std::move(w2)),
      s2_(std::move(s2)),
      bk13_(block_k13),
      bk2_(block_k2),
      H_(hidden),
      I_(inter),
      alpha_(float(alpha)),
      limit_(float(limit)) {
  TORCH_CHECK(codes >= kCodesFp8 && codes <= kCodesMxfp4A8, kOp, ": codes must be 0 (FP8), 1 (MXFP4), 2 (int4), 3 "
              "(int4 with int8 activations) or 4 (MXFP4 with int8 activations), got ", codes);
  if (activation == "silu")
    act_ = PanelAct::kSilu;
  else if (activation == "swiglu_oai")
    act_ = PanelAct::kSwigluOai;
  else
    TORCH_CHECK(false, kOp, ": activation must be \"silu\" or \"swiglu_oai\", got \"", activation, "\"");
  const size_t E = w13_.size();
  TORCH_CHECK(s13_.size() == E && w2_.size() == E && s2_.size() == E, kOp, ": one w13, s13, w2 and s2 per expert");
  TORCH_CHECK(b13.empty() || b13.size() == E, kOp, ": b13 must be empty or one per expert");
  TORCH_CHECK(b2.empty() || b2.size() == E, kOp, ": b2 must be empty or one per expert");
  for (size_t e = 0; e < E; ++e) {
    // k per packed row: 1, or 4 for the int8-activation quads
    const int64_t kq = codes == kCodesW4A8 || codes == kCodesMxfp4A8 ? 4 : 1;
    TORCH_CHECK(w13_[e].dim() == 3 && w13_[e].size(1) == (H_ + kq - 1) / kq &&
                    w13_[e].size(0) * kFp8Panel >= 2 * I_ && w2_[e].dim() == 3 &&
                    w2_[e].size(1) == (I_ + kq - 1) / kq && w2_[e].size(0) * kFp8Panel >= H_,
                kOp, ": expert ", e, "'s packed w13 ", w13_[e].sizes(), " and w2 ", w2_[e].sizes(),
                " do not agree with hidden ", H_, " and intermediate ", I_);
    for (const auto* bias : {&b13, &b2}) {
      if (bias->empty()) continue;
      const at::Tensor& b = (*bias)[e];
      const int64_t n = bias == &b13 ? 2 * I_ : H_;
      TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == n, kOp, ": expert ", e,
                  "'s bias must be a contiguous float32 [", n, "] tensor");
      (bias == &b13 ? b13f_ : b2f_).push_back(b);
      (bias == &b13 ? b13b_ : b2b_).push_back(b.to(at::kBFloat16));
    }
  }
}

void PanelExperts::forward(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                           int64_t amx_min_rows) const {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == H_ && (dt == at::kFloat || dt == at::kBFloat16),
              kOp, ": x must be a contiguous [T, ", H_, "] float32 or bfloat16 tensor, got ", x.sizes(), " ", dt);
  const int64_t T = x.size(0), E = num_experts();
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == T, kOp,
              ": ids must be a contiguous int32 [", T, ", K] tensor, got ", ids.sizes(), " ", ids.scalar_type());
  const int64_t K = ids.size(1);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(), kOp,
              ": weights must be a contiguous float32 tensor shaped like ids");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == T &&
                  out.size(1) == H_,
              kOp, ": out must be a contiguous float32 [", T, ", ", H_, "] tensor, got ", out.sizes());
  out.zero_();
  const int32_t* idp = ids.data_ptr<int32_t>();
  // pairs grouped by expert, ascending within one
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < T * K; ++p) {
    TORCH_CHECK(idp[p] < E, kOp, ": ids[", p / K, ", ", p % K, "] = ", idp[p], " but there are ", E,
                " local experts (ids must be in [0, ", E, ") or -1)");
    if (idp[p] >= 0) ++start[idp[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> pairs(start[E]), fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < T * K; ++p)
    if (idp[p] >= 0) pairs[fill[idp[p]]++] = p;
  const bool bf16 = dt == at::kBFloat16;
  const int64_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto& b13 = bf16 ? b13b_ : b13f_;
  const auto& b2 = bf16 ? b2b_ : b2f_;
  // one expert's rows at a time in buffers sized for the largest
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, start[e + 1] - start[e]);
  const at::Tensor xs_buf = at::empty({most, H_}, dt), gu_buf = at::empty({most, 2 * I_}, dt),
                   a_buf = at::empty({most, I_}, dt), y_buf = at::empty({most, H_}, dt);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* pe = pairs.data() + start[e];
    at::Tensor xs = xs_buf.narrow(0, 0, n), gu = gu_buf.narrow(0, 0, n), a = a_buf.narrow(0, 0, n),
               y = y_buf.narrow(0, 0, n);
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(static_cast<char*>(xs.data_ptr()) + r * H_ * es, xp + (pe[r] / K) * H_ * es, H_ * es);
    const c10::optional<at::Tensor> bias13 = b13.empty() ? c10::nullopt : c10::optional<at::Tensor>(b13[e]);
    const c10::optional<at::Tensor> bias2 = b2.empty() ? c10::nullopt : c10::optional<at::Tensor>(b2[e]);
    linear_codes(codes_, gu, xs, w13_[e], s13_[e], bias13, bk13_, amx_min_rows);
    if (bf16)
      activate_rows(data<uint16_t>(gu), data<uint16_t>(a), n, I_, act_, alpha_, limit_);
    else
      activate_rows(data<float>(gu), data<float>(a), n, I_, act_, alpha_, limit_);
    linear_codes(codes_, y, a, w2_[e], s2_[e], bias2, bk2_, amx_min_rows);
    for (int64_t r = 0; r < n; ++r) {
      float* row = op + (pe[r] / K) * H_;
      if (bf16)
        add_weighted(row, data<uint16_t>(y) + r * H_, wp[pe[r]], H_);
      else
        add_weighted(row, data<float>(y) + r * H_, wp[pe[r]], H_);
    }
  }
}

void bind_panel_experts(pybind11::module& m) {
  pybind11::class_<PanelExperts, std::shared_ptr<PanelExperts>>(m, "PanelExperts",
                                 "a layer's MoE experts on FP8 / MXFP4 / int4 panels, run in one call")
      .def(pybind11::init<int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                          int64_t, int64_t, const std::string&, double, double>(),
           pybind11::arg("codes"), pybind11::arg("w13"), pybind11::arg("s13"), pybind11::arg("w2"),
           pybind11::arg("s2"), pybind11::arg("b13"), pybind11::arg("b2"), pybind11::arg("block_k13"),
           pybind11::arg("block_k2"), pybind11::arg("hidden"), pybind11::arg("inter"), pybind11::arg("activation"),
           pybind11::arg("alpha"), pybind11::arg("limit"))
      .def("num_experts", &PanelExperts::num_experts)
      .def("forward", &PanelExperts::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("ids"), pybind11::arg("weights"),
           pybind11::arg("amx_min_rows") = -1);
}

}  // namespace pds
