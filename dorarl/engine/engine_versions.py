"""The versions an engine serves (mixed into `Engine`): its full weights swapped in place
and read out, LoRA adapter versions loaded into and freed from their slots."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dorarl.engine.config import EngineConfig
from dorarl.engine.lora import ResidentAdapters, parse_adapter
from dorarl.engine.model import Transformer
from dorarl.engine.model_spec import ModelSpec
from dorarl.engine.scheduler import Scheduler
from dorarl.engine.sequence import Sequence
from dorarl.engine.weights import check_named, load_in_place, unpack
from dorarl.errors import UserInputError

logger = logging.getLogger(__name__)


class Versions:
    """One full-weight version and up to `engine.max_versions - 1` adapter versions over it;
    every change is checked first, and a refused one leaves what is resident as it was."""

    config: EngineConfig
    spec: ModelSpec
    version: int
    model: Transformer
    adapters: ResidentAdapters | None
    scheduler: Scheduler
    _seqs: dict[str, Sequence]

    def load_weights(
        self,
        named_tensors: dict[str, torch.Tensor],
        version: int,
        check: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        """Swap in another version's weights between steps (all tensors checked first, by
        `check` too when given: a refused load leaves the old weights whole).

        Every cached prefix block of the old weights is freed first. Requests still in the
        engine continue on their existing KV under the new weights and their new tokens
        carry the new version (their KV is shared with no request of the new version);
        callers that need one version per trajectory migrate or abort them first. Resident
        LoRA adapters stay in their slots, over the new weights."""
        check_named(self.spec, named_tensors, f"load_weights(version={version})")
        if check is not None:
            check(named_tensors)
        if version in self.resident_versions()[1:]:
            raise UserInputError(
                f"load_weights(version={version}): an adapter of this version is resident "
                "(unload_version it first)"
            )
        # KV of the old weights is never read by a request that starts from now on.
        self.scheduler.new_version(version)
        # tensor by tensor into the live storage: no transient second weight set, and the
        # captured graphs, which read these addresses, stay valid
        load_in_place(self.spec, self.model.weights, named_tensors)
        if self._seqs:
            logger.warning(
                "version %d -> %d with %d requests in flight",
                self.version,
                version,
                len(self._seqs),
            )
        self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights by Hugging Face name (read-only views; with CUDA graphs a
        later `load_weights` copies into the same storage, so copy what you keep)."""
        return unpack(self.spec, self.model.weights)

    def load_adapter(
        self, version: int, tensors: dict[str, torch.Tensor], alpha: float, rank: int
    ) -> None:
        """Hold a LoRA adapter over the full weights as `version` in a free slot, for
        requests added with that version. `tensors` are peft's lora_A / lora_B by name
        (`get_peft_model_state_dict`); the delta is B @ A * alpha / rank. All checked
        first: a refused adapter leaves every resident one as it was."""
        where = f"load_adapter(version={version})"
        adapters = self._adapter_room(version, rank, where)
        slot = adapters.free_slot()
        assert slot is not None, "checked by _adapter_room"
        adapter = parse_adapter(tensors, alpha, rank, adapters.layers, where)
        adapters.load(version, adapter, slot)

    def _adapter_room(self, version: int, rank: int, where: str) -> ResidentAdapters:
        c = self.config
        if self.adapters is None or self.adapters.free_slot() is None:
            raise UserInputError(
                f"{where}: engine.max_versions={c.max_versions} and versions "
                f"{self.resident_versions()} are resident (unload_version one, or a larger "
                "engine.max_versions)"
            )
        if not 0 < rank <= c.max_lora_rank:
            raise UserInputError(
                f"{where}: rank {rank} is outside 1..engine.max_lora_rank={c.max_lora_rank}"
            )
        if version in self.resident_versions():
            raise UserInputError(f"{where}: version {version} is resident already")
        return self.adapters

    def unload_version(self, version: int) -> None:
        """Free the slot of a resident adapter; refused while requests of it are in the
        engine (a request keeps one version from first token to last)."""
        slot = None if self.adapters is None else self.adapters.slot_of(version)
        if slot is None:
            raise UserInputError(
                f"unload_version({version}): no adapter of this version is resident "
                f"(resident: {self.resident_versions()})"
            )
        users = [s.request_id for s in self._seqs.values() if s.lora_version == version]
        if users:
            raise UserInputError(
                f"unload_version({version}): {len(users)} request(s) still run under it, "
                f"e.g. {users[0]!r} (finish, abort or export them first)"
            )
        assert self.adapters is not None
        self.adapters.unload(slot)

    def adapter_tensors(self, version: int) -> tuple[dict[str, torch.Tensor], float, int]:
        """A resident adapter as loaded: its A and B by the names they came by (read-only
        views of its slot, copy what you keep), its alpha and rank."""
        slot = None if self.adapters is None else self.adapters.slot_of(version)
        if slot is None:
            raise UserInputError(
                f"adapter_tensors({version}): no adapter of this version is resident "
                f"(resident: {self.resident_versions()})"
            )
        assert self.adapters is not None
        held = self.adapters.held[slot]
        return self.adapters.tensors(slot), held.alpha, held.rank

    def versions_in_use(self) -> set[int]:
        """The versions the engine's requests run under (a resident adapter stays while one
        of its requests is here)."""
        return {self._version_of(seq) for seq in self._seqs.values()}

    def resident_versions(self) -> list[int]:
        """The versions this engine serves now: its full weights' first, then its adapters' in order."""
        return [self.version] + (self.adapters.resident() if self.adapters else [])
