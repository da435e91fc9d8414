// The decoder layers of a bf16 Llama-family model for decode batches, run from C++ in one call.
//
// A decode step at small batch is ~10 ms of weight reads on one core, and the same step driven
// from Python spends several more milliseconds dispatching ~30 small ops per layer. This class
// holds every layer's prepacked weights and runs the whole stack with the same kernels the
// Python path calls (so results are identical), in the same order:
//   residual += h; x = norm1(residual)          (first layer: residual = h; x = norm1(h))
//   q, k, v = split(x Wqkv + b); [q, k = per-head norms]; q, k = rope(q, k); store k, v
//   h = attention(q, pool) Wo + b
//   residual += h; x = norm2(residual); h = (silu(x Wg) * (x Wu)) Wd
// A sparse layer's MLP (set_moe) is instead, as layers/moe/ runs it on one rank:
//   logits = x Wr (+ b); p = softmax(logits) in float32; w, ids = top-k of p (w / sum(w) when
//   renormalised; cast to the logits' dtype and back when the family casts back);
//   h = round(sum_k w_k expert_{ids_k}(x)) (+ the shared expert, times sigmoid(x Wsg) if gated)
// with the experts on the panel kernels (PanelExperts) or the fused bf16 / int8 kernel (moe.cpp).
// Each row of the batch is one request's new token at position seq_lens[i] - 1.
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor type caster

#include "common.h"
#include "moe_panels.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace pds {

void paged_attention_bf16(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                          double scale, int64_t window);
bool flash_supported(int64_t head_dim);
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale, int64_t window);
void rms_norm(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& weight, double eps);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up);
void linear_vnni(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias);
void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                 const at::Tensor& w_scale, c10::optional<at::Tensor> bias);
void fp8_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale, int64_t block_k);
void linear_codes(int codes, at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, int64_t block_k, int64_t amx_min_rows);
void moe_experts_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w2, c10::optional<at::Tensor> b13,
                      c10::optional<at::Tensor> b2, const std::string& activation, double alpha, double limit);
void moe_experts_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w13_colsum, const at::Tensor& w13_scale,
                      const at::Tensor& w2, const at::Tensor& w2_colsum, const at::Tensor& w2_scale,
                      c10::optional<at::Tensor> b13, c10::optional<at::Tensor> b2, const std::string& activation,
                      double alpha, double limit);

namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

// `buf` as a [sizes] tensor of like's dtype, allocated only when it has another shape: a decode
// step's activations take the same few buffers in every layer
at::Tensor workspace(at::Tensor& buf, at::IntArrayRef sizes, const at::Tensor& like) {
  if (!buf.defined() || buf.sizes() != sizes || buf.scalar_type() != like.scalar_type())
    buf = at::empty(sizes, like.options());
  return buf;
}

// Weights on the panel kernels (fp8_linear.h: FP8 blocks, MXFP4, int4): up to fp8_max_rows rows
// linear_panels, beyond it (FP8 only) panels of kFp8DequantRows outputs dequantized k-major and
// multiplied by the BLAS GEMM, as the layer-by-layer path does
constexpr int64_t kFp8DequantRows = 256;

struct Linear {
  at::Tensor plain;  // a weight multiplied by at::linear (F.linear's op), or undefined
  at::Tensor vnni;  // GEMV layout, or undefined
  at::Tensor onednn;  // oneDNN prepacked, or undefined
  at::Tensor q_packed, q_colsum, q_scale;  // w8a8_int8 weights, or undefined
  at::Tensor f_packed, f_scale;  // panel weights (FP8 blocks, MXFP4, int4), or undefined
  int64_t f_block_k = 0, fp8_max_rows = 0, fp8_amx_min_rows = -1, f_codes = 0;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0;

  at::Tensor fp8_dequantized_matmul(const at::Tensor& x) const {
    const int64_t K = x.size(1), panels = kFp8DequantRows / 64;
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    at::Tensor wt = at::empty({K, kFp8DequantRows}, x.options());
    for (int64_t start = 0; start < out_features; start += kFp8DequantRows) {
      const int64_t n = std::min(kFp8DequantRows, out_features - start), p0 = start / 64;
      at::Tensor part = wt.narrow(1, 0, n);
      const int64_t np = std::min(panels, f_packed.size(0) - p0);
      fp8_dequantize(part, f_packed.narrow(0, p0, np), f_scale.narrow(0, p0, np), f_block_k);
      out.narrow(1, start, n).copy_(bias.has_value() ? at::addmm(bias->narrow(0, start, n), x, part) : at::mm(x, part));
    }
    return out;
  }

