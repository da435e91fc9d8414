// Python bindings of pdserve's CPU kernels and the run-time ISA checks they dispatch on.
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor type caster

#include <string>

#include "common.h"

namespace py = pybind11;

namespace pds {

void mla_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& page_table,
                          const at::Tensor& seq_lens, double scale, int64_t v_dim,
                          const c10::optional<at::Tensor>& positions);
void indexer_topk(at::Tensor out, at::Tensor count, const at::Tensor& q, const at::Tensor& weights,
                  const at::Tensor& cache, const at::Tensor& page_table, const at::Tensor& seq_lens, double scale);
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale, int64_t window,
                            const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& k_scales,
                            const c10::optional<at::Tensor>& v_scales, double k_scale, double v_scale);
void paged_attention_bf16(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                          double scale, int64_t window, const c10::optional<at::Tensor>& sinks, int64_t amx_min_rows,
                          const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                          double k_scale, double v_scale);
bool flash_supported(int64_t head_dim);
void rms_norm(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& weight, double eps);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up);
void linear_vnni(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias,
                 int64_t amx_min_rows);
void linear_f32(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias);
void linear_fp8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                c10::optional<at::Tensor> bias, int64_t block_k, int64_t amx_min_rows);
void fp8_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale, int64_t block_k);
void linear_mxfp4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  c10::optional<at::Tensor> bias, int64_t amx_min_rows);
void mxfp4_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale);
void linear_int4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                 c10::optional<at::Tensor> bias, int64_t block_k, int64_t amx_min_rows);
void int4_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale, int64_t block_k);
void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                 const at::Tensor& w_scale, c10::optional<at::Tensor> bias, int64_t amx_min_rows);
void moe_experts_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w2, c10::optional<at::Tensor> b13,
                      c10::optional<at::Tensor> b2, const std::string& activation, double alpha, double limit);
void moe_experts_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w13_colsum, const at::Tensor& w13_scale,
                      const at::Tensor& w2, const at::Tensor& w2_colsum, const at::Tensor& w2_scale,
                      c10::optional<at::Tensor> b13, c10::optional<at::Tensor> b2, const std::string& activation,
                      double alpha, double limit);
