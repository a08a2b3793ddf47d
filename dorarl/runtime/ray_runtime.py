"""Ray runtime: executes the controller's commands with engine actors and a trainer actor.

The driver loop owns the `Controller` and the `Recorder`, exactly as the simulator does,
and adds no policy: it places, moves, interrupts and trains what it is told. Weights and
KV travel as object references handed from actor to actor (the object store moves them
peer to peer; on a cluster the driver never touches the bytes). Each actor runs one call
at a time in submission order, which gives the per-instance command ordering the
controller relies on. Paced workers (device emulation) report real compute against device
time; the runtime adds both to every step's metrics (`pace_engine`, `pace_train`).
A dead engine is replaced (dorarl.runtime.recovery), and so is a dead trainer
(dorarl.runtime.trainer_recovery): every call that changes the trainer's state goes
through `submit_train` or `save_checkpoint`, so a new trainer can replay it.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dorarl.controller import (
    TRAINER,
    Controller,
    ControllerConfig,
    Dispatch,
    Event,
    Finish,
    InstanceStats,
    Interrupt,
    LoadWeights,
    Migrate,
    MigrationDone,
    Offload,
    Resume,
    SampleDone,
    SetTimer,
    Start,
    Timer,
    Train,
    TrainDone,
    WeightsLoaded,
    parse_request_id,
    request_id,
)
from dorarl.data import Group, Sample
from dorarl.data.lengths import LengthDist
from dorarl.engine import EngineConfig, RequestOutput, SamplingParams
from dorarl.errors import WorkerFailed
from dorarl.record.pacing import DeviceModel, PaceStats
from dorarl.record.recorder import Recorder
from dorarl.runtime.engine_worker import EngineWorker, NewRequest, RunReport, WeightsReport
from dorarl.runtime.placement import PlacedActors
from dorarl.runtime.recovery import InstanceRecovery
from dorarl.runtime.trainer_recovery import TRAINER_KINDS, SaveCall, TrainCall, TrainerRecovery
from dorarl.runtime.trainer_worker import TrainerWorker
from dorarl.tasks import Prompt, Task, score

log = logging.getLogger(__name__)

STEPS_PER_CALL = 8
"""Engine steps per remote call: long enough to amortise the call, short enough to react."""


@dataclass
class RolloutSettings:
    """What the runtime needs beyond the controller: sampling and the seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    forced_lengths: LengthDist | None = None  # benchmarks: target lengths, EOS ignored


@dataclass
class _Pending:
    kind: str
    args: tuple[Any, ...] = ()
    started: float = 0.0
    seq: int = 0
    epoch: tuple[int, ...] = ()  # instance generations when submitted (see recovery)


