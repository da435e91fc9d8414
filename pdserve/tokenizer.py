"""A checkpoint's tokenizer, as transformers' ``AutoTokenizer`` loads it, without importing
transformers where the work is only encoding and decoding.

``AutoTokenizer`` decides the class from ``tokenizer_config.json`` and the model's configuration,
and importing transformers costs about 1.5 CPU seconds per process (the HTTP front end, each
scheduler and the router each paid it at every start). What it builds depends only on the
checkpoint's small files and transformers' version, so the first load records what it built under
the cache directory, keyed by the bytes of those files, the version and the arguments:

- when the class does its work in the ``tokenizers`` library (transformers 5's
  ``TokenizersBackend``, or a subclass that overrides none of its encoding and decoding), the
  record holds that library's tokenizer as the class left it (post-processor, added tokens), the
  special tokens and the chat template, once a :class:`Tokenizer` built from the record has
  encoded, decoded and listed the vocabulary exactly as the class does on a set of probes; later
  loads build that :class:`Tokenizer`, importing ``tokenizers`` alone;
- otherwise (a class with its own Python encoding, clean-up of decoded spaces, a hub id, a probe
  that differs) every load goes through ``AutoTokenizer``.

:class:`Tokenizer` answers what the servers ask of a tokenizer on every request (encode, decode,
the vocabulary and the special tokens) itself; anything else (``apply_chat_template``, what the
grammar engines read) goes to transformers' own tokenizer, loaded on first use (:attr:`hf`)."""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import Any, Optional

from pdserve import records
from pdserve.chat_template import TOKENIZING_ARGUMENTS

KIND = "tokenizers"  # the records' folder under the cache directory
# the recorded tokenizers this process built, by (path, key of its files): the newest LOADED_MAX
LOADED_MAX = 8
_LOADED: "OrderedDict[tuple[str, str], Tokenizer]" = OrderedDict()
_LOADED_LOCK = threading.Lock()
HF = "hf"  # a record saying "load through AutoTokenizer"

# the attributes of transformers' special-tokens interface a record carries
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
# what a subclass of TokenizersBackend may not override for the record to stand for it
BEHAVIOUR = (
    "__call__",
    "encode",
    "_encode_plus",
    "decode",
    "_decode",
    "batch_decode",
    "convert_ids_to_tokens",
    "get_vocab",
    "__len__",
)
# apply_chat_template's arguments that are not template variables
NOT_TEMPLATE_VARIABLES = TOKENIZING_ARGUMENTS | {"sanitize_control_tokens"}
PROBE_TEXTS = (
    "",
    "Hello world",
    "  leading spaces\tand tabs\n\nand lines",
    "héllo wörld — 東京 🙂 ŝ",
    '1234567 3.14159 x=y+z; {"a": [1, 2]}',
    "</s><s>[INST]<|im_start|>user<|im_end|><|endoftext|>",
)


class Tokenizer:
    """A recorded tokenizer (see the module docstring); drop-in for the transformers one."""

    def __init__(self, path: str, kwargs: dict, record: dict, backend):
        self.name_or_path = path
        self._kwargs = kwargs
        self._backend = backend
        self._hf = None
        self._lock = threading.Lock()
        self._class: str = record["class"]  # the transformers class AutoTokenizer chose
        self.chat_template = record["chat_template"]
        self._special_tokens_map: dict[str, str] = record["special_tokens_map"]
        self._renders_chat: bool = record.get("renders_chat", False)
        self.vocab_size: int = record["vocab_size"]
        self._len: int = record["len"]
        self.all_special_tokens: list[str] = record["all_special_tokens"]
        self.all_special_ids: list[int] = record["all_special_ids"]
        self.model_max_length = record["model_max_length"]
        for name in SPECIAL:
            setattr(self, name, record[name])
            setattr(self, f"{name}_id", record[f"{name}_id"])

    # ---- what every request needs ------------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> dict:
        if kwargs or not isinstance(text, str):
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        # a recorded class cleans up no decoded spaces: asking it not to is its own decoding
        if kwargs.get("clean_up_tokenization_spaces", True) is False:
            del kwargs["clean_up_tokenization_spaces"]
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif not isinstance(token_ids, list):
            token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(ids, skip_special_tokens) for ids in token_ids]
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._len

    @property
    def backend_tokenizer(self):
        return self._backend

    # ---- the rest: transformers' tokenizer, loaded on first use -------------------------------
    @property
    def hf(self):
        """transformers' tokenizer for this checkpoint (chat templates, the grammar engines)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    import importlib

                    module, _, name = self._class.rpartition(".")
                    cls = getattr(importlib.import_module(module), name)
                    self._hf = cls.from_pretrained(self.name_or_path, **self._kwargs)
        return self._hf

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template=None,
        add_generation_prompt: bool = False,
        continue_final_message=False,
        tokenize: bool = True,
        **kwargs: Any,
    ):
        """transformers' ``apply_chat_template``; the common call (one conversation rendered to
        text, as the servers make it) rendered here when the record found the renderings equal."""
        template = self.chat_template if chat_template is None else chat_template
        if (
            self._renders_chat
            and isinstance(template, str)
            and not tokenize
            and documents is None
            and isinstance(continue_final_message, bool)
            and not NOT_TEMPLATE_VARIABLES.intersection(kwargs)
        ):
            from pdserve.chat_template import NotRendered, render

            variables = {**self._special_tokens_map, **kwargs}
            try:
                return render(
                    template,
                    conversation,
                    tools,
                    add_generation_prompt,
                    continue_final_message,
                    variables,
                )
            except NotRendered:
                pass
        return self.hf.apply_chat_template(
            conversation,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=tokenize,
            **kwargs,
        )

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={self._len})"


def transformers_tokenizer(tokenizer):
    """transformers' own tokenizer behind ``tokenizer`` (for libraries that read its internals)."""
    return tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer


