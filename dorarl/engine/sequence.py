"""One request's execution state inside an engine; torch-free.

Invariants: `token_ids` is prompt + output; the KV of the first `num_computed` tokens is
held at `kv_place` (device blocks in `block_table`, host blocks in `host_table`, or a
detached tensor the engine keeps for an imported request); `versions` and `logprobs`
have one entry per output token, and so does `observed` (True for a token an environment
appended between turns: never sampled, logprob 0). The request's random stream is
(seed, len(output_ids)), so it travels with the request and is independent of batch
neighbours. With routes recorded (an MoE model, engine.record_routes), `routes` holds each
output token's expert ids (dorarl/data/routes.py), as `logprobs` holds its logprob. A
multi-turn request (`params.multi_turn`) whose turn ended `waits_env`: it holds its KV but
no slot until `Engine.continue_request` appends the next observation.
`kv_version` is the weights version its KV was computed under (None: none yet, or a weight
load came while it held KV, so its KV mixes versions): the prefix cache shares blocks of
that version only, and keys its first `num_cached` prompt blocks.
A request added under a resident LoRA adapter keeps its `lora_version` to its last token.
A request with stop strings carries its turn's `StopText`; a turn ends on a stop token,
then a stop string, then the length cap, so a turn that completes a stop string at its cap
ends "stop_string". A request in a later segment (`Engine.start_segment`) holds that
segment's tokens as above and the earlier ones in `earlier`; each segment has a seed of its
own (`next_segment_seed`), so no two segments share random draws.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dorarl.engine.block_manager import PromptKeys
from dorarl.engine.config import SamplingParams
from dorarl.engine.outputs import EarlierSegments
from dorarl.engine.stop_strings import StopText

_M64 = (1 << 64) - 1


class KVPlace(enum.Enum):
    NONE = "none"  # nothing computed yet (or dropped): prefill from token 0
    DEVICE = "device"
    HOST = "host"
    DETACHED = "detached"  # imported tensor not yet copied into the pool


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_computed: int = 0
    kv_place: KVPlace = KVPlace.NONE
    block_table: list[int] = field(default_factory=list)
    host_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    migrations: int = 0
    offloads: int = 0
    reprefill_tokens: int = 0
    observed: list[bool] = field(default_factory=list)
    turn_start: int = 0  # output index where the current turn's sampled tokens begin
    waits_env: bool = False
    kv_version: int | None = None
    num_cached: int = 0  # leading blocks of block_table the prefix cache keys
    lora_version: int | None = None  # the resident adapter it runs under; None: full weights
    keys: PromptKeys | None = None  # its prompt's block keys, made once per version
    stop_text: StopText | None = None  # the current turn's text, with sampling.stop_strings
    stop_string: str | None = None  # the stop string that ended the last turn
    routes: bytearray = field(default_factory=bytearray)  # per output token, when recorded
    earlier: EarlierSegments | None = None  # the request's segments before this one

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def decodes(self) -> bool:
        """Its next row is a decode: its one uncomputed token is one it sampled."""
        return self.samples_next(self.num_computed)

    def samples_next(self, computed: int) -> bool:
        """Whether, holding KV for `computed` tokens, its one uncomputed token is one it
        sampled. A prompt's tokens, an environment's and re-prefilled ones run as prefill
        whatever the chunk bounds, so each token is computed the same way on every path."""
        out = computed - self.num_prompt
        return computed == self.num_tokens - 1 and out >= 0 and not self.observed[out]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, version: int, max_model_len: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.observed.append(False)
        self.finish_reason = self._finish_reason(token, max_model_len)

    def observe(self, token_ids: list[int], version: int) -> None:
        """Append an environment's observation and open the next turn."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([version] * len(token_ids))
        self.observed.extend([True] * len(token_ids))
        self.turn_start = self.num_output
        self.finish_reason = None
        self.waits_env = False
        self.stop_string = None
        if self.stop_text is not None:
            self.stop_text = StopText.open(
                self.stop_text.stops, self.stop_text.decode, self.token_ids
            )

    @property
    def turn_output(self) -> int:
        """Tokens sampled in the current turn (all output for a single-turn request)."""
        return self.num_output - self.turn_start

    def _finish_reason(self, token: int, max_model_len: int) -> str | None:
        # Caps count per turn, so the env's observations do not eat the model's budget.
        if self.params.target_len is not None:
            return "length" if self.turn_output >= self.params.target_len else None
        if token in self.stop_ids:
            return "stop"
        if self.stop_text is not None:
            self.stop_string = self.stop_text.feed(token)
            if self.stop_string is not None:
                return "stop_string"
        if self.turn_output >= self.params.max_new_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None


def next_segment_seed(seed: int) -> int:
    """The seed of the segment after one seeded `seed`: a splitmix64 step, so a request's
    segments draw independent random streams, the same on every engine."""
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1  # 63 bits, as the engine draws seeds
