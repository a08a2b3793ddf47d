"""A request's state as dorarl sees it on the vLLM backend: its tokens, log-probs and
versions (and, recording routes, its tokens' experts) across the vLLM requests that carry
it (a first submission, a resume after an abort, every later turn), and the outputs and
snapshots made from it. vllm-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from dorarl.data.samples import SegmentStart
from dorarl.engine.config import SamplingParams
from dorarl.engine.outputs import EarlierSegments, RequestOutput, RequestSnapshot, with_earlier


@dataclass
class Tracked:
    """One dorarl request: what vLLM sampled for it so far, and what carries it now."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    version: int  # the hosted version it runs under, from its first token to its last
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    observed: list[bool] = field(default_factory=list)
    routes: bytearray = field(default_factory=bytearray)  # per output token (data/routes.py)
    turn_start: int = 0
    waits_env: bool = False
    finish_reason: str | None = None
    stop_string: str | None = None
    reprefill_tokens: int = 0
    migrations: int = 0
    submissions: int = 0  # vLLM requests made for it so far (each has its own id)
    vllm_id: str | None = None  # the vLLM request that carries it now (None: none)
    core_id: str | None = None  # that request's id inside vLLM's engine core
    prefilling: int = 0  # tokens of that request's prompt, until its first token comes
    earlier: EarlierSegments | None = None  # its segments before the current one

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output: what a new vLLM request for it prefills."""
        return self.prompt_ids + self.output_ids

    @property
    def turn_output(self) -> int:
        return len(self.output_ids) - self.turn_start

    def next_vllm_id(self) -> str:
        self.submissions += 1
        self.vllm_id = f"{self.request_id}#{self.submissions}"
        self.prefilling = len(self.prompt_ids) + len(self.output_ids)
        return self.vllm_id

    def sampled(self, token_ids: list[int], logprobs: list[float], routes: bytes = b"") -> None:
        self.output_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.routes += routes
        self.versions.extend([self.version] * len(token_ids))
        self.observed.extend([False] * len(token_ids))

    def observe(self, token_ids: list[int], routes: bytes = b"") -> None:
        """An environment's observation (`routes`: its 'no route', if recording), and the
        next turn opened after it."""
        self.output_ids.extend(token_ids)
        self.routes += routes
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([self.version] * len(token_ids))
        self.observed.extend([True] * len(token_ids))
        self.turn_start = len(self.output_ids)
        self.waits_env, self.finish_reason, self.stop_string = False, None, None

    def earlier_with(self, prompt: list[int], prompt_routes: bytes = b"") -> EarlierSegments:
        """Its segments, the current one included, with `prompt` (whose 'no route' is
        `prompt_routes`, if recording) opening the next."""
        e = self.earlier or EarlierSegments(list(self.prompt_ids), [], [], [], [], b"", [])
        return EarlierSegments(
            e.prompt_ids,
            e.output_ids + self.output_ids + prompt,
            e.logprobs + self.logprobs + [0.0] * len(prompt),
            e.versions + self.versions + [self.version] * len(prompt),
            e.observed + self.observed + [True] * len(prompt),
            e.routes + bytes(self.routes) + prompt_routes,
            [*e.starts, SegmentStart(len(e.output_ids) + len(self.output_ids), len(prompt))],
        )


def output_of(t: Tracked) -> RequestOutput:
    out = RequestOutput(
        request_id=t.request_id,
        prompt_ids=list(t.prompt_ids),
        output_ids=list(t.output_ids),
        logprobs=list(t.logprobs),
        versions=list(t.versions),
        finish_reason=t.finish_reason or "length",
        migrations=t.migrations,
        reprefill_tokens=t.reprefill_tokens,
        observed=list(t.observed),
        turn_start=t.turn_start,
        waits_env=t.waits_env,
        stop_string=t.stop_string,
        routes=bytes(t.routes),
    )
    return out if t.earlier is None else with_earlier(out, t.earlier)


def snapshot_of(t: Tracked) -> RequestSnapshot:
    """Tokens only: vLLM exports no request's KV, so a snapshot continues by re-prefill."""
    return RequestSnapshot(
        request_id=t.request_id,
        prompt_ids=list(t.prompt_ids),
        output_ids=list(t.output_ids),
        logprobs=list(t.logprobs),
        versions=list(t.versions),
        params=t.params,
        seed=t.seed,
        version=t.version,
        migrations=t.migrations,
        reprefill_tokens=t.reprefill_tokens,
        stop_token_ids=list(t.stop_ids),
        observed=list(t.observed),
        turn_start=t.turn_start,
        waits_env=t.waits_env,
        turn_reason=t.finish_reason if t.waits_env else None,
        turn_stop_string=t.stop_string if t.waits_env else None,
        routes=bytes(t.routes),
        earlier=t.earlier,
    )


def tracked_from(snap: RequestSnapshot, version: int, routes: bytes = b"") -> Tracked:
    """A snapshot's request, to continue under `version` from its tokens (`routes`: its
    output tokens', if recording)."""
    return Tracked(
        request_id=snap.request_id,
        prompt_ids=list(snap.prompt_ids),
        params=snap.params,
        seed=snap.seed,
        stop_ids=list(snap.stop_token_ids),
        version=version,
        output_ids=list(snap.output_ids),
        logprobs=list(snap.logprobs),
        versions=list(snap.versions),
        observed=list(snap.observed) or [False] * len(snap.output_ids),
        routes=bytearray(routes),
        turn_start=snap.turn_start,
        waits_env=snap.waits_env,
        finish_reason=snap.turn_reason,
        stop_string=snap.turn_stop_string,
        reprefill_tokens=snap.reprefill_tokens,
        migrations=snap.migrations,
        earlier=snap.earlier,
    )
