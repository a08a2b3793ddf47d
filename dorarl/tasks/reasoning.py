"""Reasoning blocks: the delimiters a model declares, and the part of a response a reward reads.

A response's answer is its text after the last closing delimiter; a response that ends
inside a block (opened, by it or by its prompt, and never closed) has none. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# What base models prompted to reason write as text, declared by a template or not.
DEFAULT_TAGS = (("<think>", "</think>"),)
# Tag-like strings of a tokenizer's added tokens and chat template: <x>, <|x|>, [X], ◁x▷.
_TAG = re.compile(r"<\|?/?[\w:.-]+\|?>|\[/?[A-Z_]+\]|◁/?\w+▷")
_REASONING_NAME = re.compile(r"think|reason|thought", re.IGNORECASE)


@dataclass(frozen=True)
class Reasoning:
    """The (opening, closing) delimiters of a model's reasoning blocks."""

    tags: tuple[tuple[str, str], ...] = DEFAULT_TAGS

    def answer(self, text: str, opened: bool = False) -> str | None:
        """`text` after its last closing delimiter; None when it ends inside a block (one
        it opens, or, with `opened`, one its prompt left open, and never closes)."""
        ends = [text.rfind(close) + len(close) for _, close in self.tags if close in text]
        if ends:
            rest = text[max(ends) :]
            return None if self._has_opener(rest) else rest
        return None if opened or self._has_opener(text) else text

    def leaves_open(self, text: str) -> bool:
        """Whether `text` (a prompt, say) ends inside a block."""
        return self.answer(text) is None

    def _has_opener(self, text: str) -> bool:
        return any(open_ in text for open_, _ in self.tags)


def reasoning_of(tokenizer: Any) -> Reasoning:
    """The delimiters `tokenizer` declares (in its added tokens or chat template, a pair
    whose name says think, reason or thought), with the default `<think>` pair."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    added = [getattr(t, "content", "") for t in tokenizer.added_tokens_decoder.values()]
    return Reasoning(declared_tags([str(template), *added]))


def declared_tags(texts: list[str]) -> tuple[tuple[str, str], ...]:
    """The reasoning delimiter pairs named in `texts`, the default pair first."""
    found = {t for text in texts for t in _TAG.findall(text) if _REASONING_NAME.search(t)}
    pairs = list(DEFAULT_TAGS)
    for close in sorted(found):
        for open_ in _openers(close):
            if open_ in found and (open_, close) not in pairs:
                pairs.append((open_, close))
    return tuple(pairs)


def _openers(close: str) -> list[str]:
    """The spellings of the opening tag `close` closes: `</x>` `<x>`, `[/X]` `[X]`,
    `<|end_of_x|>` `<|begin_of_x|>`."""
    out = [close[0] + close[2:]] if close[1:2] == "/" else []
    for end, begin in (("end", "begin"), ("end", "start"), ("END", "BEGIN"), ("END", "START")):
        if end in close:
            out.append(close.replace(end, begin, 1))
    return out
