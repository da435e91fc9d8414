"""A request's prompt tokens, as the workers will see them, for the policies that weigh what the
workers' caches hold (``cache_aware``, ``--pd-policy conditional``).

``input_ids`` are taken as they are. Text is tokenized with the model's tokenizer, as the servers
do it (chat messages through ``pdserve.chat_template``, the rule the server applies): from
``--tokenizer-path``, else from the path a worker reports in ``/model_info`` when that path
exists on the router's machine. Without a tokenizer only ``input_ids`` requests are matched (a
warning says so once). Batches are not matched: their first prompt says little about the rest.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from pdserve.chat_template import ChatTemplateError, chat_input_ids

logger = logging.getLogger(__name__)


def _token_list(value: Any) -> Optional[list[int]]:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return value
    return None


class PromptReader:
    def __init__(self, tokenizer_path: Optional[str] = None):
        self.tokenizer = None
        self.tokenizer_path = tokenizer_path
        self._warned = False

    def load(self, path: Optional[str] = None) -> bool:
        """Load the tokenizer from ``--tokenizer-path`` or ``path`` (a worker's); True when one is
        loaded."""
        if self.tokenizer is not None:
            return True
        path = self.tokenizer_path or path
        if not path or not os.path.exists(path):
            if not self._warned:
                logger.warning(
                    "no tokenizer on this machine (%s): cache-aware routing matches only requests "
                    "that send input_ids; give --tokenizer-path",
                    path or "no path known",
                )
                self._warned = True
            return False
        try:
            from pdserve.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(path, local_files_only=True)
        except Exception as e:  # a broken or foreign tokenizer: route without prompt matching
            logger.warning(
                "cannot load the tokenizer from %s (%r): cache-aware routing matches only "
                "requests that send input_ids",
                path,
                e,
            )
            return False
        logger.info("tokenizer for prompt matching loaded from %s", path)
        return True

    def ids(self, path: str, body: dict) -> Optional[list[int]]:
        """The prompt's token ids, or None (a batch, no tokenizer, or a body the server will
        reject)."""
        if path == "/generate":
            ids = body.get("input_ids")
            if ids is not None:
                return _token_list(ids)
            return self._text(body.get("text"))
        if path == "/v1/completions":
            prompt = body.get("prompt")
            return _token_list(prompt) if isinstance(prompt, list) else self._text(prompt)
        if path == "/v1/chat/completions":
            messages = body.get("messages")
            if self.tokenizer is None or not isinstance(messages, list) or not messages:
                return None
            try:
                tools = body.get("tools") if body.get("tool_choice") != "none" else None
                kwargs = body.get("chat_template_kwargs")
                return chat_input_ids(
                    self.tokenizer,
                    messages,
                    bool(body.get("continue_final_message")),
                    tools or None,
                    kwargs if isinstance(kwargs, dict) else None,
                )
            except (ChatTemplateError, TypeError, ValueError):
                return None  # the server answers 400 for it
        return None

    def _text(self, text: Any) -> Optional[list[int]]:
        if not isinstance(text, str) or not text or self.tokenizer is None:
            return None
        return self.tokenizer(text)["input_ids"]
