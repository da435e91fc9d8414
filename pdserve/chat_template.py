"""A chat request's prompt tokens: the one rule the server and the router (which hashes prompts
to find cached prefixes) both apply, so that they agree token for token."""

from __future__ import annotations

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


# apply_chat_template's own arguments, which chat_template_kwargs may not override
_RESERVED = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


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