void short_conv_decode_step(at::Tensor out, const at::Tensor& bx, at::Tensor conv_state, const at::Tensor& slots,
                            const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
void short_conv_scan(at::Tensor out, const at::Tensor& bx, at::Tensor conv_state, int64_t slot,
                     const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
void mamba2_decode_step(at::Tensor out, const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_state,
                        at::Tensor ssm_state, const at::Tensor& slots, const at::Tensor& conv_weight,
                        const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias,
                        const at::Tensor& A_log, const at::Tensor& D, int64_t groups);
void gated_delta_decode_step(at::Tensor out, const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta,
                             at::Tensor conv_state, at::Tensor rec_state, const at::Tensor& slots,
                             const at::Tensor& conv_weight, int64_t key_heads);
void mamba2_scan(at::Tensor y, const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_state,
                 at::Tensor ssm_state, int64_t slot, const at::Tensor& conv_weight,
                 const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias, const at::Tensor& A_log,
                 const at::Tensor& D, int64_t groups, double dt_min, double dt_max);
void gated_delta_scan(at::Tensor o, const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta,
                      at::Tensor conv_state, at::Tensor rec_state, int64_t slot, const at::Tensor& conv_weight,
                      int64_t key_heads);
void moe_pack_experts(at::Tensor out, const at::Tensor& w, const at::Tensor& rows);
void bind_decode_model(pybind11::module& m);
void bind_panel_experts(pybind11::module& m);
void linear_int4_w4a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      c10::optional<at::Tensor> bias, int64_t group);
void linear_mxfp4_w4a8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       c10::optional<at::Tensor> bias);
void bind_amx(pybind11::module& m);
const char* amx_isa_name();

}  // namespace pds

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute kernels run without the GIL: a long call (a 16k-token chunk's attention on one
  // core) must not stop the process's other threads (PD heartbeats and keepalives, ZMQ I/O).
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa", []() {
    if (const char* amx = pds::amx_isa_name()) return std::string(amx);
    const std::string tier = pds::isa_tier();
    return tier == "amx" ? std::string("avx512_bf16") : tier;  // tiles unused (disabled, not checked yet)
  }, "the instruction-set tier the kernels run at now (amx_bf16 / amx_bf16_emulated when tiles are used)");
  m.def("isa_tier", &pds::isa_tier, "the tier the kernels are capped at (what set_isa set, else the host's top)");
  m.def("available_isas", &pds::available_isas, "the tiers this CPU can run, lowest first");
  m.def("cpu_features", []() { return pds::feature_names(pds::cpu_features()); },
        "the instruction-set extensions the kernels found on this CPU");
  m.def("set_isa", [](const std::string& name) {
    if (!pds::set_isa_tier(name)) {
      std::string have;
      for (const auto& t : pds::available_isas()) have += (have.empty() ? "" : ", ") + t;
      throw pybind11::value_error("ISA tier '" + name + "' is not available on this CPU (available: " + have + ")");
    }
  }, "cap the kernels at a tier of available_isas() (tests, benchmarks)");
  m.def("paged_decode_attention", &pds::paged_decode_attention, nogil, "paged decode attention (in place into out)",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("page_table"), pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window"),
        pybind11::arg("sinks") = pybind11::none(), pybind11::arg("k_scales") = pybind11::none(),
        pybind11::arg("v_scales") = pybind11::none(), pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("paged_attention_bf16", &pds::paged_attention_bf16, nogil,
        "bf16 attention of every new token (decode and prefill rows) over the paged pool",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("page_table"), pybind11::arg("seq_lens"), pybind11::arg("q_starts"), pybind11::arg("scale"),
        pybind11::arg("window"), pybind11::arg("sinks") = pybind11::none(), pybind11::arg("amx_min_rows") = -1,
        pybind11::arg("k_scales") = pybind11::none(), pybind11::arg("v_scales") = pybind11::none(),
        pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("mla_decode_attention", &pds::mla_decode_attention, nogil,
        "latent attention decode, absorbed form: keys are the latent rows, values their first v_dim dims",
        py::arg("out"), py::arg("q"), py::arg("cache"), py::arg("page_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("v_dim"), py::arg("positions") = py::none());
  m.def("indexer_topk", &pds::indexer_topk, nogil,
        "DeepSeek-V3.2's lightning indexer: each row's top-k key positions (ascending; ties to the lowest position)",
        py::arg("out"), py::arg("count"), py::arg("q"), py::arg("weights"), py::arg("cache"), py::arg("page_table"),
        py::arg("seq_lens"), py::arg("scale"));
  m.def("flash_supported", &pds::flash_supported, "whether paged_attention_bf16 runs here for this head_dim");
  m.def("rms_norm", &pds::rms_norm, nogil, "RMSNorm, optionally after a residual add (in place)");
  m.def("rotary_embedding", &pds::rotary_embedding, nogil, "rotate-half RoPE of q and k in place");
  m.def("silu_and_mul", &pds::silu_and_mul, nogil, "out = silu(gate) * up");
  pds::bind_decode_model(m);
  pds::bind_panel_experts(m);
  pds::bind_amx(m);
  m.def("linear_f32", &pds::linear_f32, nogil, "x w^T (+ bias) in float32, one k-ordered FMA chain per output (batch invariant)");
  m.def("linear_fp8", &pds::linear_fp8, nogil,
        "x w^T (+ bias) for FP8 e4m3 block-scaled weights packed [N/64, K, 64] with scales [N/64, K/bk, 64] "
        "(batch invariant)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"), py::arg("block_k"),
        py::arg("amx_min_rows") = -1);
  m.def("fp8_dequantize", &pds::fp8_dequantize, nogil,
        "the float32 or bf16 weight of linear_fp8's packed panels (value * scale, transformers' rounding)",
        py::arg("out"), py::arg("packed"), py::arg("scale"), py::arg("block_k"));
  m.def("linear_mxfp4", &pds::linear_mxfp4, nogil,
        "x w^T (+ bias) for MXFP4 weights packed [N/64, K, 32] with E8M0 scales [N/64, K/32, 64] "
        "(linear_fp8's kernels; batch invariant)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"),
        py::arg("amx_min_rows") = -1);
  m.def("mxfp4_dequantize", &pds::mxfp4_dequantize, nogil,
        "the float32 or bf16 weight of linear_mxfp4's packed panels (exact in float32)", py::arg("out"),
        py::arg("packed"), py::arg("scale"));
  m.def("linear_int4", &pds::linear_int4, nogil,
        "x w^T (+ bias) for symmetric int4 weights (codes q + 8) packed [N/64, K, 32] with scales "
        "[N/64, K/bk, 64] (times 256; linear_fp8's kernels, batch invariant)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"), py::arg("block_k"),
        py::arg("amx_min_rows") = -1);
  m.def("int4_dequantize", &pds::int4_dequantize, nogil, "the float32 or bf16 weight of linear_int4's packed panels",
        py::arg("out"), py::arg("packed"), py::arg("scale"), py::arg("block_k"));
  m.def("linear_int4_w4a8", &pds::linear_int4_w4a8, nogil,
        "int4 weights x per-row int8 activations (W4A8, opt-in): codes packed [N/64, K/4, 128], scale [N/64, "
        "K/group, 64] float32; the same bits at every tier and batch",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"), py::arg("group"));
  m.def("linear_mxfp4_w4a8", &pds::linear_mxfp4_w4a8, nogil,
        "MXFP4 weights x per-row int8 activations (opt-in): e2m1 codes in linear_int4_w4a8's quads, scale [N/64, K/32, "
        "64] float32 (2^(e - 127) / 2); the same bits at every tier and batch",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"));
  m.def("linear_w8a8", &pds::linear_w8a8, nogil, "int8 weights x per-token int8 activations (w8a8_int8), dequantized",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("colsum"), pybind11::arg("w_scale"),
        pybind11::arg("bias"), pybind11::arg("amx_min_rows") = -1);
  m.def("has_int8_dot", []() { return pds::use_avx2() || pds::use_neon(); },
        "whether the int8 kernels run on SIMD dot products here (AVX2, AVX-VNNI, AVX512-VNNI, NEON)");
  m.def("linear_vnni", &pds::linear_vnni, nogil, "x w^T (+ bias), bf16 weight packed [N/64, K/2, 4, 16, 2], bf16 or fp32 out",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"),
        pybind11::arg("amx_min_rows") = -1);
  m.def("moe_experts_bf16", &pds::moe_experts_bf16, nogil,
        "fused MoE experts (gate/up, activation, down, weighted sum over slots), bf16 weights packed per expert");
  m.def("moe_experts_w8a8", &pds::moe_experts_w8a8, nogil, "fused MoE experts with w8a8_int8 weights and activations");
  m.def("short_conv_decode_step", &pds::short_conv_decode_step, nogil,
        "LFM2's short convolution of each request's one new input, no activation, its window updated in place at "
        "its slot",
        py::arg("out"), py::arg("bx"), py::arg("conv_state"), py::arg("slots"), py::arg("weight"), py::arg("bias"));
  m.def("short_conv_scan", &pds::short_conv_scan, nogil,
        "LFM2's short convolution of one request's new inputs, no activation, its window at `slot` updated in place",
        py::arg("out"), py::arg("bx"), py::arg("conv_state"), py::arg("slot"), py::arg("weight"), py::arg("bias"));
  m.def("mamba2_decode_step", &pds::mamba2_decode_step, nogil,
        "Mamba2's decode step: convolution, SiLU and the SSM update of each request's state in place at its slot",
        py::arg("out"), py::arg("xbc"), py::arg("dt"), py::arg("conv_state"), py::arg("ssm_state"), py::arg("slots"),
        py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_bias"), py::arg("A_log"), py::arg("D"),
        py::arg("groups"));
  m.def("gated_delta_decode_step", &pds::gated_delta_decode_step, nogil,
        "Gated DeltaNet's decode step: convolution, SiLU, L2 norms and the delta rule on each request's state in "
        "place at its slot",
        py::arg("out"), py::arg("qkv"), py::arg("g"), py::arg("beta"), py::arg("conv_state"), py::arg("rec_state"),
        py::arg("slots"), py::arg("conv_weight"), py::arg("key_heads"));
  m.def("mamba2_scan", &pds::mamba2_scan, nogil,
        "Mamba2's convolution and scan over the new tokens of one request (prefill), its state updated in place "
        "at its slot",
        py::arg("y"), py::arg("xbc"), py::arg("dt"), py::arg("conv_state"), py::arg("ssm_state"), py::arg("slot"),
        py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_bias"), py::arg("A_log"), py::arg("D"),
        py::arg("groups"), py::arg("dt_min"), py::arg("dt_max"));
  m.def("gated_delta_scan", &pds::gated_delta_scan, nogil,
        "Gated DeltaNet's convolution, L2 norms and delta rule over the new tokens of one request (prefill), its "
        "state updated in place at its slot",
        py::arg("o"), py::arg("qkv"), py::arg("g"), py::arg("beta"), py::arg("conv_state"), py::arg("rec_state"),
        py::arg("slot"), py::arg("conv_weight"), py::arg("key_heads"));
  m.def("moe_pack_experts", &pds::moe_pack_experts, nogil, "lay out [E, N, K] expert weights in the fused MoE kernel's panels");
}
