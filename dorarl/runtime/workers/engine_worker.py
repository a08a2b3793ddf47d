"""One rollout instance: a plain class around its engine (ours or vLLM, by engine.backend:
an `InstanceEngine`) that a Ray actor wraps thinly. What the engine cannot do its
`Capabilities` say: without KV export a migration is an abort here and a re-prefill on the
destination; without served weights the trainer's copy is every load's source, checked
inside the engine's own worker.

Every method returns plain picklable data. Calls on one worker run in submission order
(a Ray actor with one thread), which is what the controller's command ordering needs;
only sends of its weights (or of migrated KV) to a peer run beside them, on the actor's
`weights` concurrency group (dorarl.runtime.transfer.weight_endpoints, dorarl.runtime.transfer.kv_transfer).
Every weight load is checked against the sender's manifest before it is swapped in,
whatever carried it, and the engine's own weights against it once copied.

A load is of full weights, or, with an adapter manifest (a LoRA run on engines with
`engine.max_versions > 1`), of one version's adapter over the base the engine started on
(version 0, the base itself, never travels): the adapter goes into a free slot, every
request names its version, and an adapter goes only when the runtime no longer holds its
version here (`hold_versions`, from the controller's view, which counts requests whose
episode reset is still out) and no request here uses it. `resident_versions` and
`unload_version` are the rest of that interface. With a
`DeviceModel`, every engine step lasts its device time (dorarl.record.pacing). On cuda the
engine's memory share is its GPU share in Ray unless `engine.gpu_memory_share` says
otherwise. A setting the engine refuses at start (`ConfigError`, `UserInputError`) is raised
by the first call, `started` at a run's start, so it reaches the driver as itself (an error
raised while an actor is constructed reaches it only as the actor's death, and recovery
would restart it into the same error).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dorarl.config import ConfigError
from dorarl.engine import (
    Engine,
    EngineConfig,
    EngineStats,
    RequestOutput,
    RequestSnapshot,
    SamplingParams,
)
from dorarl.engine.capabilities import Capabilities
from dorarl.engine.instance import close_engine, open_engine
from dorarl.engine.interface import InstanceEngine
from dorarl.engine.outputs import EngineSetup
from dorarl.errors import UserInputError
from dorarl.record.pacing import DeviceModel, Pacer, PaceStats
from dorarl.runtime.threads import apply_threads, lower_priority
from dorarl.runtime.transfer import kv_transfer
from dorarl.runtime.transfer import weight_endpoints as endpoints
from dorarl.runtime.transfer.weight_group import (
    GroupAddress,
    Member,
    WeightGroup,
    device_key,
    share,
)
from dorarl.runtime.transfer.weight_layout import Manifest, WeightsRefused, flatten
from dorarl.runtime.workers.startup import ActorStartup, Reusable, StartupClock

log = logging.getLogger(__name__)
NO_VERSION = -1  # what an engine hosts whose weights failed their check after a copy


@dataclass
class NewRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    version: int | None = None  # what it runs under on an engine holding adapters


@dataclass
class RunReport:
    """What a burst of engine steps produced, with wall-clock spans for the timeline."""

    instance_id: int
    finished: list[RequestOutput]
    stats: EngineStats
    steps: int
    started_at: float
    ended_at: float
    busy_slots: list[int] = field(default_factory=list)  # requests in each step's batch
    pace: PaceStats | None = None  # real compute against device time (paced workers)
    prefill_tokens: int = 0  # prompt tokens its steps computed
    saved_tokens: int = 0  # prompt tokens the prefix cache gave instead
    mixed_steps: int = 0  # steps whose batch ran requests of two or more versions


@dataclass
class WeightsReport:
    instance_id: int
    version: int
    load_s: float
    ended_at: float


class EngineWorker(Reusable):
    """Hosts one engine (one version at a time, or with adapters several) and executes the
    runtime's calls on it."""

    def __init__(
        self,
        instance_id: int,
        model_folder: str,
        config: EngineConfig,
        threads: int = 1,
        pace: DeviceModel | None = None,
        version: int = 0,
        nice: int = 0,
    ):
        clock = StartupClock()
        apply_threads(threads)  # at full priority while it starts: the run waits for it
        self.instance_id = instance_id
        self.model_folder = model_folder
        self.config = with_ray_gpu_share(config)
        self.first_version = version  # the folder's weights: a base model, or a checkpoint
        self.caps: Capabilities = config.capabilities
        self._engine: InstanceEngine | None = None
        self._refused: Exception | None = None
        try:
            self._engine = open_engine(model_folder, self.config, version)
        except (ConfigError, UserInputError) as exc:
            self._refused = exc
        lower_priority(nice)  # its engine's threads (vLLM's included) yield to the trainer
        self.pace = pace
        self.pacer = Pacer() if pace is not None else None
        self.group: WeightGroup | None = None  # the weight-transfer group, once joined
        self._shared: dict[int, list[torch.Tensor]] = {}  # buckets a peer on this GPU reads
        self.held_kv = kv_transfer.HeldKV()  # exported KV waiting for its destination
        # older versions the controller holds here for requests that may still come (an
        # episode whose reset is out is on no engine yet): their adapters stay
        self._held: set[int] = set()
        self._startup = clock.done()

    @property
    def engine(self) -> Any:
        """The engine (an `InstanceEngine`; our `Engine` answers more, by `caps`); raises
        what refused it at start."""
        if self._engine is None:
            assert self._refused is not None
            raise self._refused
        return self._engine

    def startup(self) -> ActorStartup:
        """How long this actor took to come up (answers even when its engine was refused)."""
        return self._startup

    def started(self) -> EngineSetup:
        """What the engine runs (its fast paths as checked on the device, fallbacks
        included, and its KV pool): the first call of a run, which raises a refused setting."""
        return self.engine.setup()

    def reset(self) -> int:
        """A fresh engine on the folder's weights, as if the actor had just started; lets a
        benchmark run several modes on one set of actors instead of paying process start-up
        per mode. Returns the hosted version."""
        self._close()  # free the old KV pool before the new one is allocated
        self._engine = open_engine(self.model_folder, self.config, self.first_version)
        self.pacer = Pacer() if self.pace is not None else None
        return self.engine.version

    def release(self) -> None:
        """The engine, its KV and the weight group let go: the actor waits idle for a new run."""
        self._close()
        self.group = None
        self._shared = {}
        self.held_kv = kv_transfer.HeldKV()

    def _close(self) -> None:
        """Let the engine go (a vLLM engine's core is stopped: its KV cache is freed now)."""
        engine, self._engine = self._engine, None
        close_engine(engine)

    def add(self, requests: list[NewRequest]) -> int:
        for req in requests:
            version = self._version(req.version)
            self.engine.add_request(req.request_id, req.prompt_ids, req.params, version)
        return len(requests)

    def _version(self, version: int | None) -> int | None:
        """The version to name to the engine: a request's own where the engine holds
        adapters (several versions), else none (its one version)."""
        return version if self._holds_adapters() else None

    def _holds_adapters(self) -> bool:
        return self.caps.adapters and self.engine.adapters is not None

    def run(self, max_steps: int, until_finished: bool = True) -> RunReport:
        """Step up to `max_steps` times; stop early once a request finished (to report it)."""
        started = time.time()
        finished: list[RequestOutput] = []
        busy: list[int] = []
        steps = prefill = saved = mixed = 0
        while steps < max_steps and self.engine.has_runnable():
            finished.extend(self._step())
            work = self.engine.last_step
            busy.append(work.rows)
            prefill, saved = prefill + work.prefill_tokens, saved + work.saved_tokens
            mixed += work.versions > 1
            steps += 1
            if finished and until_finished:
                break
        pace = self.pacer.take() if self.pacer is not None else None
        return RunReport(
            self.instance_id, finished, self.engine.stats(), steps, started, time.time(), busy,
            pace, prefill, saved, mixed,
        )  # fmt: skip

    def _step(self) -> list[RequestOutput]:
        """One engine step; paced, it lasts the device time of the work it reports."""
        if self.pacer is None:
            return self.engine.step()
        started = time.perf_counter()
        outputs = self.engine.step()
        work = self.engine.last_step
        self.pacer.finish(started, self.pace.engine_step_s(work.extra_tokens, work.resident_tokens))
        return outputs

    def export(self, request_ids: list[str]) -> tuple[list[str], list[RequestSnapshot]]:
        """Full state with KV of the requests still here (finished ones were reported
        already), and their ids apart: the runtime asks for two results, so it can learn
        which requests moved without fetching the KV. An engine that exports no KV gives
        tokens-only snapshots (the requests aborted here): the destination re-prefills."""
        present = set(self.engine.request_ids())
        wanted = [rid for rid in request_ids if rid in present]
        if self.caps.kv_export:
            snapshots = [self.engine.export_request(rid) for rid in wanted]
        else:
            snapshots = [self.engine.abort(rid) for rid in wanted]
        return [snap.request_id for snap in snapshots], snapshots

    def import_(self, snapshots: list[RequestSnapshot]) -> list[str]:
        """Continue migrated requests here: with their KV, or (an engine that imports none)
        by re-prefilling their tokens under their own version, which this engine must host."""
        for snap in snapshots:
            if self.caps.kv_export:
                self.engine.import_request(snap)
            else:
                moved = dataclasses.replace(snap, migrations=snap.migrations + 1)
                self.engine.resume_request(moved, snap.version)
        return [snap.request_id for snap in snapshots]

    # ---- migrations whose KV travels over the group (dorarl.runtime.transfer.kv_transfer) ---------
    def export_kv(self, request_ids: list[str]) -> tuple[list[str], kv_transfer.KVParcel]:
        """`export`, the KV kept here (on the device) under the parcel's ticket until the
        destination asks for it."""
        present = set(self.engine.request_ids())
        snapshots = [
            self.engine.export_request(rid, to_host=False) for rid in request_ids if rid in present
        ]
        if self.engine.device.type == "cuda":
            for snap in snapshots:  # an offloaded request's KV comes from the host pool
                snap.kv = None if snap.kv is None else snap.kv.to(self.engine.device)
            # the `weights` thread sends (or shares) it on its own stream
            torch.cuda.current_stream(self.engine.device).synchronize()
        parcel = kv_transfer.pack_parcel(snapshots, self.held_kv)
        return [snap.request_id for snap in snapshots], parcel

    def import_parcel(
        self, parcel: kv_transfer.KVParcel, source: Any, source_rank: int, via: str
    ) -> list[str]:
        """Import a parcel's requests, their KV fetched from `source` `via` the group, CUDA
        IPC or the object store; KV that cannot come (its source is gone) is re-prefilled."""
        device, group = self.engine.device, self.group
        tensors = kv_transfer.receive(parcel, source, source_rank, via, device, group)
        if tensors is None:
            log.warning("instance %d: the KV of %d migrated requests is lost with its source; "
                        "they re-prefill", self.instance_id, len(parcel.snapshots))  # fmt: skip
            for snap in parcel.snapshots:
                self.engine.resume_request(snap.tokens_only(), self._version(snap.version))
            return [snap.request_id for snap in parcel.snapshots]
        return self.import_(parcel.with_kv(tensors))

    def send_kv(self, ticket: int, dst: int) -> None:
        """A held parcel's KV to rank `dst` over the group (runs on the `weights` group)."""
        assert self.group is not None, "send_kv before join_weights"
        kv_transfer.send_held(self.group, self.held_kv, ticket, dst)

    def share_kv(self, ticket: int) -> list | None:
        """CUDA IPC handles of a held parcel's KV, until `release_kv` (`weights` group)."""
        return kv_transfer.share_held(self.held_kv, ticket)

    def release_kv(self, ticket: int) -> None:
        self.held_kv.take(ticket)

    def take_kv(self, ticket: int) -> list[torch.Tensor] | None:
        """A held parcel's KV as CPU tensors, for a destination outside the group."""
        return kv_transfer.take_held(self.held_kv, ticket)

    def held_tickets(self) -> int:
        """Parcels whose KV waits here for its destination."""
        return len(self.held_kv)

    def abort(self, request_ids: list[str]) -> list[RequestSnapshot]:
        present = set(self.engine.request_ids())
        return [self.engine.abort(rid) for rid in request_ids if rid in present]

    def resume(
        self, request_ids: list[str], *aborted: list[RequestSnapshot], version: int | None = None
    ) -> list[str]:
        """Re-prefill `request_ids` from the snapshots of earlier `abort` calls (any version),
        their new tokens under `version` (None: the engine's full weights').

        A request missing from them finished before its abort ran and was reported then."""
        wanted = set(request_ids)
        snaps = [snap for batch in aborted for snap in batch if snap.request_id in wanted]
        for snap in snaps:
            self.engine.resume_request(snap.tokens_only(), self._version(version))
        return [snap.request_id for snap in snaps]

    def continue_(
        self, request_id: str, observation_ids: list[int], new_segment: bool = False
    ) -> bool:
        """An episode's next observation (multi-turn), or with `new_segment` the prompt of a
        new segment; False: no room, it keeps waiting."""
        if new_segment:
            return self.engine.start_segment(request_id, observation_ids)
        return self.engine.continue_request(request_id, observation_ids)

    def end(self, request_ids: list[str]) -> list[str]:
        """End episodes the runtime decided are over (those still here): KV freed."""
        present = set(self.engine.request_ids())
        ended = [rid for rid in request_ids if rid in present]
        for rid in ended:
            self.engine.end_request(rid)
        return ended

    def offload(self, request_id: str) -> bool:
        if not self.caps.offload:  # the engine manages its KV itself (vLLM preempts)
            return False
        return request_id in self.engine.request_ids() and self.engine.offload(request_id)

    def weights(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """This instance's copy of `version`, to serve a peer that switches to it: its
        adapter when one is resident (compact CPU copies), else the full weights, refused
        when it hosts neither (None: whatever it hosts)."""
        if not self.caps.serves_weights:
            raise RuntimeError(
                f"instance {self.instance_id}: engine.backend={self.config.backend} serves no "
                "weights to peers (the trainer's copy is the source)"
            )
        if (
            version is not None
            and version not in self._adapters()
            and version != self.engine.version
        ):
            raise WeightsRefused(
                f"instance {self.instance_id} does not host version {version} "
                f"(it hosts {self.engine.version})"
            )  # a replacement still taking its version back serves nothing under its name
        if version is not None and version in self._adapters():
            named, _, _ = self.engine.adapter_tensors(version)
            return {n: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
                    for n, t in named.items()}  # fmt: skip
        return {name: t.detach().to("cpu") for name, t in self.engine.state_dict().items()}

    def load_weights(
        self,
        named_tensors: dict[str, torch.Tensor],
        version: int,
        manifest: Manifest | None = None,
    ) -> WeightsReport:
        """Host `version` from `named_tensors`, once they match the sender's `manifest`
        (WeightsRefused names the tensor that does not): an adapter manifest's go into an
        adapter slot (`_host_adapter`), full weights are swapped in.

        Full weights: each request's KV blocks went back to the pool when it left
        (finished, exported or aborted; timed with that step or migration), and the
        controller moved every request off first, so both pools hold nothing in use
        (checked); the engine forgets the prefix cache's idle blocks of the old version as
        it loads (bookkeeping, no device work)."""
        if manifest is not None and manifest.adapter is not None:
            return self._host_adapter(named_tensors, version, manifest)
        self._check_empty()
        start = time.time()
        where = f"instance {self.instance_id}"
        if not self.caps.serves_weights:  # no readable copy: checked where it is loaded
            self.engine.load_weights(named_tensors, version, in_worker(manifest, version, where))
            return WeightsReport(self.instance_id, version, time.time() - start, time.time())
        if manifest is not None:
            manifest.verify(named_tensors, version, where)
        self.engine.load_weights(named_tensors, version)
        if manifest is not None:
            verify_hosted(self.engine, manifest, version, where)
        return WeightsReport(self.instance_id, version, time.time() - start, time.time())

    # ---- adapter versions (engine.max_versions > 1) ------------------------------------------
    def _host_adapter(
        self, named: dict[str, torch.Tensor], version: int, manifest: Manifest
    ) -> WeightsReport:
        """Load `version`'s adapter into a free slot (beside requests of other versions), then
        drop the adapters neither held (`hold_versions`) nor used here. Checked against
        `manifest` first (a refusal changes nothing) and once in its slot (a mismatch unloads
        it); slots are freed before the load only when none is free."""
        if version in self.engine.resident_versions():
            return self.host_resident(version)
        start = time.time()
        where = f"instance {self.instance_id}"
        manifest.verify(named, version, where)
        assert manifest.adapter is not None
        if self.engine.adapters is not None and self.engine.adapters.free_slot() is None:
            self._drop_unused(keep=version)
        self.engine.load_adapter(version, named, manifest.adapter.alpha, manifest.adapter.rank)
        hosted, _, _ = self.engine.adapter_tensors(version)
        try:
            manifest.verify(hosted, version, f"{where} after the copy")
        except WeightsRefused:
            self.engine.unload_version(version)
            raise
        self._drop_unused(keep=version)
        return WeightsReport(self.instance_id, version, time.time() - start, time.time())

    def host_resident(self, version: int) -> WeightsReport:
        """Host `version`, which this engine holds already (a LoRA run's base, version 0,
        or a resident adapter): nothing moves; the adapters neither held nor used are
        dropped."""
        start = time.time()
        if version not in self.engine.resident_versions():
            raise WeightsRefused(
                f"version {version} is not resident on instance {self.instance_id} "
                f"(resident: {self.engine.resident_versions()})"
            )
        self._drop_unused(keep=version)
        return WeightsReport(self.instance_id, version, time.time() - start, time.time())

    def hold_versions(self, versions: list[int]) -> list[int]:
        """Keep the adapters of `versions` (older ones the controller holds here for its
        requests) through the loads that follow, until each is unloaded; returns them."""
        self._held = set(versions)
        return sorted(self._held)

    def unload_version(self, version: int) -> bool:
        """Drop `version`'s adapter (no longer held) unless a request here still runs under
        it; returns whether it went (False: still in use, or no such adapter)."""
        self._held.discard(version)
        if version not in self._adapters() or version in self.engine.versions_in_use():
            return False
        self.engine.unload_version(version)
        return True

    def resident_versions(self) -> list[int]:
        """The versions this engine serves now: its full weights' first, then its adapters'."""
        return self.engine.resident_versions()

    def _adapters(self) -> list[int]:
        return self.engine.resident_versions()[1:]

    def _drop_unused(self, keep: int) -> None:
        """Drop the adapters of versions other than `keep` that the runtime does not hold."""
        for version in self._adapters():
            if version != keep and version not in self._held:
                self.unload_version(version)

    def _served(self, version: int, manifest: Manifest) -> dict[str, torch.Tensor] | None:
        """What this engine holds of `version` laid out as `manifest` asks (an adapter, or
        the full weights), or None when it does not hold it so (or serves no weights)."""
        if not self.caps.serves_weights:
            return None
        if manifest.adapter is not None:
            if version not in self._adapters():
                return None
            return self.engine.adapter_tensors(version)[0]
        return self.engine.state_dict() if self.engine.version == version else None

    def _check_empty(self) -> None:
        left = self.engine.request_ids()
        if left:
            raise RuntimeError(
                f"instance {self.instance_id}: load_weights with requests {left} in flight"
            )
        stats = self.engine.stats()
        if stats.kv_blocks_used or stats.host_blocks_used:
            raise RuntimeError(
                f"instance {self.instance_id}: {stats.kv_blocks_used} device and "
                f"{stats.host_blocks_used} host KV blocks held with no request in flight"
            )

    # ---- the weight-transfer group (dorarl.runtime.transfer.collective) ---------------------------
    def join_weights(self, address: GroupAddress, rank: int) -> Member:
        """Join the group (every member at once, at start-up)."""
        self.group = WeightGroup(address, rank, self.engine.device)
        return Member(rank, device_key(self.engine.device))

    def receive_weights(
        self, version: int, manifest: Manifest, source: Any, source_rank: int, via: str
    ) -> WeightsReport:
        """Load `version` from `source` (the trainer or a peer, rank `source_rank`) over the
        group, or through CUDA IPC when it shares this GPU (`via="ipc"`)."""
        assert self.group is not None, "receive_weights before join_weights"
        if manifest.adapter is None:
            self._check_empty()
        elif version in self.engine.resident_versions():
            return self.host_resident(version)  # nothing to receive: the source is not asked
        start = time.time()
        named = endpoints.receive(self.group, manifest, source, source_rank, via)
        report = self.load_weights(named, version, manifest)
        return WeightsReport(self.instance_id, version, time.time() - start, report.ended_at)

    def send_weights(self, version: int, manifest: Manifest, dst: int) -> None:
        """Serve the hosted version (its full weights, or its adapter) to rank `dst`, laid
        out as `manifest` (runs on the `weights` group)."""
        assert self.group is not None, "send_weights before join_weights"
        named = self._served(version, manifest)
        if named is None:
            self.group.refuse(version, dst)
            return
        endpoints.send_hosted(self.group, named, manifest, dst)

    def share_weights(self, version: int, manifest: Manifest, dst: int) -> list | None:
        """CUDA IPC handles of the hosted version laid out as `manifest`, kept alive until
        `release_shared` (a peer on this GPU; runs on the `weights` group)."""
        named = self._served(version, manifest)
        if named is None:
            return None
        count = len(manifest.buckets)
        self._shared[version] = [flatten(named, manifest, i) for i in range(count)]
        return share(self._shared[version])

    def release_shared(self, version: int) -> None:
        self._shared.pop(version, None)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def in_worker(manifest: Manifest | None, version: int, where: str) -> Any:
    """The check an engine runs on the tensors where it loads them (vLLM's worker), against
    `manifest`; None without one. A partial, so it pickles to a worker in another process."""
    if manifest is None:
        return None
    return functools.partial(manifest.verify, version=version, where=f"{where} in its worker")


def verify_hosted(engine: Engine, manifest: Manifest, version: int, where: str) -> None:
    """Check `engine`'s own tensors after a copy against `manifest`: what it will sample
    with and serve to peers, not only what arrived. They are the copy's destinations, in
    the manifest's dtype (the engines' own): the plain tensors and the q/k/v and gate/up
    slices of the fused matrices (oneDNN's reordered copies are made from these and cannot
    be compared bit for bit). A tied model's output layer is its embedding, which a
    manifest's `lm_head.weight` (a sender whose alias came apart) must then match. On a
    mismatch the engine holds no version's weights."""
    hosted = engine.state_dict()
    hosted.setdefault("lm_head.weight", hosted["model.embed_tokens.weight"])
    try:
        manifest.verify(hosted, version, f"{where} after the copy")
    except WeightsRefused:
        engine.version = NO_VERSION
        raise


def with_ray_gpu_share(config: EngineConfig) -> EngineConfig:
    """On cuda with no `gpu_memory_share`, the GPU share Ray gave this actor (at most a
    whole GPU: the engine uses one device); elsewhere, or outside a Ray actor, `config`."""
    if config.gpu_memory_share is not None or not config.device.startswith("cuda"):
        return config
    share = _ray_gpu_share()
    if share is None:
        return config
    return dataclasses.replace(config, gpu_memory_share=min(1.0, share))


def _ray_gpu_share() -> float | None:
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return None  # the driver: nothing is assigned to it
    share = context.get_assigned_resources().get("GPU", 0.0)
    return share if share > 0 else None
