"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): compressed attention over a sliding window, hash-routed
and scored MoE, and manifold-constrained hyper-connections around every block.

**Attention.** One head of ``head_dim`` is both key and value (MQA), normalised and rotated on its
trailing ``head_dim * partial_rotary_factor`` channels (interleaved pairs); 64 query heads from a
low-rank path (``wq_a`` -> ``q_norm`` -> ``wq_b``, then an unweighted RMSNorm per head); a learned
sink per head; the output's rope slice rotated back by its own position, then a grouped low-rank
projection (``wo_a``: ``o_groups`` blocks, ``wo_b``). Every layer reads a window of
``sliding_window`` keys (``kv_spec.LatentWindow``: the single head kept once). By
``layer_types``:

- ``sliding_attention``: the window only;
- ``heavily_compressed_attention``: and the entries of every closed window of ``rate`` (128)
  tokens (``CompressedEntries``), each query the entries whose windows closed at or before it;
- ``compressed_sparse_attention``: and entries per ``rate`` (4) tokens from two overlapping
  series, of which each query reads only the ``index_topk`` its lightning indexer picks among
  those closed (the indexer keeps its own compressed keys, ``part="index_k"``), ties to the
  lowest entry.

The compressors (``layers/compressor.py``) carry the open window (and the overlap slice) in a
``CompressorState`` per request; CSA and HCA layers use the ``compress`` rotary table, window-only
layers the ``main`` one.

**MoE** (``models/deepseek_v4_moe.py``): hash-routed and scored experts, a shared one, on the
shared MoE layer (expert parallelism, redundant experts, the expert recorder).
**Hyper-connections** (``layers/hyper_connections.py``): ``hc_mult`` residual streams mixed
around every block, collapsed by ``hc_head`` before the final norm.

Checkpoint names are the published ones (``attn.wq_a``, ``attn.compressor.wkv``,
``ffn.experts.E.w1``, ``hc_attn_fn``, ``head``, ...); the MTP layers (``mtp.*``) are set aside.
The weights HF keeps in float32 (norms, sinks, position biases, the mHC and router bias) stay
float32 in any model dtype.

**Tensor parallelism** splits the attention's output groups (a rank holds ``o_groups / tp`` of
them and their query heads; ``wo_b`` sums over the ranks) and every expert's intermediate
columns; the window, the compressors, the indexer, the router and the hyper-connections are
computed whole on every rank, so the caches are replicated and a decode of any TP size reads them
from one prefill rank. ``--ep-size`` places the experts by rank. Under data-parallel attention the
attention's ranks are the rank's attention group (its requests, its caches) and the MoE layers
gather every group's tokens (``SparseMoE.run``); a group without tokens joins their collectives
(``idle_forward``). Pipeline stages are refused at load, naming the option.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from pdserve.distributed import SINGLE, Parallel, TPGroup, shard_range
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import CompressedEntries, CompressorState, LatentWindow
from pdserve.layers.attention.base import AttnLayer
from pdserve.layers.compressor import Compressor, Indexer, rotate_trailing
from pdserve.layers.hyper_connections import HyperHead, hyper_weights, mix, unweighted_rms_norm
from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.moe.context import MoEContext, MoEOptions
from pdserve.layers.moe.layer import SparseMoE
from pdserve.layers.moe.placement import MoEModelInfo
from pdserve.layers.moe.placement_file import initial_placement
from pdserve.layers.moe.recorder import ExpertRecorder
from pdserve.layers.norm import GptOssRMSNorm
from pdserve.layers.rotary import attention_factor, inv_frequencies
from pdserve.models.deepseek_v4_moe import make_moe

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
STATE = "compressor_state"
# parameters HF keeps in float32 whatever the model's dtype (by the end of their names)
FLOAT32 = (
    "attn_sink",
    "position_bias",
    "norm.weight",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_fn",
    "hc_base",
    "hc_scale",
    "gate.correction",
)
# published compressor names -> the compressor module's
_COMPRESSOR_NAMES = {
    "wkv.weight": "kv_proj.weight",
    "wgate.weight": "gate_proj.weight",
    "ape": "position_bias",
    "norm.weight": "norm.weight",
}


