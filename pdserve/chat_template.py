"""A chat request's prompt tokens: the one rule the server and the router (which hashes prompts
to find cached prefixes) both apply, so that they agree token for token."""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Optional


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; the message names why."""


def load_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: a Jinja file, or the template itself; None keeps the tokenizer's."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


# apply_chat_template's arguments about tokenizing what it rendered (not template variables)
TOKENIZING_ARGUMENTS = frozenset(
    {
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# apply_chat_template's own arguments, which chat_template_kwargs may not override
_RESERVED = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
} | TOKENIZING_ARGUMENTS


def chat_prompt(
    tokenizer,
    messages: list[dict],
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    template_kwargs: Optional[dict[str, Any]] = None,
    template: Optional[str] = None,
) -> str:
    """The rendered prompt. ``tools``: OpenAI tool definitions, given to the template as its
    ``tools`` variable; ``template_kwargs``: extra template variables (``enable_thinking``, ...);
    ``template``: a Jinja template instead of the tokenizer's."""
    if not (template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError("messages: this model has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    bad = sorted(_RESERVED.intersection(kwargs))
    if bad:
        raise ChatTemplateError(f"chat_template_kwargs: may not set {', '.join(bad)}")
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as e:  # template errors (e.g. roles must alternate) are the caller's
        raise ChatTemplateError(f"messages: cannot apply the chat template: {e}") from None


def chat_input_ids(
    tokenizer,
    messages: list[dict],
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    template_kwargs: Optional[dict[str, Any]] = None,
    template: Optional[str] = None,
) -> list[int]:
    prompt = chat_prompt(
        tokenizer, messages, continue_final_message, tools, template_kwargs, template
    )
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


# ---- rendering without transformers ------------------------------------------------------------
# transformers renders chat templates in a sandboxed Jinja environment with its own filters and
# globals; pdserve.tokenizer.Tokenizer renders the common call (one conversation of plain dicts,
# tools as JSON schemas, no documents) in the same environment, and the record that creates such a
# Tokenizer checks it against transformers' rendering on probe conversations first.

# the names a message's reasoning travels under; templates read the first, gpt-oss's "thinking"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class NotRendered(Exception):
    """A call outside what :func:`render` does: transformers renders it."""


@functools.lru_cache(maxsize=32)
def compiled(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body as it is (the indices of the
        assistant's tokens are not asked for here)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not set underscore-prefixed attributes ({name!r})"
                )

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace
    )
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """JSON's types only (what a request body holds); anything else is not rendered here."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    raise NotRendered(type(value).__name__)


def render(
    template: str,
    messages: list,
    tools: Optional[list] = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    variables: Optional[dict[str, Any]] = None,
) -> str:
    """One conversation rendered as transformers' ``apply_chat_template(..., tokenize=False)``
    renders it; :class:`NotRendered` for a call it leaves to transformers."""
    if not isinstance(messages, list) or not messages:
        raise NotRendered("not one non-empty conversation")
    if not all(type(m) is dict for m in messages):
        raise NotRendered("a message that is not a dict")
    if tools is not None and not all(type(t) is dict for t in tools):
        raise NotRendered("tools that are not JSON schemas")
    if continue_final_message and add_generation_prompt:
        raise NotRendered("continue_final_message with add_generation_prompt")
    chat = []
    for m in _plain(messages):
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str) or "content" not in template:
            raise NotRendered("a final message to continue that is not text the template reads")
        chat[-1]["content"] = final + CONTINUE_TAG
    out = compiled(template).render(
        messages=chat,
        tools=_plain(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(variables or {}),
    )
    if final is not None:
        tag = CONTINUE_TAG.strip()
        if final.strip() not in out or tag not in out:
            raise NotRendered("the template dropped part of the final message")
        at = out.rindex(tag)
        out = out[:at] if out[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else out[:at].rstrip()
    return out