class RayRuntime:
    """Runs one training job on Ray; `run()` returns the recorder's summary."""

    # The overheads this runtime measures; build its Recorder with them. No free_cache: a
    # request's KV blocks go back to the pool as it leaves an engine, inside the engine step,
    # migration or interrupt that removes it, so a version change has nothing left to free.
    OVERHEAD_KINDS = ("load_balance", "request_transfer")

    def __init__(
        self,
        controller_config: ControllerConfig,
        task: Task,
        rollout: RolloutSettings,
        engine_workers: list[Any],
        trainer: Any,
        recorder: Recorder,
        *,
        on_step: Callable[[dict[str, Any], list[Group]], None] | None = None,
        on_publish: Callable[[int], None] | None = None,
        steps_per_call: int = STEPS_PER_CALL,
        respawn: Callable[[int], Any] | None = None,
        max_restarts: int = 0,
        respawn_trainer: Callable[[str | None], Any] | None = None,
        max_trainer_restarts: int = 0,
        checkpoints: Path | None = None,
    ) -> None:
        if tuple(recorder.overhead_kinds) != self.OVERHEAD_KINDS:
            raise ValueError(
                f"RayRuntime measures the overheads {self.OVERHEAD_KINDS}; its Recorder "
                f"reports {recorder.overhead_kinds} (pass overhead_kinds=RayRuntime.OVERHEAD_KINDS)"
            )
        self.config = controller_config
        self.steps_per_call = steps_per_call
        self.controller = Controller(controller_config)
        self.task, self.rollout = task, rollout
        self.prompts: list[Prompt] = task.train_prompts()
        self.workers, self.trainer, self.recorder = engine_workers, trainer, recorder
        self.on_step = on_step
        self.on_publish = on_publish
        # polled by the loop: once true, nothing new is dispatched, the training step in
        # flight (if any) finishes and the run ends there (`stopped`)
        self.should_stop: Callable[[], bool] = lambda: False
        self.stopped = False
        self.t0 = time.monotonic()
        self.finished = False
        self.pending: dict[ray.ObjectRef, _Pending] = {}
        self.running_call: dict[int, ray.ObjectRef] = {}
        self.held = [0] * controller_config.instances  # requests placed on each instance
        self.where: dict[str, int] = {}  # live request -> instance it was placed on
        self.specs: dict[str, NewRequest] = {}  # live request -> how it was started
        self.moving: set[str] = set()  # requests in a migration not yet landed
        self.kv_above = [False] * controller_config.instances
        self.timers: list[float] = []
        self.weights_ref: dict[int, ray.ObjectRef] = {}
        self.published = controller_config.initial_version
        self.groups: dict[int, tuple[int, int]] = {}  # group -> (prompt index, version)
        self.completed: dict[int, list[Sample]] = defaultdict(list)
        self.parked: dict[str, ray.ObjectRef] = {}  # interrupted request -> abort result
        self.reward_errors = 0
        self._execute = self._executors()
        self._completions = {
            "run": self._on_run,
            "load": self._on_loaded,
            "migrate": self._on_migrated,
            "train": self._on_trained,
            "replay": self._on_replayed,
            "save": self._on_saved,
        }
        self._seq = 0
        self.pace_step = {"engine": PaceStats(), "train": PaceStats()}  # since the last step
        self.pace_total = {"engine": PaceStats(), "train": PaceStats()}
        self.recovery = (
            InstanceRecovery(self, respawn, max_restarts) if respawn and max_restarts else None
        )
        self.trainer_recovery = (
            TrainerRecovery(self, respawn_trainer, checkpoints, max_trainer_restarts)
            if respawn_trainer and max_trainer_restarts
            else None
        )

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- main loop -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Wait for every actor to be up (the clock starts then), run to `Finish`, close."""
        ray.get([w.stats.remote() for w in self.workers] + [self.trainer.version.remote()])
        self.weights_ref[self.published] = self.trainer.weights.remote()
        self.t0 = time.monotonic()
        self._deliver(Start(self.now()))
        while not self.finished:
            if self.should_stop() and not self._training():
                self._stop("asked to stop")
                break
            self._fire_timers()
            ready = self._wait()
            for ref in ready:
                job = self.pending.pop(ref, None)
                if job is not None:  # None: dropped by a recovery earlier in this batch
                    self._complete(ref, job)
        return self.recorder.close(self.now())

    def _wait(self) -> list[ray.ObjectRef]:
        """Results that are ready, in submission order (an actor's calls finish in order)."""
        timeout = 1.0 if not self.timers else max(0.0, min(1.0, self.timers[0] - self.now()))
        if not self.pending:
            if not self.timers:
                raise RuntimeError(f"deadlock: nothing in flight, {self.controller.counts()}")
            time.sleep(timeout)
            return []
        refs = list(self.pending)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return sorted(ready, key=lambda ref: self.pending[ref].seq)

    def _fire_timers(self) -> None:
        while self.timers and self.timers[0] <= self.now() and not self.finished:
            heapq.heappop(self.timers)
            self._deliver(Timer(self.now()))

    def _deliver(self, event: Event) -> None:
        commands = self.controller.handle(event)
        self.recorder.observe(event, commands)
        for command in commands:
            self._execute[type(command)](command)

    def _submit(self, ref: ray.ObjectRef, kind: str, *args: Any) -> None:
        self._seq += 1
        epoch = tuple(self.recovery.epoch) if self.recovery else ()
        self.pending[ref] = _Pending(kind, args, self.now(), self._seq, epoch)

    def _place(self, rid: str, iid: int) -> None:
        self._unplace(rid)
        self.where[rid] = iid
        self.held[iid] += 1

    def _unplace(self, rid: str) -> None:
        iid = self.where.pop(rid, None)
        if iid is not None:
            self.held[iid] -= 1

    # ---- completions ---------------------------------------------------------------------
    def _complete(self, ref: ray.ObjectRef, job: _Pending) -> None:
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as exc:
            on_trainer = job.kind in TRAINER_KINDS
            recovery = self.trainer_recovery if on_trainer else self.recovery
            recovered = (
                recovery is not None and recovery.recoverable(job, exc) and recovery.on_failure(job)
            )
            if not recovered:
                raise WorkerFailed(_worker_of(job), _describe(exc)) from exc
            return
        self._completions[job.kind](result, job)

    def _on_run(self, report: RunReport, job: _Pending) -> None:
        iid = report.instance_id
        self.running_call.pop(iid, None)
        if report.pace is not None:
            self._pace("engine", report.pace)
        for output in report.finished:
            self._on_sample_finished(iid, output)
        self._report_kv(iid, report)
        self._keep_running(iid)

    def _on_sample_finished(self, iid: int, output: RequestOutput) -> None:
        group_id, sample_index = parse_request_id(output.request_id)
        self._unplace(output.request_id)
        self.specs.pop(output.request_id, None)
        prompt_index, _ = self.groups[group_id]
        sample = self._sample(group_id, sample_index, prompt_index, output)
        self.completed[group_id].append(sample)
        self.recorder.reprefill(output.reprefill_tokens)
        num_tokens = len(output.output_ids)
        self._deliver(SampleDone(group_id, sample_index, iid, num_tokens, self.now()))

    def _sample(self, group_id: int, index: int, prompt_index: int, out: RequestOutput) -> Sample:
        prompt = self._prompt(prompt_index)
        reward, error = score(self.task, prompt, out.output_ids)
        self.reward_errors += error is not None
        return Sample(
            group_id=group_id,
            sample_index=index,
            prompt_id=prompt.prompt_id,
            prompt_ids=list(out.prompt_ids),
            response_ids=list(out.output_ids),
            logprobs=list(out.logprobs),
            versions=list(out.versions),
            finish_reason=out.finish_reason,
            reward=reward,
            reward_error=error,
            migrations=out.migrations,
            offloads=out.offloads,
        )

    def _report_kv(self, iid: int, report: RunReport) -> None:
        usage = report.stats.kv_usage
        above = usage >= self.config.orchestrator.kv_offload_threshold
        if above != self.kv_above[iid]:
            self.kv_above[iid] = above
            stats = report.stats
            event = InstanceStats(iid, stats.running, stats.waiting, usage, self.now())
            self._deliver(event)

    def _on_loaded(self, report: WeightsReport, job: _Pending) -> None:
        self.recorder.overhead("load_balance", self.now() - job.started)
        self._deliver(WeightsLoaded(report.instance_id, report.version, self.now()))

    def _on_migrated(self, ids: list[str], job: _Pending) -> None:
        src, dst, rids = job.args
        self.moving.difference_update(rids)
        for rid in ids:
            self._place(rid, dst)
        self.recorder.overhead("request_transfer", self.now() - job.started)
        self._keep_running(dst)
        self._deliver(MigrationDone(tuple(ids), src, dst, self.now()))

    def _on_trained(self, metrics: dict[str, Any], job: _Pending) -> None:
        version, groups, weights = job.args
        self.published = version + 1
        self.weights_ref[self.published] = weights
        self.weights_ref.pop(version - self.config.effective_K - 1, None)
        metrics = {k: v for k, v in metrics.items() if k != "version"}  # the recorder's own
        metrics["reward_errors"] = self.reward_errors
        if "train_paced_s" in metrics:
            train = PaceStats()
            train.record(metrics["train_compute_s"], metrics["train_paced_s"])
            self._pace("train", train)
        if self.pace_total["engine"].steps or self.pace_total["train"].steps:
            metrics["pace_engine"] = self.pace_step["engine"].to_dict()
            metrics["pace_train"] = self.pace_step["train"].to_dict()
            self.pace_step = {"engine": PaceStats(), "train": PaceStats()}
        self.recorder.step_metrics(metrics)
        if self.on_publish is not None:  # before the controller can queue the next step
            self.on_publish(self.published)
        done = TrainDone(self.published, self.now())
        if self.should_stop():  # the step in flight when asked to stop: record it, queue none
            self.recorder.observe(done, [])
            self._stop("asked to stop after this step")
        else:
            self._deliver(done)
        if self.on_step is not None:
            self.on_step(self.recorder.steps[-1], groups)

    def _on_replayed(self, metrics: dict[str, Any], job: _Pending) -> None:
        """A step of a dead trainer made again: its version's weights are the new trainer's."""
        version, _, weights = job.args
        if version + 1 in self.weights_ref:
            self.weights_ref[version + 1] = weights
        if self.trainer_recovery is not None:
            self.trainer_recovery.check_replay(version, metrics)

    def _on_saved(self, path: str, job: _Pending) -> None:
        if self.trainer_recovery is not None:
            self.trainer_recovery.log.durable(job.args[0].version)

    # ---- trainer calls (logged, so a new trainer can replay them) ------------------------
    def submit_train(self, version: int, groups: list[Group], kind: str = "train") -> None:
        """Queue the step training `version` on `groups`; its weights come with its result,
        so a version whose step finished always has weights to load."""
        call = self.trainer.train_step_and_weights.options(num_returns=2)
        metrics, weights = call.remote(groups)
        self._submit(metrics, kind, version, groups, weights)

    def save_checkpoint(
        self, folder: str | Path, position: dict[str, Any], keep: int
    ) -> ray.ObjectRef:
        """Queue a checkpoint of the published version with its data position `position`."""
        call = SaveCall(int(position["version"]), str(folder), position, keep)
        if self.trainer_recovery is not None:
            self.trainer_recovery.log.record(call)
        return self.submit_save(call)

    def submit_save(self, call: SaveCall) -> ray.ObjectRef:
        ref = self.trainer.save_checkpoint.remote(call.folder, call.position, call.keep)
        self._submit(ref, "save", call)
        return ref

    # ---- command execution ---------------------------------------------------------------
    def _executors(self) -> dict[type, Callable[[Any], None]]:
        return {
            Dispatch: self._dispatch,
            LoadWeights: self._load,
            Migrate: self._migrate,
            Interrupt: self._interrupt,
            Resume: self._resume,
            Offload: self._offload,
            Train: self._train,
            SetTimer: lambda c: heapq.heappush(self.timers, c.at),
            Finish: self._finish,
        }

    def _dispatch(self, c: Dispatch) -> None:
        if self.should_stop():  # stopping: the group stays untrained, so a resume samples it
            return
        self.groups.setdefault(c.group_id, (c.prompt_index, c.version))
        prompt = self._prompt(c.prompt_index)
        targets = self._target_lengths(c.group_id)
        requests = [self._new_request(c.group_id, s, prompt, targets[s]) for s in c.sample_indices]
        self.workers[c.instance_id].add.remote(requests)
        for req in requests:
            self._place(req.request_id, c.instance_id)
            self.specs[req.request_id] = req
        self._keep_running(c.instance_id)

    def _target_lengths(self, group_id: int) -> list[int | None]:
        dist, size = self.rollout.forced_lengths, self.config.group_size
        if dist is None:
            return [None] * size
        return list(dist.group_lengths(self.rollout.seed, group_id, size))

    def _new_request(
        self, group_id: int, sample_index: int, prompt: Prompt, target_len: int | None
    ) -> NewRequest:
        r = self.rollout
        params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=max(r.max_new_tokens, target_len or 0),
            stop_token_ids=list(r.stop_token_ids),
            seed=_request_seed(r.seed, group_id, sample_index),
            target_len=target_len,
        )
        return NewRequest(request_id(group_id, sample_index), list(prompt.prompt_ids), params)

    def _load(self, c: LoadWeights) -> None:
        if c.source == TRAINER:
            weights = self.weights_ref[c.version]
        else:
            weights = self.workers[c.source].weights.remote()
        ref = self.workers[c.instance_id].load_weights.remote(weights, c.version)
        self._submit(ref, "load", c.instance_id, c.version, c.source)

    def _migrate(self, c: Migrate) -> None:
        exported = self.workers[c.src].export.remote(list(c.request_ids))
        ref = self.workers[c.dst].import_.remote(exported)
        self.moving.update(c.request_ids)
        self._submit(ref, "migrate", c.src, c.dst, c.request_ids)

    def _interrupt(self, c: Interrupt) -> None:
        aborted = self.workers[c.instance_id].abort.remote(list(c.request_ids))
        for rid in c.request_ids:
            self.parked[rid] = aborted
            self._unplace(rid)

    def _resume(self, c: Resume) -> None:
        refs = list(dict.fromkeys(self.parked.pop(rid) for rid in c.request_ids))
        self.workers[c.instance_id].resume.remote(list(c.request_ids), *refs)
        for rid in c.request_ids:
            self._place(rid, c.instance_id)
        self._keep_running(c.instance_id)

    def _offload(self, c: Offload) -> None:
        self.workers[c.instance_id].offload.remote(c.request_id)

    def _train(self, c: Train) -> None:
        groups = [self._group(gid) for gid in c.group_ids]
        self.recorder.consumed(groups, c.version)
        if self.trainer_recovery is not None:
            self.trainer_recovery.log.record(TrainCall(c.version, groups))
        self.submit_train(c.version, groups)

    def _finish(self, c: Finish) -> None:
        log.info("run finished at %.1fs: %s", self.now(), c.reason)
        self.finished = True

    def _stop(self, reason: str) -> None:
        """End the run early at `published`; the controller's data position is valid now (no
        step in flight, or the one in flight done and its TrainDone not delivered)."""
        log.info("run stopped at %.1fs, version %d: %s", self.now(), self.published, reason)
        self.finished = self.stopped = True

    def _training(self) -> bool:
        return any(job.kind == "train" for job in self.pending.values())

    # ---- helpers -------------------------------------------------------------------------
    def _pace(self, kind: str, stats: PaceStats) -> None:
        self.pace_step[kind].merge(stats)
        self.pace_total[kind].merge(stats)

    def _keep_running(self, iid: int) -> None:
        """Keep one stepping call queued on every instance that holds requests."""
        if self.held[iid] > 0 and iid not in self.running_call:
            ref = self.workers[iid].run.remote(self.steps_per_call)
            self.running_call[iid] = ref
            self._submit(ref, "run", iid)

    def _prompt(self, prompt_index: int) -> Prompt:
        return self.prompts[prompt_index % len(self.prompts)]

    def _group(self, group_id: int) -> Group:
        samples = sorted(self.completed.pop(group_id), key=lambda s: s.sample_index)
        prompt_index, version = self.groups.pop(group_id)
        assert len(samples) == self.config.group_size, f"group {group_id} is incomplete"
        return Group(group_id, self._prompt(prompt_index).prompt_id, version, samples)


