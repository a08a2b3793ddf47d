"""A simulated rollout instance: continuous batching under the cost model, in closed form.

All active requests advance together. `progress` counts (fractional) decode steps since the
batch last emptied; a request that joined at progress p0 with g tokens has g + (P - p0).
Resident KV is `kv_base + B * P`, so a step costs A + D * P' as P' grows and the time of
any future progress point is a quadratic: no per-token events, O(log B) per change.
Prefill, offload and restore stall the whole instance (no compute/transfer overlap).
A multi-turn episode between turns is `parked`: out of the batch, its KV kept (on the device,
or on the host once offloaded); answered, it takes a free slot or waits parked for one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from dorarl.sim.cost import CostModel

FINISH_TOL = 1e-3  # tokens: float slack when a wake lands on a completion
RESTORE_LEVEL = 0.9  # restore offloaded KV once it fits under this share of the threshold


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: str
    group_id: int
    sample_index: int
    prompt_len: int
    target_len: int
    gen: float = 0.0  # tokens generated as of the last join/leave
    pjoin: float = 0.0
    seq: int = 0  # join counter: validates finish-heap entries
    segments: list[tuple[int, int]] = field(default_factory=list)  # (version, first token)
    migrations: int = 0
    offloads: int = 0
    prompt_index: int = 0  # the dataset prompt its group samples
    turn_ends: list[int] = field(default_factory=list)  # episodes: where turns end, but the last
    turns_done: int = 0  # episodes: turns ended so far
    waiting: bool = False  # episodes: its environment is working
    answered: bool = False  # its environment answered while it moved or was interrupted
    on_host: bool = False  # parked with its KV offloaded

    @property
    def context(self) -> float:
        return self.prompt_len + self.gen

    @property
    def stop_at(self) -> int:
        """Generated tokens at which it leaves the batch next: its turn's end, or its length."""
        if self.turns_done < len(self.turn_ends):
            return self.turn_ends[self.turns_done]
        return self.target_len

    @property
    def last_turn(self) -> bool:
        """Its last turn has ended."""
        return self.turns_done > len(self.turn_ends)


