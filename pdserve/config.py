"""Server arguments: one dataclass, validated in ``__post_init__``, plus argparse wiring.

Flag names follow SGLang's where the concept is the same. Every field is also a keyword of
``pdserve.Engine(...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from dataclasses import dataclass
from typing import Any, Optional

from pdserve import envs
from pdserve.hicache_args import check_hicache_args
from pdserve.lora_args import check_lora_args
from pdserve.moe_args import MOE_A2A_BACKENDS, MOE_RUNNER_BACKENDS, check_moe_args, moe_options
from pdserve.multimodal.args import check_image_args
from pdserve.peers import MigrationPeers

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("local", "fake", "mooncake", "nixl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# int8 / fp8_*: a quantized cache (engine/kv_quant.py); fp8 is fp8_e4m3, as vLLM and SGLang take it
KV_CACHE_DTYPES = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "int8",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
)
ATTENTION_BACKENDS = ("auto", "torch", "cpu")
QUANTIZATIONS = ("w8a8_int8",)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
# where the transfer layer can be made to fail on purpose (tests and chaos runs); see
# disagg/faults.py
FAULT_MODES = (
    "fail_transfer",
    "drop_status",
    "delay_transfer",
    "corrupt_aux_room",
    "kill_transfer_thread",
)
# the allowed values of the flags that have a fixed set (argparse ``choices``)
CHOICES = {
    "dtype": DTYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "quantization": QUANTIZATIONS,
    "disaggregation_mode": DISAGGREGATION_MODES,
    "disaggregation_transfer_backend": TRANSFER_BACKENDS,
    "load_format": LOAD_FORMATS,
    "schedule_policy": SCHEDULE_POLICIES,
    "moe_a2a_backend": MOE_A2A_BACKENDS,
    "moe_runner_backend": MOE_RUNNER_BACKENDS,
    "grammar_backend": GRAMMAR_BACKENDS,
}
# SGLang's other spellings of a flag
FLAG_ALIASES = {"ep_size": ("--ep", "--expert-parallel-size"), "lora_paths": ("--lora-modules",)}


def default_torch_threads() -> int:
    return max(1, (os.cpu_count() or 1))


# speculative decoding: what runs, and SGLang's names of what does not yet
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "MTP")
SPECULATIVE_NOT_BUILT: tuple[str, ...] = ()
# those that read --speculative-draft-model-path
DRAFT_MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3", "MTP")
MAX_DRAFT_TOKENS = 16
# an EAGLE head's tree: at most this many children per token (its first level travels in PD's
# metadata row, this many wide, whatever top-k decode uses)
MAX_EAGLE_TOPK = 16
TREE_ALGORITHMS = ("EAGLE", "EAGLE3", "MTP")


@dataclass
class ServerArgs:
    # model
    model_path: str = ""
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # auto: the CPU kernel on CPU when it builds, else torch
    quantization: Optional[str] = (
        None  # w8a8_int8: int8 weights and per-token int8 activations (CPU)
    )
    # int4 (compressed-tensors pack-quantized) checkpoints: each int4 layer's input quantized to
    # int8 per token (w8a8_int8's rule) for integer dot products, W4A8; opt-in (README)
    int4_int8_activations: bool = False
    # MXFP4 experts (GPT-OSS): each expert matmul's input quantized to int8 per token, the e2m1
    # codes times those in integer dot products; opt-in (README)
    mxfp4_int8_activations: bool = False
    device: str = "auto"
    load_format: str = "auto"
    context_length: Optional[int] = None
    random_seed: int = 0
    # a request's tokens and logprobs do not depend on the batch, chunking, prefix-cache hits or PD
    # (batch-invariant matmuls and attention; SGLang's flag; docs/determinism.md)
    enable_deterministic_inference: bool = False
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = (
        None  # clients send "Authorization: Bearer KEY" (all routes but /health, /metrics)
    )
    # memory and scheduling
    page_size: int = 16
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.5
    # sliding-window cache groups get this share of the full-attention groups' tokens (SGLang's
    # flag)
    swa_full_tokens_ratio: float = 0.8
    # keep every page of sliding-window layers (the window is applied by masking only), as SGLang's
    # flag
    disable_hybrid_swa_memory: bool = False
    chunked_prefill_size: int = 2048  # prefill tokens of one request per batch
    max_prefill_tokens: Optional[int] = (
        None  # prefill tokens per batch (None: chunked_prefill_size)
    )
    max_running_requests: int = 256
    # slots of the recurrent-state pool (linear-attention layers), one per running request (SGLang's
    # flag); None: --max-running-requests
    max_mamba_cache_size: Optional[int] = None
    schedule_policy: str = "fcfs"
    # admission (SGLang's flags): at most this many requests wait to run (the waiting queue and
    # the PD queues before it); one more is refused with 429 and Retry-After (None: no cap)
    max_queued_requests: Optional[int] = None
    # stored responses of POST /v1/responses kept for previous_response_id and GET (least
    # recently used first out; 0: none kept)
    responses_store_size: int = 10_000
    # OpenTelemetry: each request's spans to this OTLP/HTTP collector (pdserve/tracing.py)
    otlp_traces_endpoint: Optional[str] = None
    # a request's ``priority`` orders the waiting queue before the policy does, and a full queue
    # sheds its lowest-priority request for a higher one; larger values first unless
    # schedule_low_priority_values_first
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    # with every running place taken, a waiting request whose priority is at least this much above
    # a running one's preempts it (retracted: computed again later); not on a prefill server
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    # a request with a priority sent to a server without priority scheduling: 400 instead of
    # ignoring it
    abort_on_priority_when_disabled: bool = False
    disable_radix_cache: bool = False
    # LoRA adapters (pdserve/lora/; SGLang's and vLLM's flags): NAME=PATH (or PATH, named by its
    # folder) loaded at start, more at run time (/v1/load_lora_adapter); --lora-paths enables it
    enable_lora: bool = False
    lora_paths: Optional[list[str]] = None
    max_lora_rank: int = 64
    max_loaded_loras: int = 16
    # images (pdserve/multimodal/; a vision-language model): data: URLs, and file: URLs under
    # --allowed-local-media-path only (no network fetch); per request at most this many images,
    # each at most this many bytes encoded and pixels decoded
    allowed_local_media_path: Optional[str] = None
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 8192 * 8192
    # no vision tower on this server (SGLang's flag): a decode server of a vision-language model,
    # whose prompts' KV come from prefill, or a prefill whose images encoder servers compute
    language_only: bool = False
    # EPD (pdserve/multimodal/encoder_server.py): this server runs the vision tower alone, for
    # prefills that reach it on --disaggregation-bootstrap-port
    encoder_only: bool = False
    # a prefill's side of EPD (encoder_queue.py): embedding rows it can receive at once, how long
    # an encoder may take, and how many images' embeddings it keeps by their pixels' digest
    encoder_pool_tokens: int = 8192
    encoder_timeout: float = 60.0
    encoder_cache_images: int = 64
    # speculative decoding (SGLang's flags; engine/speculative/): NGRAM proposes the tokens that
    # followed the latest earlier occurrence of the sequence's last n tokens, STANDALONE a draft
    # model's greedy tokens
    speculative_algorithm: Optional[str] = None
    speculative_num_draft_tokens: int = 4  # drafts verified per step and request
    speculative_draft_model_path: Optional[str] = None  # STANDALONE's draft model
    # the draft's steps per row: with top-k 1 a chain of num_steps drafts (when given, the drafts
    # per row), with top-k > 1 the depth of the tree (None: as deep as its drafts allow)
    speculative_num_steps: Optional[int] = None
    # an EAGLE head's children per token: 1 a chain, > 1 a tree of num_draft_tokens drafts
    speculative_eagle_topk: Optional[int] = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # KV cache events (ZMQ PUB, vLLM/SGLang wire format); the port is offset by the DP group
    kv_events_endpoint: Optional[str] = None  # e.g. tcp://*:5557
    kv_events_replay_endpoint: Optional[str] = None  # e.g. tcp://*:5558
    kv_events_topic: str = ""
    # hierarchical cache (SGLang's flags; engine/kv_tier): below the pool, a host tier of
    # hicache_ratio times its pages (or hicache_size GB), then a storage backend (file: a
    # directory, PDSERVE_HICACHE_FILE_BACKEND_STORAGE_DIR)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0  # GB; overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"  # or write_back (on eviction)
    hicache_storage_backend: Optional[str] = None
    hicache_file_backend_storage_dir: str = "/tmp/hicache"
    # the disk tier's size bound in GB, least recently used entries dropped past it (0: half the
    # space free on its filesystem when the server starts)
    hicache_file_backend_max_gb: float = 0.0
    hicache_storage_write_queue: int = 1024  # pages queued for storage; more are dropped
    # a JSON object of the storage backend's settings (mooncake: engine/kv_tier/mooncake_config.py)
    hicache_storage_backend_extra_config: Optional[str] = None
    # process
    torch_num_threads: Optional[int] = None  # per rank (default: the host's cores / ranks)
    tp_size: int = 1
    dp_size: int = 1  # attention data-parallel groups (with enable_dp_attention)
    enable_dp_attention: bool = False
    pp_size: int = 1
    # mixture of experts (SGLang's flags; layers/moe/context.py)
    ep_size: int = 1  # expert-parallel groups over the tp ranks (experts split by id)
    moe_a2a_backend: str = (
        "none"  # none: all-gather + all-reduce; torch: all-to-all dispatch (needs ep == tp)
    )
    moe_dense_tp_size: Optional[int] = None  # 1: the dense layers of MoE models are replicated
    moe_runner_backend: str = (
        "auto"  # auto (the fused CPU kernel where it runs), fused, grouped_mm, loop
    )
    init_expert_location: str = "trivial"  # or a placement / distribution file (JSON)
    ep_num_redundant_experts: int = 0  # extra expert slots holding copies of hot experts
    expert_distribution_recorder_mode: Optional[str] = (
        None  # stat: count tokens per layer per expert
    )
    enable_return_routed_experts: bool = False  # requests may ask for return_routed_experts
    # the OpenAI API's structured outputs, tool calls and reasoning (server/openai_tools.py)
    grammar_backend: str = "xgrammar"  # the engine of response_format / json_schema / regex / ebnf
    tool_call_parser: Optional[str] = (
        None  # llama3, qwen25, mistral, gpt-oss, deepseekv3, ... (SGLang's names)
    )
    reasoning_parser: Optional[str] = None  # deepseek-r1, qwen3, gpt-oss, ...
    chat_template: Optional[str] = (
        None  # a Jinja file (or the template itself) instead of the tokenizer's
    )
    log_level: str = "info"
    enable_access_log: bool = False
    skip_warmup: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    # one server over several hosts (SGLang's flags; server/nodes.py): node 0 runs the front end and
    # ranks [0, world/nnodes), node r only ranks [r*world/nnodes, (r+1)*world/nnodes)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = (
        None  # HOST:PORT on node 0: torch.distributed at PORT, outputs at PORT+1
    )
    dist_timeout: float = 120.0  # seconds a collective may wait (distributed.COLLECTIVE_TIMEOUT_S)
    # disaggregation
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "local"
    disaggregation_bootstrap_port: int = 8998
    # decode: the bootstrap port its requests move out on (POST /migrate); 0: any free port
    migration_bootstrap_port: int = 0
    # decode: the decodes it may move requests to and take them from (pdserve/peers.py): HOST,
    # HOST:PORT, ADDR/PREFIX or *, comma-separated; none by default
    migration_peers: Optional[str] = None
    num_reserved_decode_tokens: int = 512
    # decode keeps finished requests' KV in its radix cache; prefill sends only the pages it lacks
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_bootstrap_timeout: float = 30.0
    disaggregation_waiting_timeout: float = 30.0
    disaggregation_heartbeat_interval: float = 1.0
    disaggregation_heartbeat_misses: int = 3
    disaggregation_prealloc_timeout: float = (
        5.0  # decode: fail a request that cannot get pages this long
    )
    disaggregation_max_prealloc_queue: int = (
        0  # decode: refuse new requests beyond this many waiting (0: no limit)
    )
    # prefill: send each group of layers' pages as soon as the forward has written them, so the
    # transfer overlaps the rest of the forward (prompts of at least the minimum length; decode
    # needs no setting: it waits for the room's completion either way)
    enable_disagg_layer_pipeline: bool = False
    disagg_layer_group_size: int = 4
    disagg_layer_pipeline_min_prefill_len: int = 2048
    disaggregation_mooncake_protocol: Optional[str] = None
    disaggregation_ib_device: Optional[str] = None
    disaggregation_nixl_backend: str = "UCX"
    disaggregation_secret: Optional[str] = None
    disaggregation_require_secret: bool = (
        False  # refuse to expose PD endpoints beyond loopback without a secret
    )
    # fault injection (prefill's transfer layer): probability that a room gets a fault, which modes
    disaggregation_fault_prob: float = 0.0
    disaggregation_fault_mode: str = "fail_transfer"
    disaggregation_fault_delay: float = 1.0  # seconds, for delay_transfer
    disaggregation_fault_ranks: Optional[str] = (
        None  # comma-separated TP ranks that inject (None: all)
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if not self.model_path:
            bad("model_path", "is required")
        check_lora_args(self, bad)
        check_image_args(self, bad)
        if self.grammar_backend in GRAMMAR_BACKENDS:
            from pdserve.grammar import resolve_backend

            self.grammar_backend, self._grammar_note = resolve_backend(self.grammar_backend)
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad(
                "attention_backend",
                f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
            )
        if self.load_format not in LOAD_FORMATS:
            bad("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.device == "auto":
            self.device = "cuda" if envs.cuda_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            bad("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            bad(
                "quantization",
                f"must be one of {QUANTIZATIONS} (or unset), got {self.quantization!r}",
            )
        if self.quantization is not None and self.device != "cpu":
            bad(
                "quantization",
                f"{self.quantization!r} is implemented for the CPU only, "
                f"but device is {self.device!r}",
            )
        if self.enable_deterministic_inference and self.moe_runner_backend == "grouped_mm":
            bad(
                "moe_runner_backend",
                "'grouped_mm' sums a row differently with the batch; "
                "--enable-deterministic-inference runs the experts on the fused kernel ('auto')",
            )
        if self.quantization is not None and self.dtype in ("float32", "float16"):
            bad(
                "quantization",
                f"{self.quantization!r} computes in bfloat16; "
                f"it cannot be combined with --dtype {self.dtype}",
            )
        if self.attention_backend == "cpu" and self.device != "cpu":
            bad("attention_backend", f"'cpu' runs on the CPU only, but device is {self.device!r}")
        if self.page_size < 1:
            bad("page_size", f"must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            bad(
                "max_total_tokens",
                f"must be >= page_size ({self.page_size}), got {self.max_total_tokens}",
            )
        if not 0.0 < self.mem_fraction_static <= 1.0:
            bad("mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static}")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            bad("swa_full_tokens_ratio", f"must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.chunked_prefill_size < self.page_size:
            bad(
                "chunked_prefill_size",
                f"must be >= page_size ({self.page_size}), got {self.chunked_prefill_size}",
            )
        if self.max_prefill_tokens is None:
            self.max_prefill_tokens = self.chunked_prefill_size
        if self.max_prefill_tokens < 1:
            bad("max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        if self.max_running_requests < 1:
            bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.otlp_traces_endpoint:
            from pdserve.tracing import check_installed

            try:
                check_installed()
            except ValueError as e:
                bad("otlp_traces_endpoint", str(e).split(": ", 1)[1])
        if self.responses_store_size < 0:
            bad("responses_store_size", f"must be >= 0, got {self.responses_store_size}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            bad("max_queued_requests", f"must be >= 1, got {self.max_queued_requests}")
        if self.priority_scheduling_preemption_threshold < 0:
            bad(
                "priority_scheduling_preemption_threshold",
                f"must be >= 0, got {self.priority_scheduling_preemption_threshold}",
            )
        if self.schedule_low_priority_values_first and not self.enable_priority_scheduling:
            bad("schedule_low_priority_values_first", "needs --enable-priority-scheduling")
        self._check_speculative(bad)
        # (with the prefix cache a running request takes two: model_runner checks it, after the
        # role's rules have said whether this server caches prefixes)
        if self.max_mamba_cache_size is not None and (
            self.max_mamba_cache_size < self.max_running_requests
        ):
            bad(
                "max_mamba_cache_size",
                f"{self.max_mamba_cache_size} state slots cannot hold max_running_requests "
                f"({self.max_running_requests}) requests; lower max_running_requests or raise it",
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            bad(
                "schedule_policy",
                f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}",
            )
        if self.context_length is not None and self.context_length < 1:
            bad("context_length", f"must be >= 1, got {self.context_length}")
        if self.tp_size < 1:
            bad("tp_size", f"must be >= 1, got {self.tp_size}")
        if self.dp_size < 1:
            bad("dp_size", f"must be >= 1, got {self.dp_size}")
        if self.dp_size > 1 and not self.enable_dp_attention:
            bad(
                "dp_size",
                f"{self.dp_size} needs --enable-dp-attention (data-parallel attention groups "
                "inside one server); for independent replicas run several servers behind the "
                "router",
            )
        if self.enable_dp_attention and (
            self.dp_size > self.tp_size or self.tp_size % self.dp_size
        ):
            bad(
                "dp_size",
                f"with --enable-dp-attention it must divide --tp-size ({self.tp_size}), "
                f"got {self.dp_size}",
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                bad(name, f"must be a ZMQ endpoint such as tcp://*:5557, got {value!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            bad("kv_events_replay_endpoint", "needs --kv-events-endpoint")
        if self.pp_size < 1:
            bad("pp_size", f"must be >= 1, got {self.pp_size}")
        check_moe_args(self, bad)
        check_hicache_args(self, bad)
        if self.pp_size > 1 and (self.tp_size > 1 or self.dp_size > 1):
            bad(
                "pp_size",
                f"{self.pp_size} together with --tp-size {self.tp_size} / --dp-size {self.dp_size} "
                "is not supported in this version: use pipeline stages of one rank each",
            )
        if self.pp_size > 1 and self.disaggregation_mode == "decode":
            bad(
                "pp_size",
                "a decode server must have pp_size 1 (prefill's pipeline stages send their own "
                "layers; decode holds every layer)",
            )
        if self.torch_num_threads is not None and self.torch_num_threads < 1:
            bad("torch_num_threads", f"must be >= 1, got {self.torch_num_threads}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            bad(
                "disaggregation_mode",
                f"must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}",
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            bad(
                "disaggregation_transfer_backend",
                f"must be one of {TRANSFER_BACKENDS}, got {self.disaggregation_transfer_backend!r}",
            )
        if self.disagg_layer_group_size < 1:
            bad(
                "disagg_layer_group_size",
                f"must be at least 1 (layers per transfer), got {self.disagg_layer_group_size}",
            )
        if self.disagg_layer_pipeline_min_prefill_len < 0:
            bad(
                "disagg_layer_pipeline_min_prefill_len",
                f"must be >= 0 (prompt tokens), got {self.disagg_layer_pipeline_min_prefill_len}",
            )
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            bad(
                "disaggregation_bootstrap_port",
                f"must be a TCP port, got {self.disaggregation_bootstrap_port}",
            )
        if not 0 <= self.migration_bootstrap_port < 65536:
            bad(
                "migration_bootstrap_port",
                f"must be a TCP port, or 0 for any free one, got {self.migration_bootstrap_port}",
            )
        if self.num_reserved_decode_tokens < 0:
            bad(
                "num_reserved_decode_tokens", f"must be >= 0, got {self.num_reserved_decode_tokens}"
            )
        for name in (
            "disaggregation_bootstrap_timeout",
            "disaggregation_waiting_timeout",
            "disaggregation_heartbeat_interval",
            "disaggregation_prealloc_timeout",
        ):
            if getattr(self, name) <= 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.disaggregation_heartbeat_misses < 1:
            bad(
                "disaggregation_heartbeat_misses",
                f"must be >= 1, got {self.disaggregation_heartbeat_misses}",
            )
        if self.disaggregation_max_prealloc_queue < 0:
            bad(
                "disaggregation_max_prealloc_queue",
                f"must be >= 0, got {self.disaggregation_max_prealloc_queue}",
            )
        if not 0.0 <= self.disaggregation_fault_prob <= 1.0:
            bad(
                "disaggregation_fault_prob",
                f"must be in [0, 1], got {self.disaggregation_fault_prob}",
            )
        modes = [m.strip() for m in str(self.disaggregation_fault_mode).split(",") if m.strip()]
        unknown = [m for m in modes if m not in FAULT_MODES]
        if not modes or unknown:
            bad(
                "disaggregation_fault_mode",
                f"must be a comma-separated list of {FAULT_MODES}, "
                f"got {self.disaggregation_fault_mode!r}",
            )
        if self.disaggregation_fault_delay < 0:
            bad(
                "disaggregation_fault_delay", f"must be >= 0, got {self.disaggregation_fault_delay}"
            )
        if self.disaggregation_fault_ranks is not None:
            try:
                ranks = [int(r) for r in self.disaggregation_fault_ranks.split(",") if r.strip()]
            except ValueError:
                ranks = []
            if not ranks or any(not 0 <= r < self.world_size for r in ranks):
                bad(
                    "disaggregation_fault_ranks",
                    f"must be a comma-separated list of ranks in [0, {self.world_size}), "
                    f"got {self.disaggregation_fault_ranks!r}",
                )
        self._check_access(bad)
        self._check_nodes(bad)
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path

    def moe_options(self):
        """The MoE part, as the model layers take it (``layers/moe/context.py``)."""
        return moe_options(self)

    def _check_access(self, bad) -> None:
        """Who may reach the server and where a request may make it connect: keys, secrets and
        the migration peers."""
        try:
            MigrationPeers.of(self.migration_peers)
        except ValueError as e:
            bad("migration_peers", str(e))
        if self.disaggregation_secret == "":
            bad(
                "disaggregation_secret",
                "must not be empty (leave it unset to turn authentication off)",
            )
        if self.api_key == "":
            bad("api_key", "must not be empty (leave it unset to serve without a key)")
        if (
            self.disaggregation_require_secret
            and self.exposes_control_plane
            and not self.disaggregation_secret
        ):
            bad(
                "disaggregation_require_secret",
                f"--host {self.host} exposes this {self.disaggregation_mode} "
                "server's bootstrap and KV control endpoints beyond this host, and no "
                "--disaggregation-secret is set to authenticate them",
            )

    def _check_nodes(self, bad) -> None:
        """The multi-host flags against the rank layout."""
        if self.nnodes < 1:
            bad("nnodes", f"must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            bad(
                "dist_init_addr",
                f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address, "
                "where every node's ranks join)",
            )
        if self.world_size % self.nnodes:
            bad(
                "nnodes",
                f"the world size --tp-size {self.tp_size} x --pp-size {self.pp_size} = "
                f"{self.world_size} is not divisible by --nnodes {self.nnodes}",
            )
        if self.dist_init_addr is not None:
            try:
                split_host_port(self.dist_init_addr)
            except ValueError as e:
                bad("dist_init_addr", str(e))
        if self.dist_timeout <= 0:
            bad("dist_timeout", f"must be > 0 seconds, got {self.dist_timeout}")
        if self.nnodes > 1 and self.disaggregation_mode != "null":
            bad(
                "nnodes",
                f"--nnodes {self.nnodes} with --disaggregation-mode {self.disaggregation_mode} is "
                "not supported in this version (the other nodes' ranks would register with a "
                "bootstrap server on their own host): run PD servers of one host each",
            )

    @property
    def exposes_control_plane(self) -> bool:
        """A PD server whose bootstrap and ZMQ control endpoints (bound to ``host``) are reachable
        from other hosts."""
        return self.disaggregation_mode != "null" and not is_loopback(self.host)

    def start_notes(self) -> list[str]:
        """Defaults this configuration could not have on this host, and what it uses instead
        (logged at start-up)."""
        return [self._grammar_note] if getattr(self, "_grammar_note", "") else []

    def exposure_warnings(self) -> list[str]:
        """What this configuration leaves open to the network (logged prominently at start-up)."""
        out = []
        if self.exposes_control_plane and not self.disaggregation_secret:
            out.append(
                f"--host {self.host} exposes the bootstrap server and the KV control endpoints "
                "without --disaggregation-secret: anyone who reaches them can register ranks and "
                "send control messages (--disaggregation-require-secret refuses to start like this)"
            )
        if MigrationPeers.of(self.migration_peers).any:
            out.append(
                "--migration-peers *: POST /migrate and /switch_role's migrate_to connect to any "
                "host and port their caller names, and /migrate_in to any bootstrap_host; list "
                "the decodes (or their network) instead"
            )
        if not is_loopback(self.host) and not self.api_key:
            out.append(
                f"--host {self.host} serves HTTP beyond this host without --api-key: anyone who "
                "reaches it can generate and control the server"
            )
        if self.nnodes > 1 and not is_loopback(split_host_port(self.dist_init_addr)[0]):
            out.append(
                f"--nnodes {self.nnodes}: torch.distributed and the front end's output socket "
                f"listen on --dist-init-addr {self.dist_init_addr} (that port and the next) "
                "without authentication: keep them on a network only the server's nodes reach"
            )
        return out

    def _check_speculative(self, bad) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        if algo.upper() in SPECULATIVE_NOT_BUILT:
            bad(
                "speculative_algorithm",
                f"{algo!r} is not available yet; supported: {SPECULATIVE_ALGORITHMS}",
            )
        if algo.upper() not in SPECULATIVE_ALGORITHMS:
            bad("speculative_algorithm", f"must be one of {SPECULATIVE_ALGORITHMS}, got {algo!r}")
        self.speculative_algorithm = algo.upper()
        if self.speculative_algorithm == "MTP" and not self.speculative_draft_model_path:
            # the next-token-prediction layers are in the target's checkpoint
            self.speculative_draft_model_path = self.model_path
        draft = self.speculative_draft_model_path
        if self.speculative_algorithm in DRAFT_MODEL_ALGORITHMS and not draft:
            bad(
                "speculative_draft_model_path",
                f"is required with speculative_algorithm {self.speculative_algorithm!r} (the "
                "draft model's directory)",
            )
        if self.speculative_algorithm not in DRAFT_MODEL_ALGORITHMS and draft:
            bad(
                "speculative_draft_model_path",
                f"a draft model is used by speculative_algorithm {DRAFT_MODEL_ALGORITHMS}, not "
                f"{self.speculative_algorithm!r}",
            )
        topk = self.speculative_eagle_topk
        if topk is not None and not 1 <= topk <= MAX_EAGLE_TOPK:
            bad("speculative_eagle_topk", f"must be in [1, {MAX_EAGLE_TOPK}], got {topk}")
        tree = (topk or 1) > 1
        if tree and self.speculative_algorithm not in TREE_ALGORITHMS:
            bad(
                "speculative_eagle_topk",
                f"{topk} builds a tree of a draft head's proposals ({TREE_ALGORITHMS}); "
                f"{self.speculative_algorithm!r} proposes a chain (top-k 1)",
            )
        if tree and self.enable_deterministic_inference:
            bad(
                "speculative_eagle_topk",
                f"{topk}: a tree's rows attend under a mask the batch-invariant kernels of "
                "--enable-deterministic-inference do not take; use 1 (a chain) with it",
            )
        steps = self.speculative_num_steps
        if steps is not None:
            if not 1 <= steps <= MAX_DRAFT_TOKENS:
                bad("speculative_num_steps", f"must be in [1, {MAX_DRAFT_TOKENS}], got {steps}")
            if not tree:
                # a chain of ``steps`` drafts: SGLang counts the row's own token among its draft
                # tokens (num_steps + 1), pdserve counts the drafts
                self.speculative_num_draft_tokens = steps
        n = self.speculative_num_draft_tokens
        if not 1 <= n <= MAX_DRAFT_TOKENS:
            bad("speculative_num_draft_tokens", f"must be in [1, {MAX_DRAFT_TOKENS}], got {n}")
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            bad(
                "speculative_ngram_min_match_window_size",
                f"must be in [1, speculative_ngram_max_match_window_size ({hi})], got {lo}",
            )

    @property
    def world_size(self) -> int:
        """Scheduler processes of the server: tp_size ranks per pipeline stage."""
        return self.tp_size * self.pp_size

    @property
    def role(self) -> str:
        return {"null": "serve", "prefill": "prefill", "decode": "decode"}[self.disaggregation_mode]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # ---- argparse wiring -------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.type in ("bool",) or isinstance(default, bool):
                parser.add_argument(flag, action="store_true", default=default)
                continue
            kind = {"int": int, "float": float, "str": str}.get(
                str(f.type).replace("Optional[", "").rstrip("]"), str
            )
            kw: dict = {"type": kind, "default": default}
            if "list[str]" in str(f.type):
                kw["nargs"] = "*"
            if f.name in CHOICES:
                kw["choices"] = CHOICES[f.name]
            parser.add_argument(flag, *FLAG_ALIASES.get(f.name, ()), **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {n: getattr(args, n) for n in names if hasattr(args, n)}
        envs.apply_env_defaults(kwargs, {f.name: f.default for f in dataclasses.fields(cls)})
        return cls(**kwargs)


def split_host_port(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) as (host, port); ValueError naming ``addr`` otherwise.
    The port must leave room for the next one (a multi-host server's output socket uses it)."""
    host, sep, port = str(addr).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or (":" in host and not addr.startswith("[")):
        raise ValueError(f"must be HOST:PORT (e.g. 10.0.0.1:5000, [fd00::1]:5000), got {addr!r}")
    if not 0 < int(port) < 65535:
        raise ValueError(f"port must be in [1, 65534] (the next port is used too), got {addr!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a socket reachable from this machine only (a wildcard or a
    name other than localhost counts as reachable from elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_option(server_args: Any, name: str) -> Any:
    """``server_args.<name>``, or ServerArgs' default when no server args are given (parts such as
    the KV manager can be built without a full configuration, e.g. in tests and benchmarks)."""
    if server_args is not None and hasattr(server_args, name):
        return getattr(server_args, name)
    return {f.name: f.default for f in dataclasses.fields(ServerArgs)}[name]