  // x Wᵀ (+ bias) into `buf` (reallocated when its shape differs), or a new tensor from oneDNN
  at::Tensor operator()(const at::Tensor& x, int64_t gemv_max_rows, at::Tensor& buf) const {
    if (plain.defined()) return at::linear(x, plain, bias);
    if (onednn.defined() && !(vnni.defined() && x.size(0) <= gemv_max_rows)) return onednn_linear(x, onednn, bias);
    if (f_packed.defined() && x.size(0) > fp8_max_rows) return fp8_dequantized_matmul(x);
    at::Tensor out = workspace(buf, {x.size(0), out_features}, x);
    if (f_packed.defined()) {
      linear_codes(int(f_codes), out, x, f_packed, f_scale, bias, f_block_k, fp8_amx_min_rows);
      return out;
    }
    if (q_packed.defined())
      linear_w8a8(out, x, q_packed, q_colsum, q_scale, bias);
    else
      linear_vnni(out, x, vnni, bias);
    return out;
  }
};

// A sparse layer's MLP (set_moe): the router, the experts on one of two kernels, a shared expert
struct Moe {
  Linear router;
  int64_t top_k = 0;
  bool renormalize = false, cast_back = false;
  std::shared_ptr<PanelExperts> panels;  // quantized experts, or null
  int64_t amx_min_rows = -1;
  // the fused kernel's (moe.cpp) packed experts: [w13, w2] bf16, or with
  // [w13_colsum, w13_scale, w2_colsum, w2_scale] w8a8_int8
  std::vector<at::Tensor> fused;
  c10::optional<at::Tensor> b13, b2;
  std::string activation;
  double alpha = 0, limit = 0;
  bool shared = false, shared_gated = false;
  Linear shared_gate_up, shared_down, shared_gate;
};

struct Layer {
  at::Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
  c10::optional<at::Tensor> q_norm, k_norm;
  int64_t window = 0;
  std::unique_ptr<Moe> moe;  // set: the MLP is sparse (gate_up and down unused)
};

// [M, heads, D] rows of a [M, width] tensor starting at column `col`
at::Tensor heads_view(const at::Tensor& t, int64_t col, int64_t heads, int64_t D) {
  return t.narrow(1, col, heads * D).view({t.size(0), heads, D});
}

}  // namespace

class DecodeModel {
 public:
  // gemv_max_rows: batches up to this size use the GEMV layout, larger ones oneDNN
  DecodeModel(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t gemv_max_rows)
      : heads_(heads), kv_heads_(kv_heads), D_(head_dim), gemv_rows_(gemv_max_rows), eps_(eps), scale_(scale) {}

  void add_layer(at::Tensor norm1, at::Tensor norm2, std::vector<c10::optional<at::Tensor>> qkv,
                 std::vector<c10::optional<at::Tensor>> o, std::vector<c10::optional<at::Tensor>> gate_up,
                 std::vector<c10::optional<at::Tensor>> down, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, int64_t window) {
    Layer l;
    l.norm1 = norm1;
    l.norm2 = norm2;
    l.qkv = make_linear(qkv, "qkv");
    l.o = make_linear(o, "o");
    // a sparse layer's MLP comes with set_moe
    if (!gate_up.empty() || !down.empty()) {
      l.gate_up = make_linear(gate_up, "gate_up");
      l.down = make_linear(down, "down");
    }
    l.q_norm = q_norm;
    l.k_norm = k_norm;
    l.window = window;
    layers_.push_back(std::move(l));
  }