def _worker_of(job: _Pending) -> str:
    """The worker a pending call ran on, for error messages."""
    if job.kind in ("train", "replay"):
        return f"the trainer (training step {job.args[0]})"
    if job.kind == "save":
        return f"the trainer (checkpoint of version {job.args[0].version})"
    if job.kind == "migrate":
        return f"engine instance {job.args[0]} or {job.args[1]} (request migration)"
    return f"engine instance {job.args[0]} ({'weight load' if job.kind == 'load' else 'decoding'})"


def _describe(exc: Exception) -> str:
    """The worker's own exception first (a RayTaskError's first line is Ray's call header),
    then Ray's full report with the remote traceback."""
    cause = getattr(exc, "cause", None)
    head = f"{type(cause).__name__}: {cause}" if cause is not None else type(exc).__name__
    return f"{head}\n\n{exc}"


def _request_seed(seed: int, group_id: int, sample_index: int) -> int:
    """A request's own seed: its tokens do not depend on where or beside whom it runs."""
    return (seed * 1_000_003 + group_id) * 1_009 + sample_index


def start_workers(
    num_instances: int,
    model_folder: str,
    engine_config: EngineConfig,
    trainer_args: tuple[Any, ...],
    threads: int,
    pace: DeviceModel | None = None,
    version: int = 0,
    placed: PlacedActors | None = None,
    nice: int = 0,
) -> tuple[list[Any], Any]:
    """Create the engine actors and the trainer actor (local Ray or a cluster); engines host
    `model_folder`'s weights as `version`; with `pace`, every engine step and training step
    lasts its device time (device emulation). `placed` gives each actor its GPU share and
    bundle; without it an actor on cuda asks Ray for a whole GPU. Engines run `threads`
    torch threads at niceness `nice` (dorarl.runtime.threads)."""
    workers = [
        spawn_engine(i, model_folder, engine_config, threads, pace, version, placed, nice)
        for i in range(num_instances)
    ]
    return workers, spawn_trainer(trainer_args, pace, placed)


