"""Offline API in SGLang's shape: ``Engine(model_path=..., **server_args).generate(...)``.

The scheduler runs in this process; ``generate`` steps it until every submitted request ends.
"""

from __future__ import annotations

import base64
import itertools
import logging
import uuid
from typing import Any, Optional, Union

import torch

from pdserve.config import ServerArgs
from pdserve.engine.request import FinishKind, Req, RequestSpec, SamplingParams
from pdserve.grammar import spec_from_sampling

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
Ids = Union[list[int], list[list[int]], None]


def logprob_entries(pairs, with_text: bool = False, tokenizer=None) -> list:
    """SGLang's ``[logprob, token_id, text_or_null]`` entries."""
    return [[v, t, tokenizer.decode([t]) if with_text else None] for v, t in pairs]


def top_entries(tops, with_text: bool = False, tokenizer=None) -> list:
    return [None if top is None else logprob_entries(top, with_text, tokenizer) for top in tops]


def output_text(req: Req, tokenizer) -> str:
    text = tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    fr = req.finish_reason
    if fr is not None and fr.kind == FinishKind.STOP and isinstance(fr.matched, str):
        cut = text.find(fr.matched)
        if cut >= 0:
            text = text[:cut]
    return text


class Engine:
    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        from pdserve.engine.scheduler import Scheduler
        from pdserve.tokenizer import load_tokenizer

        if model_path is not None:
            kwargs["model_path"] = model_path
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        a = self.server_args
        for note in a.start_notes():
            logger.warning("%s", note)
        if a.world_size != 1:
            name = "tp_size" if a.tp_size != 1 else "pp_size"
            raise ValueError(
                f"{name}: the offline Engine runs one rank; serve a parallel model with "
                f"`pdserve serve --tp-size {a.tp_size} --pp-size {a.pp_size}`"
            )
        if self.server_args.torch_num_threads:
            torch.set_num_threads(self.server_args.torch_num_threads)
        self.tokenizer = load_tokenizer(self.server_args.tokenizer_path)
        self.scheduler = Scheduler(self.server_args, self.tokenizer)
        self._ids = itertools.count()

    def _make_reqs(
        self,
        prompt,
        input_ids,
        sampling_params,
        return_logprob,
        top_logprobs_num,
        logprob_start_len,
        return_routed_experts=False,
        lora_path=None,
        image_data=None,
    ):
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt/input_ids: give exactly one of them")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt: must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = not input_ids or not isinstance(input_ids[0], list)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            for ids in ids_list:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(
                        "input_ids: must be a list of integers or a list of such lists"
                    )
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(ids_list)} prompts"
                )
            dicts = [dict(s or {}) for s in sampling_params]
        else:
            if sampling_params is not None and not isinstance(sampling_params, dict):
                raise ValueError("sampling_params: must be an object or a list of objects")
            dicts = [dict(sampling_params or {}) for _ in ids_list]
        grammars = [spec_from_sampling(d) for d in dicts]  # json_schema / regex / ebnf
        sps = [SamplingParams.from_dict(d) for d in dicts]
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob: must be a boolean, got {return_logprob!r}")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int):
            raise ValueError(f"top_logprobs_num: must be an integer, got {top_logprobs_num!r}")
        if not isinstance(return_routed_experts, bool):
            raise ValueError(
                f"return_routed_experts: must be a boolean, got {return_routed_experts!r}"
            )
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(ids_list)
        if len(adapters) != len(ids_list) or not all(
            a is None or isinstance(a, str) for a in adapters
        ):
            raise ValueError("lora_path: an adapter name (or None), or a list of one per prompt")
        per_prompt = self._images(image_data, ids_list)
        reqs = []
        for ids, sp, grammar, adapter, pics in zip(ids_list, sps, grammars, adapters, per_prompt):
            ids, images = self._expand(ids, pics)
            for _ in range(sp.n):
                spec = RequestSpec(
                    rid=uuid.uuid4().hex,
                    input_ids=ids,
                    sampling_params=sp.to_dict(),
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
                    logprob_start_len=logprob_start_len,
                    return_routed_experts=return_routed_experts,
                    grammar=grammar,
                    lora_name=adapter,
                    images=images or None,
                )
                reqs.append(Req.from_spec(spec))
        for req in reqs:
            self.scheduler.validate(req)
        return single and len(reqs) == 1, reqs

    @staticmethod
    def _images(image_data, ids_list: list) -> list:
        """One list of images per prompt (a single prompt's list, or a list of such lists)."""
        if image_data is None:
            return [[] for _ in ids_list]
        if not isinstance(image_data, list):
            raise ValueError("image_data: a list of images, or one list per prompt")
        nested = bool(image_data) and all(isinstance(x, list) for x in image_data)
        lists = image_data if nested else [image_data]
        if len(lists) != len(ids_list):
            raise ValueError(f"image_data: {len(lists)} list(s) for {len(ids_list)} prompt(s)")
        return lists

    def _expand(self, ids: list[int], pics: list) -> tuple[list[int], list]:
        """The prompt's image placeholders expanded for ``pics`` (PIL images, encoded bytes or
        data/file URLs), and the images as the request carries them."""
        if not pics:
            return ids, []
        from pdserve.multimodal.images import ImageLimits, decode_image, read_image_bytes
        from pdserve.multimodal.processor import ImageProcessor

        if getattr(self, "image_processor", None) is None:
            config = self.scheduler.runner.hf_config
            self.image_processor = ImageProcessor(self.server_args.model_path, config)
        limits = ImageLimits(local_path="/")
        loaded = []
        for i, pic in enumerate(pics):
            where = f"image_data[{i}]"
            if isinstance(pic, str):
                pic = read_image_bytes(pic, limits, where)
            if isinstance(pic, (bytes, bytearray)):
                pic = decode_image(bytes(pic), limits, where)
            loaded.append(pic.convert("RGB"))
        return self.image_processor.expand(ids, loaded)

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Union[dict, list[dict], None] = None,
        input_ids: Ids = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
        lora_path: Union[str, list, None] = None,
        image_data: Optional[list] = None,
    ) -> Union[dict, list[dict]]:
        """``return_routed_experts``: ``meta_info["routed_experts"]`` as the server's (base64, see
        ``engine/routed_experts.py``); needs ``enable_return_routed_experts=True``.
        ``lora_path``: the LoRA adapter (its name; None: the base model), or one per prompt.
        ``image_data``: a prompt's images (PIL images, encoded bytes, data: or file: URLs) for
        its image placeholders in order, or one list per prompt (a vision-language model)."""
        single, reqs = self._make_reqs(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            return_routed_experts,
            lora_path,
            image_data,
        )
        for req in reqs:
            self.scheduler.add_request(req)
        pending = set(reqs)
        while pending:
            self.scheduler.step()
            pending = {r for r in pending if not r.finished}
        outs = [self._result(r) for r in reqs]
        return outs[0] if single else outs

    def _result(self, req: Req) -> dict:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason.to_json(),
            "prompt_tokens": req.prompt_len,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = logprob_entries(req.output_token_logprobs)
            meta["output_top_logprobs"] = top_entries(req.output_top_logprobs)
            meta["input_token_logprobs"] = logprob_entries(req.input_token_logprobs)
            meta["input_top_logprobs"] = top_entries(req.input_top_logprobs)
        if req.spec_verify_ct:  # speculative decoding (SGLang's field, and the mean tokens a step)
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = (
                req.spec_verify_ct + req.spec_accepted
            ) / req.spec_verify_ct
        if req.routed_experts is not None:
            meta["routed_experts"] = base64.b64encode(req.routed_experts).decode("ascii")
        return {
            "text": output_text(req, self.tokenizer),
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    def check_integrity(self) -> dict:
        return self.scheduler.check_integrity()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        self.scheduler = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