  // Layer `index`'s MLP becomes sparse: router parts (make_linear's forms), top-k with the SoftmaxTopK options; the experts as `panels`
  // (PanelExperts, with its amx_min_rows and the largest batch it takes) or as `fused` (moe.cpp's
  // packed tensors, biases, activation); shared_gate_up / shared_down (empty: none) and
  // shared_gate (empty: ungated) of the shared expert.
  void set_moe(int64_t index, std::vector<c10::optional<at::Tensor>> router, int64_t top_k, bool renormalize,
               bool cast_back, std::shared_ptr<PanelExperts> panels, int64_t amx_min_rows, int64_t max_rows,
               std::vector<at::Tensor> fused, c10::optional<at::Tensor> b13, c10::optional<at::Tensor> b2,
               const std::string& activation, double alpha, double limit,
               std::vector<c10::optional<at::Tensor>> shared_gate_up,
               std::vector<c10::optional<at::Tensor>> shared_down,
               std::vector<c10::optional<at::Tensor>> shared_gate) {
    TORCH_CHECK(index >= 0 && index < num_layers(), "DecodeModel.set_moe: no layer ", index);
    TORCH_CHECK(top_k > 0, "DecodeModel.set_moe: top_k must be positive, got ", top_k);
    TORCH_CHECK((panels != nullptr) != (fused.size() == 2 || fused.size() == 6),
                "DecodeModel.set_moe: the experts are either panels or fused [w13, w2(, colsums, scales)]");
    auto m = std::make_unique<Moe>();
    m->router = make_linear(router, "router");
    m->top_k = top_k;
    m->renormalize = renormalize;
    m->cast_back = cast_back;
    m->panels = std::move(panels);
    m->amx_min_rows = amx_min_rows;
    m->fused = std::move(fused);
    m->b13 = b13;
    m->b2 = b2;
    m->activation = activation;
    m->alpha = alpha;
    m->limit = limit;
    m->shared = !shared_gate_up.empty();
    if (m->shared) {
      m->shared_gate_up = make_linear(shared_gate_up, "shared_gate_up");
      m->shared_down = make_linear(shared_down, "shared_down");
      m->shared_gated = !shared_gate.empty();
      if (m->shared_gated) m->shared_gate = make_linear(shared_gate, "shared_gate");
    }
    max_rows_ = std::min(max_rows_, max_rows);
    layers_[index].moe = std::move(m);
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // the largest decode batch the stack takes (the experts' kernels' limit, if any)
  int64_t max_rows() const { return max_rows_; }

  // h: [M, hidden] bf16 (the embeddings of the new tokens); kv: the pool's buffer
  // [layers, 2, pages, kv_heads, page_size, D]; page_table [M, max_pages] and seq_lens [M] int32;
  // cos/sin: [M, D] float32. Returns (h, residual) after the last layer, before the final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, const at::Tensor& kv, const at::Tensor& page_table,
                                             const at::Tensor& seq_lens, const at::Tensor& cos, const at::Tensor& sin) {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kBFloat16,
                "DecodeModel.forward: h must be a contiguous bf16 [M, hidden] tensor");
    TORCH_CHECK(kv.dim() == 6 && kv.size(0) == num_layers() && kv.size(3) == kv_heads_ && kv.size(5) == D_ &&
                    kv.is_contiguous(),
                "DecodeModel.forward: kv must be the pool's [layers, 2, pages, kv_heads, page_size, head_dim] buffer");
    const int64_t M = h.size(0), page_size = kv.size(4);
    TORCH_CHECK(seq_lens.size(0) == M && page_table.size(0) == M, "DecodeModel.forward: batch sizes differ");
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int32_t* table = page_table.data_ptr<int32_t>();
    // rows of the new tokens' K/V in a [pages * kv_heads * page_size, D] view of one layer's K (or V)
    std::vector<int64_t> slot(M);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t pos = lens[i] - 1;
      TORCH_CHECK(pos >= 0 && pos / page_size < page_table.size(1), "DecodeModel.forward: bad seq_len ", lens[i]);
      slot[i] = int64_t(table[i * page_table.stride(0) + pos / page_size]) * kv_heads_ * page_size + pos % page_size;
    }
    at::Tensor residual;
    const bool flash = kv.scalar_type() == at::kBFloat16 && flash_supported(D_);
    const at::Tensor q_starts = flash ? at::arange(M + 1, seq_lens.options()) : at::Tensor();
    const int64_t q_cols = heads_ * D_, kv_cols = kv_heads_ * D_;
    // one set of activation buffers for all layers (each is consumed before the next layer writes
    // it; h_buf never aliases the residual, which starts as the caller's h)
    at::Tensor x_buf, qkv_buf, qn_buf, kn_buf, attn_buf, h_buf, gu_buf, act_buf;
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Layer& L = layers_[l];
      at::Tensor x = workspace(x_buf, h.sizes(), h);
      if (l == 0) {
        residual = h;
        rms_norm(x, h, c10::nullopt, L.norm1, eps_);
      } else {
        rms_norm(x, h, residual, L.norm1, eps_);
      }
      at::Tensor qkv = L.qkv(x, gemv_rows_, qkv_buf);
      at::Tensor q = heads_view(qkv, 0, heads_, D_);
      at::Tensor k = heads_view(qkv, q_cols, kv_heads_, D_);
      at::Tensor v = heads_view(qkv, q_cols + kv_cols, kv_heads_, D_);
      if (L.q_norm.has_value()) {
        at::Tensor qn = workspace(qn_buf, {M * heads_, D_}, qkv);
        at::Tensor kn = workspace(kn_buf, {M * kv_heads_, D_}, qkv);
        rms_norm(qn, q.reshape({M * heads_, D_}), c10::nullopt, *L.q_norm, eps_);
        rms_norm(kn, k.reshape({M * kv_heads_, D_}), c10::nullopt, *L.k_norm, eps_);
        q = qn.view({M, heads_, D_});
        k = kn.view({M, kv_heads_, D_});
      }
      rotary_embedding(q, k, cos, sin);
      TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "DecodeModel.forward: k/v rows must be contiguous");
      at::Tensor kc = kv.select(0, l).select(0, 0);  // [pages, kv_heads, page_size, D]
      at::Tensor vc = kv.select(0, l).select(0, 1);
      store(kc, k, slot, page_size);
      store(vc, v, slot, page_size);
      at::Tensor attn = workspace(attn_buf, {M, heads_, D_}, qkv);
      if (flash)
        paged_attention_bf16(attn, q, kc, vc, page_table, seq_lens, q_starts, scale_, L.window);
      else
        paged_decode_attention(attn, q, kc, vc, page_table, seq_lens, scale_, L.window);
      h = L.o(attn.view({M, q_cols}), gemv_rows_, h_buf);
      x = workspace(x_buf, h.sizes(), h);
      rms_norm(x, h, residual, L.norm2, eps_);
      if (L.moe) {
        h = sparse_mlp(*L.moe, x, gu_buf, act_buf, h_buf);
        continue;
      }
      at::Tensor gu = L.gate_up(x, gemv_rows_, gu_buf);
      at::Tensor act = workspace(act_buf, {M, gu.size(1) / 2}, gu);
      silu_and_mul(act, gu);
      h = L.down(act, gemv_rows_, h_buf);
    }
    return {h, residual};
  }

 private:
  // parts: [weight, bias or None] for a weight multiplied by at::linear (a router's, as F.linear),
  // [vnni, onednn, bias] for bf16 weights, [vnni, None, bias, out_features] for bf16 weights
  // without oneDNN, [None, None, bias, packed, colsum, scale, out_features]
  // for w8a8_int8 (out_features as a 0-d int64 tensor), [None, None, bias, packed, scale,
  // (block_k, out_features, max_rows, amx_min_rows[, codes])] for panel weights (int64 [4] or [5]:
  // the panel kernel of `codes`, 0 FP8 by default, 1 MXFP4, 2 int4, 3 int4 with int8 activations
  // (linear_int4_w4a8), 4 MXFP4 with int8 activations (linear_mxfp4_w4a8), up to max_rows, on AMX from
  // amx_min_rows; past max_rows FP8 dequantizes for the GEMM)
  static Linear make_linear(const std::vector<c10::optional<at::Tensor>>& parts, const char* name) {
    Linear lin;
    if (parts.size() == 2 && parts[0].has_value()) {  // [weight, bias or None]: at::linear
      lin.plain = *parts[0];
      lin.bias = parts[1];
      lin.out_features = lin.plain.size(0);
      return lin;
    }
    lin.bias = parts.size() >= 3 ? parts[2] : c10::nullopt;
    if (parts.size() == 6 && parts[3].has_value()) {
      lin.f_packed = *parts[3];
      lin.f_scale = *parts[4];
      const at::Tensor dims = parts[5]->contiguous();
      TORCH_CHECK((dims.numel() == 4 || dims.numel() == 5) && dims.scalar_type() == at::kLong,
                  "DecodeModel.add_layer: ", name,
                  ": the panel form ends with an int64 [block_k, out_features, max_rows, amx_min_rows(, codes)]");
      lin.f_block_k = dims.data_ptr<int64_t>()[0];
      lin.out_features = dims.data_ptr<int64_t>()[1];
      lin.fp8_max_rows = dims.data_ptr<int64_t>()[2];
      lin.fp8_amx_min_rows = dims.data_ptr<int64_t>()[3];
      lin.f_codes = dims.numel() == 5 ? dims.data_ptr<int64_t>()[4] : 0;
      TORCH_CHECK(lin.f_codes >= 0 && lin.f_codes <= 4, "DecodeModel.add_layer: ", name,
                  ": codes must be 0 (FP8), 1 (MXFP4), 2 (int4), 3 (int4, int8 activations) or 4 (MXFP4, int8 "
                  "activations)");
      TORCH_CHECK(lin.f_codes == 0 || lin.fp8_max_rows >= (int64_t(1) << 62), "DecodeModel.add_layer: ", name,
                  ": only FP8 panels have a row limit (the dequantized GEMM past it)");
      return lin;
    }
    if (parts.size() == 7 && parts[3].has_value()) {
      lin.q_packed = *parts[3];
      lin.q_colsum = *parts[4];
      lin.q_scale = *parts[5];
      lin.out_features = parts[6]->item<int64_t>();
      return lin;
    }
    // [vnni, None, bias, out_features]: GEMV only, at every batch size (batch invariant)
    const bool gemv_only = parts.size() == 4 && parts[0].has_value() && !parts[1].has_value() && parts[3].has_value();
    TORCH_CHECK((parts.size() == 3 && parts[1].has_value()) || gemv_only, "DecodeModel.add_layer: ", name,
                " must be [vnni or None, onednn, bias or None], [vnni, None, bias or None, out_features] or the w8a8 form");
    if (parts[0].has_value()) lin.vnni = *parts[0];
    if (gemv_only) {
      lin.out_features = parts[3]->item<int64_t>();
      return lin;
    }
    lin.onednn = *parts[1];
    lin.out_features = lin.onednn.size(0);
    return lin;
  }

  // x's rows through a sparse MLP (the header's formulas, in layers/moe/'s ops and order)
  at::Tensor sparse_mlp(const Moe& m, const at::Tensor& x, at::Tensor& gu_buf, at::Tensor& act_buf,
                        at::Tensor& h_buf) const {
    at::Tensor logits_buf;
    at::Tensor logits = m.router(x, gemv_rows_, logits_buf);
    auto top = at::topk(at::softmax(logits, -1, at::kFloat), m.top_k, -1, true, true);
    at::Tensor w = std::get<0>(top);
    if (m.renormalize) w = w / w.sum(-1, true);
    if (m.cast_back) w = w.to(logits.scalar_type());
    w = w.to(at::kFloat).contiguous();
    const at::Tensor ids = std::get<1>(top).to(at::kInt).contiguous();
    at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
    if (m.panels)
      m.panels->forward(out, x, ids, w, m.amx_min_rows);
    else if (m.fused.size() == 2)
      moe_experts_bf16(out, x, ids, w, m.fused[0], m.fused[1], m.b13, m.b2, m.activation, m.alpha, m.limit);
    else
      moe_experts_w8a8(out, x, ids, w, m.fused[0], m.fused[2], m.fused[3], m.fused[1], m.fused[4], m.fused[5], m.b13,
                       m.b2, m.activation, m.alpha, m.limit);
    at::Tensor y = out.to(x.scalar_type());
    if (!m.shared) return y;
    at::Tensor gu = m.shared_gate_up(x, gemv_rows_, gu_buf);
    at::Tensor act = workspace(act_buf, {x.size(0), gu.size(1) / 2}, gu);
    silu_and_mul(act, gu);
    at::Tensor s = m.shared_down(act, gemv_rows_, h_buf);
    if (m.shared_gated) {
      at::Tensor g_buf;
      s = at::sigmoid(m.shared_gate(x, gemv_rows_, g_buf)) * s;
    }
    return y + s;
  }

  // the new tokens' rows of k or v [M, kv_heads, D] (bf16) into one layer's cache
  // [pages, kv_heads, page_size, D] (bf16 or float32)
  void store(at::Tensor& cache, const at::Tensor& src, const std::vector<int64_t>& slot, int64_t page_size) const {
    const int64_t M = src.size(0);
    const uint16_t* s = data<uint16_t>(src);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t hh = 0; hh < kv_heads_; ++hh) {
        const int64_t row = slot[i] + hh * page_size;  // (page * kv_heads + hh) * page_size + offset
        const uint16_t* from = s + i * src.stride(0) + hh * src.stride(1);
        if (cache.scalar_type() == at::kBFloat16) {
          std::memcpy(data<uint16_t>(cache) + row * D_, from, D_ * sizeof(uint16_t));
        } else {
          float* to = data<float>(cache) + row * D_;
          for (int64_t d = 0; d < D_; ++d) to[d] = bf16_to_f32(from[d]);
        }
      }
    }
  }

  int64_t heads_, kv_heads_, D_, gemv_rows_;
  int64_t max_rows_ = std::numeric_limits<int64_t>::max();
  double eps_, scale_;
  std::vector<Layer> layers_;
};

void bind_decode_model(pybind11::module& m) {
  pybind11::class_<DecodeModel>(m, "DecodeModel")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_layer", &DecodeModel::add_layer)
      .def("set_moe", &DecodeModel::set_moe)
      .def("num_layers", &DecodeModel::num_layers)
      .def("max_rows", &DecodeModel::max_rows)
      .def("forward", &DecodeModel::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace pds