def spawn_trainer(
    trainer_args: tuple[Any, ...],
    pace: DeviceModel | None = None,
    placed: PlacedActors | None = None,
) -> Any:
    """The trainer actor (at start, or replacing a dead one in the same bundle):
    `trainer_args` are `TrainerWorker`'s (model folder, trainer config, threads[, checkpoint
    to restore])."""
    options = actor_options("trainer", trainer_args[1].device, placed)
    return ray.remote(**options)(TrainerWorker).remote(*trainer_args, pace=pace)


def spawn_engine(
    instance_id: int,
    model_folder: str,
    engine_config: EngineConfig,
    threads: int,
    pace: DeviceModel | None = None,
    version: int = 0,
    placed: PlacedActors | None = None,
    nice: int = 0,
) -> Any:
    """One engine actor (at start, or replacing a dead one in the same bundle)."""
    options = actor_options(f"engine{instance_id}", engine_config.device, placed)
    engine_actor = ray.remote(**options)(EngineWorker)
    return engine_actor.remote(
        instance_id, model_folder, engine_config, threads, pace, version, nice
    )


def actor_options(actor: str, device: str, placed: PlacedActors | None) -> dict[str, Any]:
    """Ray options of `actor` computing on `device`: its share and bundle from `placed`, or
    without a placement one whole GPU for cuda (Ray then makes that GPU the actor's only
    visible one, so `cuda` means it), none otherwise. CPU work is not reserved: instances
    share cores, which the benchmarks' pacing accounts for."""
    if device == "cpu":
        return {"num_cpus": 0, "num_gpus": 0}
    if placed is not None:
        return placed.options(actor)
    return {"num_cpus": 0, "num_gpus": 1}
