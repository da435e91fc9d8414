"""Expert routers: from a token's hidden state to its top-k experts and their weights.

Each router is the formula of one HF family, with its dtypes (they decide bf16 equality):

- ``SoftmaxTopK``: softmax over every expert's logit in float32, top-k, optionally renormalised
  to sum 1 (``norm_topk_prob``); Qwen2-MoE and Qwen3-MoE cast the weights back to the logits'
  dtype, Mixtral (always renormalised) keeps them in float32.
- ``TopKSoftmax``: top-k of the logits (with a bias), softmax over those k only (GPT-OSS).
- ``BiasedSoftmaxTopK``: float32 logits and softmax, the top k chosen by the softmax plus a
  selection bias, weighted by their softmax renormalised (the sum clamped below), cast back
  (ERNIE 4.5's MoE).
- ``TopKSigmoid``: top-k of the logits, each chosen one's weight the sigmoid of its logit in
  float32, cast back to the logits' dtype (Llama 4, whose experts take the weight on their input:
  ``SparseMoE.weights_on_input``).

A router owns the gate matrix (``weight`` [E, H], HF's name under the MoE block) and returns a
``Routing``. Grouped sigmoid routing with a correction bias and a routed scaling factor
(DeepSeek-V3) fits the same shape: its weights and logits are float32 (``fp32_logits``) and
``Routing.weights`` carries the scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.float32_params import Float32Params


@dataclass
class Routing:
    """Logical expert ids [T, K] (int64) and their weights [T, K] (the dtype the experts' outputs
    are scaled in: float32 or the model's)."""

    ids: torch.Tensor
    weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


class Router(Float32Params, nn.Module):
    """``weight`` [num_experts, hidden] (+ ``bias``); ``forward(h [T, H]) -> Routing``."""

    fp32_logits = False  # compute the logits in float32 whatever the model dtype (DeepSeek-V3)
    # parameters kept float32 whatever the model's dtype, as HF keeps them (its float32 gates)
    float32_params: tuple[str, ...] = ()

    def __init__(self, hidden: int, num_experts: int, top_k: int, bias: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: {top_k} must be in [1, num_experts = {num_experts}]"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def prepack(self, ops, batch_invariant: bool) -> int:
        """With ``batch_invariant``: the gate matmul on pdserve's kernels, whose rows do not depend
        on each other (``F.linear``'s do: BLAS blocks by shape); returns the packed bytes."""
        if not batch_invariant:
            return 0
        from pdserve.layers.linear import PackedBF16, PackedF32

        bias = None if self.bias is None else self.bias.data
        if self.fp32_logits or self.weight.dtype == torch.float32:
            self.invariant = PackedF32(self.weight.data, bias, ops)
        else:
            self.invariant = PackedBF16(self.weight.data, bias, ops, batch_invariant=True)
        return self.invariant.nbytes

    invariant = None  # the batch-invariant gate matmul, set by ``prepack``

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            return self.invariant(h)
        if self.fp32_logits:
            return F.linear(
                h.float(), self.weight.float(), None if self.bias is None else self.bias.float()
            )
        return F.linear(h, self.weight, self.bias)

    def select(self, logits: torch.Tensor) -> Routing:
        raise NotImplementedError

    needs_token_ids = False  # a router that chooses by the token's id (``HashTopK``)

    def forward(self, h: torch.Tensor) -> Routing:
        return self.select(self.logits(h))


class SoftmaxTopK(Router):
    def __init__(
        self, hidden: int, num_experts: int, top_k: int, renormalize: bool, cast_back: bool
    ):
        super().__init__(hidden, num_experts, top_k)
        self.renormalize = renormalize
        self.cast_back = cast_back

    def select(self, logits: torch.Tensor) -> Routing:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_back:
            weights = weights.to(logits.dtype)
        return Routing(ids, weights)


class TopKSoftmax(Router):
    """The top k logits, then a softmax over them: in the logits' dtype (GPT-OSS), or with
    ``float32`` over float32 logits, the weights cast back to the model dtype (Granite)."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, bias: bool = True, float32: bool = False
    ):
        super().__init__(hidden, num_experts, top_k, bias=bias)
        self.float32 = float32

    def select(self, logits: torch.Tensor) -> Routing:
        dtype = logits.dtype
        top, ids = torch.topk(logits.float() if self.float32 else logits, self.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=top.dtype)
        return Routing(ids, weights.to(dtype) if self.float32 else weights)


class BiasedSoftmaxTopK(Router):
    """The gate weight and ``e_score_correction_bias`` ([1, E], as checkpoints store it) stay
    float32 in any model dtype, as HF keeps them; ``norm_min`` bounds the renormalisation's sum."""

    fp32_logits = True
    float32_params = ("weight", "e_score_correction_bias")

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_min: float):
        super().__init__(hidden, num_experts, top_k)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(1, num_experts, dtype=torch.float32)
        )
        self.norm_min = norm_min

    def select(self, logits: torch.Tensor) -> Routing:
        probs = F.softmax(logits.float(), dim=-1, dtype=torch.float32)
        ids = torch.topk(probs + self.e_score_correction_bias[0], self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return Routing(ids, weights)


class Float32SoftmaxTopK(SoftmaxTopK):
    """Softmax top-k renormalised, the gate weight kept float32 in any model dtype and the logits
    and weights float32 (Hunyuan's MoE, whose gate HF builds in float32)."""

    fp32_logits = True
    float32_params = ("weight",)

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__(hidden, num_experts, top_k, renormalize=True, cast_back=False)


class SparseMixerTop2(Router):
    """PhiMoE's sparsemixer as it routes at inference: the best expert, weighted by its softmax
    over the experts within ``2 * jitter_eps`` (relative to ``max(|score|, best)``) of the best
    score, the others masked; then the best of the rest, weighted the same way with the first
    masked out. Weights in the logits' dtype."""

    def __init__(self, hidden: int, num_experts: int, jitter_eps: float):
        super().__init__(hidden, num_experts, 2)
        self.jitter_eps = jitter_eps

    def _pick(self, scores: torch.Tensor, candidates: torch.Tensor):
        best, idx = candidates.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * self.jitter_eps
        gates = torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)
        return gates.gather(-1, idx), idx

    def select(self, logits: torch.Tensor) -> Routing:
        w1, i1 = self._pick(logits, logits)
        w2, i2 = self._pick(logits, logits.scatter(-1, i1, float("-inf")))
        return Routing(torch.cat([i1, i2], dim=-1), torch.cat([w1, w2], dim=-1))


