"""What a rollout instance needs of an engine backend: the calls every backend answers
(`InstanceEngine`); what one can do beyond them is its `Capabilities`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dorarl.engine.capabilities import Capabilities

if TYPE_CHECKING:
    import torch

    from dorarl.engine.config import SamplingParams
    from dorarl.engine.outputs import (
        EngineSetup,
        EngineStats,
        RequestOutput,
        RequestSnapshot,
        StepWork,
    )


@runtime_checkable
class InstanceEngine(Protocol):
    """The calls every backend answers: requests in under the hosted version, finished
    turns out with token ids, behaviour log-probs and versions, abort and re-prefill,
    multi-turn continuation, a version's full weights in, and the figures the orchestrator
    reads. `load_weights` runs `check` on the named tensors (raising refuses the load)."""

    capabilities: Capabilities
    version: int
    last_step: StepWork

    def setup(self) -> EngineSetup: ...

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
        version: int | None = None,
    ) -> None: ...  # fmt: skip

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def has_runnable(self) -> bool: ...

    def request_ids(self) -> list[str]: ...

    def progress(self, request_id: str) -> int: ...

    def abort(self, request_id: str) -> RequestSnapshot: ...

    def resume_request(self, snap: RequestSnapshot, version: int | None = None) -> None: ...

    def continue_request(self, request_id: str, observation_ids: list[int]) -> bool: ...

    def start_segment(self, request_id: str, prompt_ids: list[int]) -> bool: ...

    def end_request(self, request_id: str) -> RequestOutput: ...

    def stats(self) -> EngineStats: ...

    def load_weights(
        self, named_tensors: dict[str, torch.Tensor], version: int,
        check: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> None: ...  # fmt: skip


def interface_gaps(cls: type) -> list[str]:
    """How a backend class falls short of `InstanceEngine`: each call it lacks or takes
    other parameters for (empty: it answers every call)."""
    gaps = []
    for name, member in vars(InstanceEngine).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        if not hasattr(cls, name):
            gaps.append(f"{name}: missing")
            continue
        want = list(inspect.signature(member).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        if got != want:
            gaps.append(f"{name}: takes {got}, the interface {want}")
    return gaps
