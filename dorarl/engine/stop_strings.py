"""Stop strings: a turn ends at the first token whose text completes one of them; torch-free.

`StopText` decodes a turn's tokens incrementally, as a streaming detokenizer does: each new
token's text is what decoding a short window (the last few tokens before it, then it) adds to
decoding the window without it, so a tokenizer that writes a token differently at a word's
start, or spreads one character over several byte tokens, still reads right, and a step
costs the same however long the turn is. Only the last `len(longest) - 1` characters are
kept, which is all a match that the new text completes can span. Invariants: a stop string
is reported at the token that completes it, never before, never after; text that ends in an
incomplete UTF-8 sequence waits for its next byte before it is searched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[list[int]], str]
CONTEXT_TOKENS = 4  # tokens before the turn decoded with it, so its first token reads right
_INCOMPLETE = "\ufffd"  # what a decoder writes for a byte sequence that is not yet whole


@dataclass
class StopText:
    """One turn's text as it is sampled, searched for `stops`."""

    stops: tuple[str, ...]
    decode: Decode
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # the window's start: tokens decoded as context only
    _read: int = 0  # tokens whose text is already in `_tail`
    _tail: str = ""

    @classmethod
    def open(
        cls, stops: Sequence[str], decode: Decode, before: Sequence[int], turn: Sequence[int] = ()
    ) -> StopText:
        """The matcher of a turn that follows the tokens `before` and has sampled `turn` so
        far (a request continued on another engine): those are read, not searched."""
        context = list(before[-CONTEXT_TOKENS:])
        text = cls(tuple(stops), decode, context, 0, len(context))
        for token in turn:
            text._remember(text._advance(token) or "")
        return text

    @property
    def _keep(self) -> int:
        """Characters a match completed by new text can reach back into."""
        return max(len(s) for s in self.stops) - 1

    def feed(self, token: int) -> str | None:
        """Read one sampled token; the stop string its text completes, if any (the earliest
        in the text when it completes several)."""
        fresh = self._advance(token)
        if fresh is None:
            return None
        searched = self._tail + fresh
        self._remember(fresh)
        hits = [(searched.find(s), s) for s in self.stops if s in searched]
        return min(hits)[1] if hits else None

    def _remember(self, fresh: str) -> None:
        text = self._tail + fresh
        self._tail = text[max(0, len(text) - self._keep) :]

    def _advance(self, token: int) -> str | None:
        """Append the token; the text it adds, or None while that text is incomplete."""
        self._ids.append(token)
        before = self.decode(self._ids[self._prefix : self._read])
        after = self.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return None
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class FolderDecoder:
    """`decode` of a model folder's tokenizer, loaded at its first use (an engine whose
    requests have no stop strings never loads it). The text keeps special tokens and the
    tokenizer's spacing as sampled."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._tokenizer = None

    def __call__(self, ids: list[int]) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return self._tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