class TopKSigmoid(Router):
    """The top k logits, each weighted by its own sigmoid (no normalisation over the k)."""

    def select(self, logits: torch.Tensor) -> Routing:
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return Routing(ids, torch.sigmoid(top.float()).to(logits.dtype))


def granite_router(config) -> TopKSoftmax:
    return TopKSoftmax(
        config.hidden_size,
        config.num_local_experts,
        config.num_experts_per_tok,
        bias=False,
        float32=True,
    )


def qwen_router(config, hidden: Optional[int] = None) -> SoftmaxTopK:
    """Qwen2-MoE / Qwen3-MoE: ``norm_topk_prob`` decides the renormalisation; weights cast back."""
    return SoftmaxTopK(
        hidden or config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        cast_back=True,
    )


def mixtral_router(config) -> SoftmaxTopK:
    return SoftmaxTopK(
        config.hidden_size,
        config.num_local_experts,
        config.num_experts_per_tok,
        renormalize=True,
        cast_back=False,
    )


def topk_ordered(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest of each row, by the defined rule: highest first, the
    lowest index first among equal values. ``torch.topk`` breaks ties in an order that depends on
    the row's length and the kernel; a stable descending sort does not."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, E] True for the experts of each row's ``topk_group`` best groups."""
    groups = group_scores.shape[-1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, topk_ordered(group_scores, topk_group)[1], True)
    return keep.unsqueeze(-1).expand(-1, groups, scores.shape[-1] // groups).reshape(scores.shape)


class GroupedSoftmaxTopK(Router):
    """DeepSeek-V2: softmax over the experts in float32; ``greedy`` takes the top k, and
    ``group_limited_greedy`` first keeps the ``topk_group`` groups whose best expert scores
    highest (the others' scores become 0); the weights are the scores times
    ``routed_scaling_factor``, not renormalised."""

    fp32_logits = True
    METHODS = ("greedy", "group_limited_greedy")

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        method: str,
        n_group: int,
        topk_group: int,
        scaling: float,
    ):
        super().__init__(hidden, num_experts, top_k)
        if method not in self.METHODS:
            raise ValueError(
                f"topk_method: {method!r} is not supported for this model; supported: "
                f"{self.METHODS}"
            )
        if method == "group_limited_greedy":
            _check_groups(num_experts, top_k, n_group, topk_group)
        self.method, self.n_group, self.topk_group, self.scaling = (
            method,
            n_group,
            topk_group,
            scaling,
        )

    def select(self, logits: torch.Tensor) -> Routing:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.method == "group_limited_greedy":
            best = scores.view(-1, self.n_group, self.num_experts // self.n_group).amax(dim=-1)
            scores = scores.masked_fill(~_group_mask(scores, best, self.topk_group), 0.0)
        weights, ids = topk_ordered(scores, self.top_k)
        return Routing(ids, weights * self.scaling)


class TwoBestGroupsRouter(Router):
    """A router that scores each of ``n_group`` groups by the sum of its two best experts, keeps
    the ``topk_group`` best groups and takes the top k of their experts, whose weights it
    renormalises (``renormalize``) and scales (``scaling``); subclasses say how experts score."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        renormalize: bool,
        scaling: float,
    ):
        super().__init__(hidden, num_experts, top_k)
        _check_groups(num_experts, top_k, n_group, topk_group)
        if num_experts // n_group < 2:
            raise ValueError(
                f"n_group: {n_group} groups of {num_experts // n_group} expert(s); a group's score "
                "is the sum of its two best experts, so each group needs at least 2"
            )
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling

    @classmethod
    def of(cls, config) -> "TwoBestGroupsRouter":
        """The router of an HF config with DeepSeek-V3's routing fields."""
        return cls(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.n_group or 1,
            config.topk_group or 1,
            bool(getattr(config, "norm_topk_prob", True)),
            config.routed_scaling_factor,
        )

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> Routing:
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(ids, weights * self.scaling)


class GroupedSigmoidTopK(TwoBestGroupsRouter):
    """DeepSeek-V3 (and GLM-4.5): sigmoid scores in float32; the selection adds
    ``e_score_correction_bias`` (float32, selection only), scores each group by the sum of its two
    best experts, keeps the ``topk_group`` best groups and takes the top k of their experts; the
    weights are the unbiased scores of the chosen experts, renormalised when ``norm_topk_prob``,
    times ``routed_scaling_factor``. The gate weight and the bias stay float32 in any model dtype,
    as HF keeps them."""

    fp32_logits = True
    float32_params = ("weight", "e_score_correction_bias")

    def __init__(self, hidden: int, num_experts: int, *args):
        super().__init__(hidden, num_experts, *args)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))

    def select(self, logits: torch.Tensor) -> Routing:
        scores = rowwise_sigmoid(logits.float())
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = topk_ordered(per_group, 2)[0].sum(dim=-1)
        choice = choice.masked_fill(
            ~_group_mask(choice, group_scores, self.topk_group), float("-inf")
        )
        return self._weights(scores, topk_ordered(choice, self.top_k)[1])


