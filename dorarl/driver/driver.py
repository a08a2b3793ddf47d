"""The driver: one run's controller, recorder, request table and group assembly, for every runtime.

Events in, commands out, as in the controller, one level up: `deliver(event)` hands the
event to the controller, shows event and commands to the recorder (and any observer),
then routes each command to the runtime's `Executor` after updating its own books. A
runtime adds only its executor and its event source: the loop `run(poll)` calls `poll()`
until the controller says Finish (or the run is asked to stop), and `poll` feeds what the
runtime observed back through `sample_done`, `migration_done`, `train_done` or `deliver`.

Invariants kept here for every runtime: a request completes at most once (a second report
of it is refused, so a sample is never counted twice); a Train gets complete groups only,
and so does a FilterGroup or a DropGroup, each group leaving the assembly once, by one of
them (`GroupAssembly` raises otherwise). A stop keeps what was sampled: once asked, the
controller hears `Stop` before anything else, dispatches nothing more and lets the step
and the requests in flight finish (within `stop_timeout_s`; groups still sampling then
are counted dropped, and a resume samples their prompts again); `resume_state` then holds
the complete groups not trained on, which a resumed driver (`carried`) queues again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dorarl.controller import (
    CarriedGroup,
    Command,
    Controller,
    ControllerConfig,
    Dispatch,
    DropGroup,
    Event,
    FilterGroup,
    Finish,
    Interrupt,
    LoadWeights,
    Migrate,
    MigrationDone,
    Offload,
    ReleaseVersion,
    Resume,
    SampleDone,
    SetTimer,
    Start,
    Stop,
    Train,
    TrainDone,
    request_id,
)
from dorarl.data import Sample, SavedGroup, group_to_json
from dorarl.data.lengths import LengthDist
from dorarl.driver.executor import Executor
from dorarl.driver.groups import GroupAssembly
from dorarl.driver.requests import RequestSpec, RequestTable
from dorarl.record import Recorder

log = logging.getLogger(__name__)

Observer = Callable[[Controller, Event, list[Command]], None]


class Driver:
    def __init__(
        self,
        config: ControllerConfig,
        recorder: Recorder,
        executor: Callable[[Driver], Executor],
        clock: Callable[[], float],
        *,
        lengths: LengthDist | None = None,
        seed: int = 0,
        observers: Sequence[Observer] = (),
        should_stop: Callable[[], bool] | None = None,
        carried: Sequence[SavedGroup] = (),
        stop_timeout_s: float = float("inf"),
    ) -> None:
        self.config = config
        self.controller = Controller(config)
        self.recorder = recorder
        self.now = clock  # seconds since the run started, the runtime's clock
        self.lengths, self.seed = lengths, seed  # forced response lengths, if any
        self.requests = RequestTable(config.instances)
        self.groups = GroupAssembly(config.group_size)
        self.observers = list(observers)
        # polled by the loop: once true, the controller hears Stop; the training step and the
        # requests in flight finish (within `stop_timeout_s`) and the run ends (`stopped`)
        self.should_stop: Callable[[], bool] = should_stop or _never
        self.stop_timeout_s = stop_timeout_s
        self.carried = list(carried)  # a stopped run's complete groups, queued at start
        self.finished = self.stopped = self.stopping = False
        # last: the runtime's machinery, made with this driver (its books are ready), which
        # it answers to; no command reaches it before `start`
        self.executor = executor(self)
        self._execute = self._command_table()

    # ---- the loop ------------------------------------------------------------------------
    def run(self, poll: Callable[[], None]) -> None:
        """Start, then `poll()` the runtime's event source until the run finishes or stops."""
        self.start()
        self.loop(poll)

    def start(self) -> None:
        """Start, with the carried groups back in the books (the controller may drop some)."""
        for saved in self.carried:
            self.groups.restore(saved)
            self.recorder.carried(saved.group.group_id)
        carried = tuple(
            CarriedGroup(s.group.group_id, s.prompt_index, s.group.version) for s in self.carried
        )
        self.deliver(Start(self.now(), carried))

    def loop(self, poll: Callable[[], None]) -> None:
        """`poll()` the runtime's event source until the run finishes or stops."""
        while not self.finished:
            self.check_stop()
            if not self.finished:
                poll()

    def check_stop(self) -> None:
        """Once a stop is asked for, tell the controller (once), before any other event."""
        if self.stopping or not self.should_stop():
            return
        self.stopping = True
        now = self.now()
        log.info("stop asked at %.1fs: the step and the requests in flight finish", now)
        self.deliver(Stop(now, now + self.stop_timeout_s))

    def deliver(self, event: Event) -> None:
        commands = self.controller.handle(event)
        self.recorder.observe(event, commands)
        for observer in self.observers:
            observer(self.controller, event, commands)
        for command in commands:
            self.execute(command)

    def execute(self, command: Command) -> None:
        """Update the books for `command`, then have the executor carry it out."""
        self._execute[type(command)](command)

    def resume_state(self) -> dict[str, Any]:
        """The checkpoint's data position once the run has ended (finished or stopped): the
        controller's, with every complete group not trained on kept whole
        (`carried_groups`, JSON) for the resumed run to queue again."""
        position = self.controller.resume_state(carry=True)
        ids = position.pop("carried_group_ids")
        position["carried_groups"] = [group_to_json(self.groups.saved(gid)) for gid in ids]
        return position

    # ---- what the runtime observed -------------------------------------------------------
    def sample_done(self, instance_id: int, sample: Sample) -> bool:
        """A request finished on `instance_id`; False (and nothing recorded) when the driver
        already has its completion (a replaced instance's late report, say)."""
        rid = request_id(sample.group_id, sample.sample_index)
        if self.requests.finish(rid) is None:
            log.warning("instance %d reported %s, which is done already: ignored", instance_id, rid)
            return False
        self.groups.add(sample)
        tokens = len(sample.response_ids)
        self.deliver(
            SampleDone(
                sample.group_id,
                sample.sample_index,
                instance_id,
                tokens,
                self.now(),
                sample.reward,
            )
        )
        return True

    def migration_done(
        self, src: int, dst: int, request_ids: Sequence[str], landed: Sequence[str]
    ) -> None:
        """The migration of `request_ids` from `src` ended; `landed` run on `dst` now (the
        others finished on `src` first and are reported from there)."""
        for rid in request_ids:
            if self.requests.live(rid):
                self.requests.moving(rid, False)
        for rid in landed:
            self.requests.place(rid, dst)
        self.deliver(MigrationDone(tuple(landed), src, dst, self.now()))

    def train_done(self, event: TrainDone) -> None:
        """The step in flight ended. Asked to stop meanwhile: the controller hears Stop
        first, so no next step is queued (the data position is that of `event.new_version`)."""
        self.check_stop()
        self.deliver(event)

    # ---- commands ------------------------------------------------------------------------
    def _command_table(self) -> dict[type, Callable[[Any], None]]:
        rollout, set_timer = self.executor.rollout, self.executor.set_timer
        return {
            Dispatch: self._dispatch,
            LoadWeights: rollout.load_weights,
            ReleaseVersion: rollout.release_version,
            Migrate: self._migrate,
            Interrupt: self._interrupt,
            Resume: self._resume,
            Offload: rollout.offload,
            Train: self._train,
            FilterGroup: self._filter,
            DropGroup: self._drop,
            SetTimer: lambda c: set_timer(c.at),
            Finish: self._finish,
        }

    def _dispatch(self, c: Dispatch) -> None:
        group = self.groups.open(c.group_id, c.prompt_index, c.version, self._targets(c.group_id))
        specs = [self._spec(c, s, group.target_lengths[s]) for s in c.sample_indices]
        for spec in specs:
            self.requests.start(spec, c.instance_id)
        self.executor.rollout.dispatch(c, specs)

    def _targets(self, group_id: int) -> list[int | None]:
        if self.groups.is_open(group_id):
            return []  # the group's own, made at its first Dispatch
        size = self.config.group_size
        if self.lengths is None:
            return [None] * size
        return list(self.lengths.group_lengths(self.seed, group_id, size))

    def _spec(self, c: Dispatch, sample_index: int, target: int | None) -> RequestSpec:
        rid = request_id(c.group_id, sample_index)
        seed = request_seed(self.seed, c.group_id, sample_index)
        return RequestSpec(rid, c.group_id, sample_index, c.prompt_index, c.version, seed, target)

    def _migrate(self, c: Migrate) -> None:
        for rid in c.request_ids:
            if self.requests.live(rid):
                self.requests.moving(rid)
        self.executor.rollout.migrate(c)

    def _interrupt(self, c: Interrupt) -> None:
        for rid in c.request_ids:
            if self.requests.live(rid):
                self.requests.park(rid)
        self.executor.rollout.interrupt(c)

    def _resume(self, c: Resume) -> None:
        for rid in c.request_ids:
            if self.requests.live(rid):
                self.requests.place(rid, c.instance_id)
        self.executor.rollout.resume(c)

    def _train(self, c: Train) -> None:
        groups = [self.groups.take(gid) for gid in c.group_ids]
        self.recorder.consumed(groups, c.version)
        self.executor.train(c.version, groups)

    def _filter(self, c: FilterGroup) -> None:
        """Dynamic sampling: the group closes untrained (complete: `take` checks it); the
        machinery holds nothing of it, so only the books and the recorder hear of it."""
        self.recorder.filtered(self.groups.take(c.group_id), c.step)

    def _drop(self, c: DropGroup) -> None:
        """A carried group this run cannot train on: it closes (the recorder counts it)."""
        log.warning("carried group %d of v%d dropped: %s", c.group_id, c.version, c.reason)
        self.groups.discard(c.group_id)

    def _finish(self, c: Finish) -> None:
        log.info("run finished at %.1fs: %s", self.now(), c.reason)
        self.finished = True
        self.stopped = self.stopping
        if self.stopping:
            self._drop_unfinished()

    def _drop_unfinished(self) -> None:
        """Groups still sampling when a stop's time ran out: dropped (their prompts are the
        resume position's), said in one line."""
        groups = sorted({self.requests.spec(rid).group_id for rid in self.requests.ids()})
        for gid in groups:
            self.recorder.lost(gid, "in_flight_at_stop")
            self.groups.discard(gid)
        if groups:
            log.warning(
                "stop: %d groups still sampling after stop_timeout_s=%gs dropped; a resume "
                "samples their prompts again", len(groups), self.stop_timeout_s,
            )  # fmt: skip


def _never() -> bool:
    return False


def request_seed(seed: int, group_id: int, sample_index: int) -> int:
    """A request's own seed: its tokens do not depend on where or beside whom it runs."""
    return (seed * 1_000_003 + group_id) * 1_009 + sample_index