def _rope(config, kind: str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of the ``main`` or ``compress`` rotary table."""
    params = dict(config.rope_parameters[kind])
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dim = int(config.head_dim * factor)
    params.setdefault("rope_type", "default")
    if params["rope_type"] not in ("default", "yarn"):
        raise ValueError(
            f"rope_parameters[{kind!r}]: rope_type {params['rope_type']!r} not supported for "
            "DeepseekV4ForCausalLM; supported: default, yarn"
        )
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        params.setdefault("max_position_embeddings", config.max_position_embeddings)
    scaling = attention_factor(params) if params["rope_type"] == "yarn" else 1.0
    return inv_frequencies(dim, params), scaling


class Attention(nn.Module):
    """One layer's attention; under tensor parallelism a rank holds whole output groups
    (``o_groups / tp`` of them) and their query heads; the window, the compressors and the
    indexer are computed whole on every rank (their caches are replicated)."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.kind = config.layer_types[layer_id]
        if self.kind not in (SLIDING, CSA, HCA):
            raise ValueError(
                f"layer_types[{layer_id}]: {self.kind!r} is not a DeepSeek-V4 layer kind; "
                f"supported: {SLIDING}, {CSA}, {HCA}"
            )
        heads, groups = config.num_attention_heads, config.o_groups
        if groups % tp.size or heads % groups:
            raise ValueError(
                f"o_groups: {groups} output groups of {heads} heads cannot be split whole over "
                f"tp_size {tp.size}; a rank holds whole groups"
            )
        g0, g1 = shard_range(groups, tp.rank, tp.size)
        per = heads // groups
        self.head_range, self.group_range = (g0 * per, g1 * per), (g0, g1)
        self.heads, self.groups, self.dim = (g1 - g0) * per, g1 - g0, config.head_dim
        self.eps, self.o_lora = config.rms_norm_eps, config.o_lora_rank
        hidden, q_lora = config.hidden_size, config.q_lora_rank
        self.wq_a = Linear(hidden, q_lora, bias=False)
        self.q_norm = GptOssRMSNorm(q_lora, config.rms_norm_eps)
        self.wq_b = Linear(q_lora, self.heads * self.dim, bias=False)
        self.wkv = Linear(hidden, self.dim, bias=False)
        self.norm = GptOssRMSNorm(self.dim, config.rms_norm_eps)
        self.wo_a = nn.Module()
        self.wo_a.weight = nn.Parameter(torch.empty(self.groups * self.o_lora, per * self.dim))
        self.wo_b = RowParallelLinear(self.groups * self.o_lora, hidden, bias=False, tp=tp)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.window = config.sliding_window
        self.attn = AttnLayer(layer_id, self.dim**-0.5, sliding_window=self.window, has_sinks=True)
        inv, scaling = _rope(config, "main" if self.kind == SLIDING else "compress")
        self.inv_freq = inv.float().clone()  # not a buffer: float32 in any model dtype
        self.scaling = scaling
        self.compressor: Optional[Compressor] = None
        self.indexer: Optional[Indexer] = None
        if self.kind != SLIDING:
            rate = config.compress_rates[self.kind]
            spec = CompressedEntries(self.dim, rate)
            self.compressor = Compressor(
                hidden, spec, self.kind == CSA, config.rms_norm_eps, inv, scaling
            )
            if self.kind == CSA:
                self.indexer = Indexer(config, inv, scaling)

    def shard(self, leaf: str, src):
        """This rank's part of the published weight ``attn.<leaf>``."""
        (h0, h1), (g0, g1), d, r = self.head_range, self.group_range, self.dim, self.o_lora
        if leaf == "wq_b.weight":
            return src[h0 * d : h1 * d]
        if leaf == "attn_sink":
            return src[h0:h1]
        if leaf == "wo_a.weight":
            return src[g0 * r : g1 * r]
        if leaf == "wo_b.weight":
            return src[:, g0 * r : g1 * r]
        return src[:]

    def compressors(self) -> list[Compressor]:
        out = [self.compressor] if self.compressor is not None else []
        return out + ([self.indexer.compressor] if self.indexer is not None else [])

    def cache_specs(self, dtype: str) -> tuple:
        window = LatentWindow(self.dim, 0, self.window)
        comps = self.compressors()
        if not comps:
            return (window,)
        names, shapes, dtypes = [], [], []
        for c in comps:
            n, s, d = c.state_parts(dtype)
            names, shapes, dtypes = names + list(n), shapes + list(s), dtypes + list(d)
        state = CompressorState(tuple(names), tuple(shapes), tuple(dtypes))
        return (window, *(c.spec for c in comps), state)

    def _entries(self, fb: ForwardBatch, layer: int, c: Compressor) -> tuple[torch.Tensor, Any]:
        """(this layer's entries [P, rows, dim] of compressor ``c``, its group's page table)."""
        group, slot = fb.layer_caches[layer][c.spec.key]
        table = fb.groups[group]
        return table.pool.entries(slot), table.page_table

    @staticmethod
    def _gather(entries, table, i: int, count: int, spec, page_size: int) -> torch.Tensor:
        """Request ``i``'s first ``count`` entries [count, dim] (every closed window's)."""
        page, row = spec.entry_location(torch.arange(count), page_size)
        return entries[table[i, page], row]

    def forward(self, h: torch.Tensor, fb: ForwardBatch, layer: int) -> torch.Tensor:
        t = h.shape[0]
        q_resid = self.q_norm(self.wq_a(h))
        q = unweighted_rms_norm(self.wq_b(q_resid).view(t, self.heads, self.dim), self.eps)
        q = rotate_trailing(q, fb.positions, self.inv_freq, self.scaling)
        kv = rotate_trailing(self.norm(self.wkv(h)), fb.positions, self.inv_freq, self.scaling)
        extra = None
        if self.compressor is not None:
            pool, index, slots = fb.state(layer, STATE)
            snaps = fb.snapshots(layer, STATE)
            keys = {}
            for c in self.compressors():
                entries, table = self._entries(fb, layer, c)
                c(h, fb.prefix_lens, fb.extend_lens, pool, index, slots, entries, table,
                  fb.page_size, snaps)  # fmt: skip
                keys[c.spec.part] = [
                    self._gather(entries, table, i, s // c.rate, c.spec, fb.page_size)
                    for i, s in enumerate(fb.seq_lens)
                ]
            if self.indexer is not None:
                masks = self.indexer.masks(h, q_resid, fb, keys["index_k"])
            else:
                masks = []
                for start, ext, k in zip(fb.extend_starts, fb.extend_lens, keys["kv"]):
                    pos = fb.positions[start : start + ext]
                    rate = self.compressor.rate
                    masks.append(torch.arange(k.shape[0])[None, :] < ((pos + 1) // rate)[:, None])
            extra = list(zip(keys["kv"], masks))
        o = fb.attn_backend.forward_window_kv(self.attn, q, kv, fb, self.attn_sink, extra)
        o = rotate_trailing(o, fb.positions, self.inv_freq, self.scaling, inverse=True)
        groups = o.reshape(t, self.groups, -1).transpose(0, 1)  # [G, T, H * D / G]
        w = self.wo_a.weight.view(self.groups, -1, groups.shape[-1]).transpose(1, 2)
        grouped = torch.bmm(groups, w).transpose(0, 1).reshape(t, -1)
        return self.wo_b(grouped)


class Layer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup, ffn: SparseMoE):
        super().__init__()
        n, hidden = config.hc_mult, config.hidden_size
        mixes = (2 + n) * n
        self.attn = Attention(config, layer_id, tp)
        self.ffn = ffn
        self.attn_norm = GptOssRMSNorm(hidden, config.rms_norm_eps)
        self.ffn_norm = GptOssRMSNorm(hidden, config.rms_norm_eps)
        self.config = config
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.empty(mixes, n * hidden)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.empty(mixes)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.empty(3)))

    def forward(self, streams: torch.Tensor, fb: ForwardBatch, layer: int) -> torch.Tensor:
        c = self.config
        post, comb, x = hyper_weights(
            c, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, streams
        )
        streams = mix(streams, self.attn(self.attn_norm(x), fb, layer), post, comb)
        post, comb, x = hyper_weights(
            c, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, streams
        )
        return mix(streams, self.ffn.run(self.ffn_norm(x), fb.dp, fb.input_ids), post, comb)


class Model(nn.Module):
    def __init__(self, config, tp: TPGroup, ctx: MoEContext):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        runner = "loop" if ctx.options.runner == "loop" else "grouped_mm"
        self.layers = nn.ModuleList(
            Layer(config, i, tp, make_moe(config, i, ctx, runner))
            for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config, tp=None, par=None, moe=None):
        super().__init__()
        self._refuse_parallel(tp, par, moe)
        quant = getattr(config, "quantization_config", None)
        if quant:
            raise ValueError(
                "quantization_config: quantized DeepSeek-V4 checkpoints are not served yet; use "
                "a bf16 or float32 checkpoint"
            )
        self.config = config
        self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
        self.total_layers = self.num_layers = config.num_hidden_layers
        self.first_layer = 0
        self.total_kv_heads = 1  # one head, the same on every rank
        self.num_attention_heads = config.num_attention_heads
        self.hc_mult = config.hc_mult
        tp = tp or SINGLE
        par = par or Parallel(world=tp, tp=tp, attn=tp)
        ctx = self._moe_context(config, par, moe)
        self.model = Model(config, par.attn, ctx)
        self.head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp_weights: dict[str, tuple] = {}

    def _moe_context(self, config, par: Parallel, moe) -> MoEContext:
        """The experts' placement over the ranks (``--ep-size``, ``--init-expert-location``,
        redundant slots) and, with ``--expert-distribution-recorder-mode stat``, the recorder."""
        options = moe if isinstance(moe, MoEOptions) else MoEOptions()
        ctx = MoEContext(par, options)
        ctx.check(config.n_routed_experts)
        layers = list(range(config.num_hidden_layers))
        info = self.moe_info()
        ctx.placement = initial_placement(
            options.init_expert_location,
            info,
            layers,
            ctx.ep_size,
            options.num_redundant_experts,
        )
        self.expert_recorder = None
        if options.record_experts:
            self.expert_recorder = ExpertRecorder(info, ctx.placement)
            ctx.observers.append(self.expert_recorder.observe)
        return ctx

    def moe_info(self) -> MoEModelInfo:
        c = self.config
        n = c.num_hidden_layers
        return MoEModelInfo("DeepseekV4ForCausalLM", n, c.n_routed_experts, tuple(range(n)))

    @staticmethod
    def _refuse_parallel(tp, par, moe) -> None:
        size = getattr(par, "pp_size", 1)
        if size and size > 1:
            raise ValueError(
                f"pp_size: {size}; DeepseekV4ForCausalLM runs with tensor, expert and "
                "data-parallel attention only in this version (its layers are not staged yet)"
            )

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for name, p in self.named_parameters():
            if name.endswith(FLOAT32) and p.dtype != torch.float32:
                p.data = p.data.float()
        return out

    # ---- the engine's view -----------------------------------------------------------------------
    def kv_cache_specs(self) -> list:
        dtype = str(self.head.weight.dtype).replace("torch.", "")
        return [layer.attn.cache_specs(dtype) for layer in self.model.layers]

    def attention_layers(self) -> list[AttnLayer]:
        return [layer.attn.attn for layer in self.model.layers]

    def prefix_namespace(self, seq_len: int) -> int:
        return 0

    def moe_blocks(self) -> list[SparseMoE]:
        return [layer.ffn for layer in self.model.layers]

    def use_cpu_kernels(self, ops) -> None:
        return None

    def prepack(self, ops, quantization=None, batch_invariant: bool = False) -> int:
        return 0

    def enable_decode_stack(self, ops, batch_invariant: bool = False) -> bool:
        return False

    def idle_forward(self, dp) -> None:
        """A DP-attention group with no tokens this step: join every MoE layer's collectives."""
        empty = torch.empty((0, self.hidden_size), dtype=self.head.weight.dtype)
        ids = torch.empty((0,), dtype=torch.long)
        for layer in self.model.layers:
            layer.ffn.run(empty, dp, ids)

    # ---- forward ---------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(input_ids)
        return e.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()

    def forward_layers(self, fb: ForwardBatch, h: torch.Tensor, residual):
        for i, layer in enumerate(self.model.layers):
            h = layer(h, fb, i)
            if fb.layer_done is not None:
                fb.layer_done(i)
        return h, residual

    def final_norm(self, h: torch.Tensor, residual) -> torch.Tensor:
        return self.model.norm(self.model.hc_head(h))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h, _ = self.forward_layers(fb, self.embed(fb.input_ids), None)
        return self.final_norm(h, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    # ---- weights ---------------------------------------------------------------------------------
    def _own_name(self, name: str) -> str:
        head, sep, tail = name.partition(".compressor.")
        if sep:
            return f"{head}.compressor.{_COMPRESSOR_NAMES.get(tail, tail)}"
        if name.endswith(".ffn.gate.bias"):  # the router's selection bias
            return name[: -len("bias")] + "correction"
        return name

    def _targets(self) -> dict[str, torch.Tensor]:
        out = dict(self.named_parameters())
        out.update(dict(self.named_buffers(remove_duplicate=False)))
        return out

    def _shard(self, name: str, src):
        """This rank's part of weight ``name`` (its own name): the attention's heads and groups,
        the experts' intermediate columns; the rest whole."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[3] == "attn":
            return self.model.layers[int(parts[2])].attn.shard(".".join(parts[4:]), src)
        if parts[:2] == ["model", "layers"] and parts[3:5] == ["ffn", "shared_experts"]:
            shared = self.model.layers[int(parts[2])].ffn.shared_experts
            return shared.shard(".".join(parts[5:]), src)
        return src[:]

    @staticmethod
    def _expert_weight(name: str) -> Optional[tuple[int, str]]:
        """(layer, the name under its ``experts``) of a routed expert's weight; None otherwise."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[3:5] == ["ffn", "experts"]:
            return int(parts[2]), ".".join(parts[5:])
        return None

    def checkpoint_weight_names(self) -> set[str]:
        """The published names of the weights this rank holds (its experts' only)."""
        reverse = {v: k for k, v in _COMPRESSOR_NAMES.items()}
        names = set()
        for name in self._targets():
            head, sep, tail = name.partition(".compressor.")
            if self._expert_weight(name) is not None:
                continue
            if name.endswith(".ffn.gate.correction"):
                name = name[: -len("correction")] + "bias"
            names.add(f"{head}.compressor.{reverse.get(tail, tail)}" if sep else name)
        for i, layer in enumerate(self.model.layers):
            names.update(
                f"model.layers.{i}.ffn.experts.{n}" for n in layer.ffn.experts.checkpoint_names()
            )
        return names

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        targets, seen = self._targets(), set()
        for name, src in weights:
            if name.startswith("mtp."):
                shape = src.get_shape() if hasattr(src, "get_shape") else src.shape
                self.mtp_weights[name] = tuple(shape)
                continue
            expert = self._expert_weight(name)
            if expert is not None:  # the experts load their slots (none: held elsewhere)
                self.model.layers[expert[0]].ffn.experts.load_checkpoint(expert[1], src)
                seen.add(name)
                continue
            own = self._own_name(name)
            target = targets.get(own)
            if target is None:
                raise ValueError(f"unexpected weight {name!r} for DeepseekV4ForCausalLM")
            t = self._shard(own, src)
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(
                    f"{name}: expected shape {tuple(target.shape)}, got {tuple(t.shape)}"
                )
            target.data.copy_(t)
            seen.add(name)
        missing = sorted(self.checkpoint_weight_names() - seen)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights: {missing[:5]} ...")