class SimInstance:
    def __init__(self, instance_id: int, cost: CostModel, slots: int, kv_threshold: float) -> None:
        self.instance_id = instance_id
        self.cost = cost
        self.slots = slots
        self.kv_limit = kv_threshold * cost.kv_capacity_tokens
        self.kv_cap = float(cost.kv_capacity_tokens)
        self.version = 0
        self.ready = True
        # the versions whose weights it holds (several: LoRA adapters)
        self.weights_held: set[int] = {0}
        self.active: dict[str, SimRequest] = {}
        self.offloaded: dict[str, SimRequest] = {}
        self.parked: dict[str, SimRequest] = {}  # episodes between turns
        self.kv_parked = 0.0  # their KV on the device
        self.incoming = 0
        self.incoming_waiting = 0  # of those, episodes waiting for their environment
        self.progress = 0.0
        self.kv_base = 0.0
        self.clock = 0.0
        self.stall_until = 0.0
        self.busy_until = 0.0  # exporting KV: a weight load waits for it
        self.kv_above = False
        self.epoch = 0
        self._finish: list[tuple[float, int, str]] = []
        self._joins = 0
        self.cached_prompts: set[int] = set()  # groups whose prompt KV it holds (this version)

    # ---- state ---------------------------------------------------------------------------
    @property
    def holding(self) -> int:
        return len(self.active) + len(self.offloaded) + len(self.parked) + self.incoming

    @property
    def env_waiting(self) -> int:
        """Requests here (or coming) that wait for their environment: they need no slot."""
        return sum(r.waiting for r in self.parked.values()) + self.incoming_waiting

    def resident(self) -> float:
        return self.kv_base + len(self.active) * self.progress + self.kv_parked

    def park(self, req: SimRequest) -> None:
        """An episode leaves the batch between turns, keeping its KV."""
        self.parked[req.rid] = req
        if not req.on_host:
            self.kv_parked += req.context

    def unpark(self, rid: str) -> SimRequest:
        req = self.parked.pop(rid)
        if not req.on_host:
            self.kv_parked -= req.context
        if not self.parked:  # a fresh origin keeps float error from accumulating
            self.kv_parked = 0.0
        return req

    def to_host(self, rid: str) -> None:
        """A parked episode's KV goes to host memory (it stays parked)."""
        req = self.parked[rid]
        if not req.on_host:
            self.kv_parked -= req.context
            req.on_host = True

    def ready_parked(self) -> SimRequest | None:
        """A parked episode whose environment answered, with its KV here, if a slot is free."""
        if len(self.active) >= self.slots:
            return None
        return next((r for r in self.parked.values() if not r.waiting and not r.on_host), None)

    def advance(self, now: float) -> None:
        start = max(self.clock, self.stall_until)
        if now > start and self.active:
            self.progress += self._steps_in(now - start)
        self.clock = max(self.clock, now)

    def stall(self, now: float, seconds: float) -> None:
        self.stall_until = max(self.stall_until, now) + seconds

    def join(self, req: SimRequest) -> None:
        self._joins += 1
        req.pjoin, req.seq = self.progress, self._joins
        self.kv_base += req.context - self.progress
        self.active[req.rid] = req
        heapq.heappush(self._finish, (self.progress + req.stop_at - req.gen, req.seq, req.rid))

    def leave(self, rid: str) -> SimRequest:
        req = self.active.pop(rid)
        self.kv_base -= req.context - req.pjoin
        req.gen = min(float(req.stop_at), req.gen + self.progress - req.pjoin)
        if not self.active:  # a fresh origin keeps float error from accumulating
            self.progress = self.kv_base = 0.0
            self._finish.clear()
        return req

    def pop_finished(self) -> list[SimRequest]:
        done = []
        while (top := self._valid_top()) is not None and top[0] - self.progress <= FINISH_TOL:
            heapq.heappop(self._finish)
            req = self.leave(top[2])
            req.gen = float(req.stop_at)
            done.append(req)
        return done

    # ---- timing --------------------------------------------------------------------------
    def next_wake(self) -> float | None:
        """When this instance next needs attention: a completion, a KV crossing, a restore."""
        resident = self.resident()
        if self.kv_above != (resident >= self.kv_limit - 1e-6 * self.kv_cap):
            return self.clock
        if self.offloaded and self.can_restore() or self.ready_parked() is not None:
            return self.clock
        top = self._valid_top()
        if top is None:
            return None
        steps = [max(0.0, top[0] - self.progress)]
        batch = len(self.active)
        if not self.kv_above:
            steps.append((self.kv_limit - resident) / batch)
        elif batch >= 2 or self.kv_parked > 0:  # then something can leave the device
            steps.append(max(0.0, (self.kv_cap - resident) / batch))
        return max(self.clock, self.stall_until) + self._time_for(min(steps))

    def can_restore(self) -> bool:
        if len(self.active) >= self.slots:  # episodes answered at once can outnumber the slots
            return False
        first = next(iter(self.offloaded.values()))
        return self.resident() + first.context <= RESTORE_LEVEL * self.kv_limit or not self.active

    def _rates(self) -> tuple[float, float]:
        batch = len(self.active)
        a = self.cost.decode_step_s(batch, self.resident())
        return a, self.cost.decode_per_kv_token_s * batch

    def _steps_in(self, dt: float) -> float:
        a, d = self._rates()
        return 2.0 * dt / (a + math.sqrt(a * a + 2.0 * d * dt))

    def _time_for(self, steps: float) -> float:
        a, d = self._rates()
        return a * steps + 0.5 * d * steps * steps

    def _valid_top(self) -> tuple[float, int, str] | None:
        while self._finish:
            top = self._finish[0]
            req = self.active.get(top[2])
            if req is not None and req.seq == top[1]:
                return top
            heapq.heappop(self._finish)
        return None