def load_tokenizer(path: str, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(path, **kwargs)``, or a :class:`Tokenizer` that behaves
    the same (see the module docstring). A process that loads the same files again (an engine
    and its scheduler, a draft model's check, several engines) gets the :class:`Tokenizer` it
    built before: building one parses the whole vocabulary (about 80 ms for 49k tokens)."""
    key = records.key(path, kwargs)
    with _LOADED_LOCK:
        if (path, key) in _LOADED:
            _LOADED.move_to_end((path, key))
            return _LOADED[(path, key)]
    text = records.read(KIND, key)
    if text and text.strip() != HF:
        try:
            tokenizer = _from_record(path, kwargs, json.loads(text))
        except (ValueError, KeyError, OSError, ImportError):
            pass  # a record from another layout or a changed file: decide again
        else:
            with _LOADED_LOCK:
                _LOADED[(path, key)] = tokenizer
                while len(_LOADED) > LOADED_MAX:
                    _LOADED.popitem(last=False)
            return tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if key:
        record = _record_of(path, tokenizer)
        if record is not None:
            # one candidate, rendering chats itself, checked against the class on the probes
            candidate = _from_record(path, kwargs, {**record, "renders_chat": True})
            if _same_behaviour(candidate, tokenizer):
                record["renders_chat"] = _same_chat(candidate, tokenizer)
            else:
                record = None
        records.write(KIND, key, HF + "\n" if record is None else json.dumps(record))
    return tokenizer


def _from_record(path: str, kwargs: dict, record: dict) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    if record["backend"] is None:
        backend = Backend.from_file(os.path.join(path, "tokenizer.json"))
    else:
        backend = Backend.from_str(record["backend"])
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = False
    return Tokenizer(path, kwargs, record, backend)


def _record_of(path: str, tok) -> Optional[dict]:
    """What a :class:`Tokenizer` needs to stand for ``tok``, or None if it cannot."""
    from transformers import TokenizersBackend

    cls = type(tok)
    if not isinstance(tok, TokenizersBackend) or any(
        getattr(cls, name) is not getattr(TokenizersBackend, name) for name in BEHAVIOUR
    ):
        return None
    if tok.clean_up_tokenization_spaces or tok.split_special_tokens:
        return None
    if not isinstance(tok.chat_template, (str, type(None))):
        return None  # named templates: left to transformers
    backend = tok.backend_tokenizer.to_str()
    on_disk = os.path.join(path, "tokenizer.json")
    try:
        from tokenizers import Tokenizer as Backend

        same_file = Backend.from_file(on_disk).to_str() == backend
    except Exception:
        same_file = False
    record = {
        "class": f"{cls.__module__}.{cls.__name__}",
        "backend": None if same_file else backend,
        "chat_template": tok.chat_template,
        "vocab_size": tok.vocab_size,
        "len": len(tok),
        "all_special_tokens": list(tok.all_special_tokens),
        "all_special_ids": list(tok.all_special_ids),
        "model_max_length": tok.model_max_length,
        "special_tokens_map": dict(tok.special_tokens_map),
    }
    for name in SPECIAL:
        record[name] = getattr(tok, name)
        record[f"{name}_id"] = getattr(tok, f"{name}_id")
    return record


def _same_behaviour(fast: Tokenizer, tok) -> bool:
    """Whether ``fast`` encodes, decodes and lists the vocabulary as ``tok`` on the probes."""
    if fast.get_vocab() != tok.get_vocab() or len(fast) != len(tok):
        return False
    n = len(tok)
    ids = sorted(
        set(tok.all_special_ids) | {i * 7919 % n for i in range(256)} | set(range(min(n, 64)))
    )
    texts = list(PROBE_TEXTS) + [
        "a" + "b".join(s for s in tok.all_special_tokens) + "c",
        tok.decode(ids),
    ]
    for text in texts:
        for special in (True, False):
            if fast.encode(text, add_special_tokens=special) != tok.encode(
                text, add_special_tokens=special
            ):
                return False
            if (
                fast(text, add_special_tokens=special)["input_ids"]
                != tok(text, add_special_tokens=special)["input_ids"]
            ):
                return False
    sequences = [ids, ids[::-1], [ids[-1]], []] + [tok.encode(t) for t in texts]
    for seq in sequences:
        for skip in (True, False):
            if fast.decode(seq, skip_special_tokens=skip) != tok.decode(
                seq, skip_special_tokens=skip
            ):
                return False
        if fast.convert_ids_to_tokens(seq) != tok.convert_ids_to_tokens(seq):
            return False
    return all(fast.decode(i) == tok.decode(i) for i in ids[:32])


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
PROBE_CHATS = (
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi — 東京 🙂"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?", "name": None},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are"}],
    [{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "twice"}],
)


def _same_chat(fast: Tokenizer, tok) -> bool:
    """Whether ``fast`` renders the probe conversations as ``tok`` does (or fails where it does)."""
    if not isinstance(tok.chat_template, str):
        return False

    def outcome(t, chat, **kw):
        try:
            return t.apply_chat_template(chat, tokenize=False, **kw)
        except Exception as e:
            return type(e)

    for chat in PROBE_CHATS:
        for kw in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False},
            {"continue_final_message": True},
            {"add_generation_prompt": True, "tools": [TOOL]},
            {"add_generation_prompt": True, "enable_thinking": False, "reasoning_effort": "low"},
        ):
            if outcome(fast, chat, **kw) != outcome(tok, chat, **kw):
                return False
    return True