class GroupedSoftmaxSumTopK(TwoBestGroupsRouter):
    """Mistral 4: softmax scores in the logits' dtype (the model's), each group scored by the sum
    of its two best experts, the ``topk_group`` best groups kept (the others' scores 0), the top
    k of the scores; their weights renormalised when ``norm_topk_prob``, times
    ``routed_scaling_factor``. Top-k ties go to the lowest expert id."""

    def select(self, logits: torch.Tensor) -> Routing:
        scores = logits.softmax(dim=-1)
        per_group = scores.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = topk_ordered(per_group, 2)[0].sum(dim=-1)
        choice = scores.masked_fill(~_group_mask(scores, group_scores, self.topk_group), 0.0)
        return self._weights(scores, topk_ordered(choice, self.top_k)[1])


def rowwise_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid`` of [T, E] whose rows do not depend on T. PyTorch runs an elementwise op over the
    flattened tensor in whole SIMD vectors and the remainder on a scalar path, which can differ in
    the last bit; with fewer columns than a vector, which rows fall in the remainder depends on the
    row count. Padding each row to a multiple of 64 columns puts every element in a whole vector."""
    pad = -x.shape[-1] % 64
    if pad == 0:
        return x.sigmoid()
    return torch.nn.functional.pad(x, (0, pad)).sigmoid()[..., : x.shape[-1]]


def _check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group: {n_group} does not divide the {num_experts} routed experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: {topk_group} must be in [1, n_group = {n_group}]")
    if topk_group * (num_experts // n_group) < top_k:
        raise ValueError(
            f"num_experts_per_tok: {top_k} experts cannot come from {topk_group} group(s) of "
            f"{num_experts // n_group}"
        )


class SqrtSoftplusTopK(Router):
    """DeepSeek-V4's scored experts: scores ``sqrt(softplus(logits))`` in the logits' dtype, the
    top k of the scores plus a float32 ``correction`` (HF's ``gate.bias``, a selection bias: it
    does not weigh), their scores renormalised and scaled by ``routed_scaling_factor``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, scaling: float):
        super().__init__(hidden, num_experts, top_k)
        self.scaling = scaling
        self.correction = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    @staticmethod
    def scores(logits: torch.Tensor) -> torch.Tensor:
        return F.softplus(logits).sqrt()

    def weigh(self, scores: torch.Tensor, ids: torch.Tensor) -> Routing:
        w = scores.gather(1, ids)
        return Routing(ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling)

    def select(self, logits: torch.Tensor) -> Routing:
        scores = self.scores(logits)
        ids = torch.topk(scores + self.correction, self.top_k, dim=-1, sorted=False).indices
        return self.weigh(scores, ids)


class HashTopK(SqrtSoftplusTopK):
    """DeepSeek-V4's hash-routed layers: a token's experts are fixed by its id (``tid2eid``
    [vocab, k]), weighted by their scores as ``SqrtSoftplusTopK`` weighs its choice."""

    needs_token_ids = True

    def __init__(self, hidden: int, num_experts: int, top_k: int, scaling: float, vocab: int):
        Router.__init__(self, hidden, num_experts, top_k)
        self.scaling = scaling
        self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.long))

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor) -> Routing:
        return self.weigh(self.scores(self.logits(h)), self.tid2eid[token_ids].long())
