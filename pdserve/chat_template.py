"""A chat request's prompt tokens: the one rule the server and the router (which hashes prompts
to find cached prefixes) both apply, so that they agree token for token."""

from __future__ import annotations


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; the message names why."""


def chat_input_ids(tokenizer, messages: list[dict], continue_final_message: bool = False) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("messages: this model has no chat template; use /v1/completions")
    try:
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message,
        )
    except Exception as e:  # template errors (e.g. roles must alternate) are the caller's
        raise ChatTemplateError(f"messages: cannot apply the chat template: {e}") from None
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]
