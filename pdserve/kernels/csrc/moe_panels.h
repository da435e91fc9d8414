// A layer's MoE experts on quantized panels (FP8 blocks, MXFP4, int4), run in one call
// (moe_panels.cpp); bound to Python, and held by the C++ decoder stack's MoE layers.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace pds {

enum class PanelAct { kSilu, kSwigluOai };

class PanelExperts {
 public:
  // Per local expert e: w13[e] / w2[e] packed panels, s13[e] / s2[e] their scales (fp8_linear.h);
  // b13 / b2: float32 biases per expert ([2I] / [H]), or empty lists.
  PanelExperts(int64_t codes, std::vector<at::Tensor> w13, std::vector<at::Tensor> s13, std::vector<at::Tensor> w2,
               std::vector<at::Tensor> s2, std::vector<at::Tensor> b13, std::vector<at::Tensor> b2, int64_t block_k13,
               int64_t block_k2, int64_t hidden, int64_t inter, const std::string& activation, double alpha,
               double limit);

  int64_t num_experts() const { return int64_t(w13_.size()); }
  int64_t hidden() const { return H_; }

  // out [T, H] float32 = sum over slots of weights * expert MLP(x); x [T, H] float32 or bf16, ids
  // [T, K] int32 (local expert, -1: not on this rank), weights [T, K] float32
  void forward(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
               int64_t amx_min_rows) const;

 private:
  int codes_;
  std::vector<at::Tensor> w13_, s13_, w2_, s2_, b13f_, b13b_, b2f_, b2b_;
  int64_t bk13_, bk2_, H_, I_;
  PanelAct act_ = PanelAct::kSilu;
  float alpha_, limit_;
};

}  // namespace pds
