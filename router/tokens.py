"""Count a request's prompt tokens in the router, with the model's own tokenizer.

Quotas and the pools' budgets are charged before any work starts, so the router needs
the prompt length up front: the chat template applied and tokenized exactly as vLLM
will. The tokenizer is loaded once per router replica (transformers, lazily).
"""

from __future__ import annotations

from typing import Any, Callable


def _text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


class PromptCounter:
    def __init__(self, source: str, loader: Callable[[str], Any] | None = None) -> None:
        self._source = source
        self._loader = loader
        self._tok = None

    @property
    def tokenizer(self):
        if self._tok is None:
            if self._loader is not None:
                self._tok = self._loader(self._source)
            else:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self._source)
        return self._tok

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> int:
        flat = [{"role": str(m.get("role", "user")), "content": _text_of(m.get("content"))} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(flat, tokenize=True, add_generation_prompt=add_generation_prompt)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return len(ids)
        except Exception:  # a template that rejects these roles: count the text plus framing
            return sum(len(self.tokenizer.encode(m["content"], add_special_tokens=False)) + 4 for m in flat) + 2

    def text(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt, add_special_tokens=True))
