"""Checks of the controller's protocol invariants on its ledger (for tests and debugging).

`violations(ledger)` returns human-readable breaches, empty when all hold: the admission
invariant (INV, hence Eq. 1 for any future step), ready instances host window versions
only (a weight source may finish an in-flight transfer first), every in-flight request sits
on an instance of its own version or one that holds it (so no version with work is left
without weights), at most `versions_per_instance` versions and `max_held` requests (waiting
episodes included, counted exactly) on each instance,
and the derived counters match a recount: every
dispatched group is outstanding, consumed or filtered (exactly one), and the completion
queues hold exactly the complete outstanding groups, each once.
"""

from __future__ import annotations

from collections import Counter

from dorarl.controller.staleness import capacity, window
from dorarl.controller.state import Ledger


def violations(ledger: Ledger) -> list[str]:
    return _admission(ledger) + _instances(ledger) + _requests(ledger) + _counters(ledger)


def _admission(ledger: Ledger) -> list[str]:
    cfg = ledger.config
    bound, problems, below = cfg.effective_K, [], 0
    for w in range(min(ledger.out, default=0), ledger.newest + 1):
        below += ledger.out.get(w, 0)
        cap = capacity(w, bound, ledger.t, cfg.tbs)
        if below > cap:
            problems.append(f"INV: out(<={w})={below} > capacity {cap} at t={ledger.t}")
    if any(w > ledger.newest for w in ledger.out):
        problems.append(f"groups of unpublished versions: {sorted(ledger.out)}")
    return problems


def _instances(ledger: Ledger) -> list[str]:
    allowed = window(ledger.newest, ledger.config.effective_K)
    problems = []
    for inst in ledger.instances:
        # a weight source may finish serving a transfer of a version that just left the
        # window (it holds no request and admission gives that version no room)
        finishing = inst.serving > 0 and not inst.requests
        if inst.ready and inst.version not in allowed and not finishing:
            problems.append(f"instance {inst.instance_id} hosts v{inst.version} outside {allowed}")
        if len(inst.requests) > ledger.max_held:
            problems.append(
                f"instance {inst.instance_id} holds {len(inst.requests)} > {ledger.max_held}"
            )
        waiting = sum(ledger.requests[r].waiting for r in inst.requests if r in ledger.requests)
        if waiting != inst.waiting:
            problems.append(
                f"instance {inst.instance_id} counts {inst.waiting} waiting, not {waiting}"
            )
        held = inst.held_versions
        too_many = len(held) > ledger.config.versions_per_instance
        if too_many or not set(inst.draining) <= set(allowed):
            problems.append(f"instance {inst.instance_id} holds versions {held} (window {allowed})")
    return problems


def _requests(ledger: Ledger) -> list[str]:
    partial = ledger.config.mode == "partial_rollout"
    problems = []
    for rid, req in ledger.requests.items():
        inst = ledger.instances[req.instance_id]
        group = ledger.groups[req.group_id]
        if rid not in inst.requests:
            problems.append(f"request {rid} not on its instance {inst.instance_id}")
        runs_as = inst.version if req.held_as is None else req.held_as
        if not partial and (runs_as != group.version or req.held_as in (inst.version,)):
            problems.append(f"request {rid} of v{group.version} on instance of v{inst.version}")
        if not inst.ready and not req.parked and req.held_as is None:
            problems.append(f"live request {rid} on instance {inst.instance_id} loading weights")
    return problems


def _counters(ledger: Ledger) -> list[str]:
    out = Counter(g.version for g in ledger.groups.values())
    problems = []
    if dict(out) != ledger.out_counts():
        problems.append(f"out counters {ledger.out_counts()} != recount {dict(out)}")
    free: Counter = Counter()
    for inst in ledger.instances:
        if inst.ready:
            free[inst.version] += ledger.free_slots(inst)
    if +free != +Counter(ledger.free):
        problems.append(f"free slots {dict(ledger.free)} != recount {dict(free)}")
    load: Counter = Counter()
    for inst in ledger.instances:
        held = Counter(ledger.requests[r].held_as for r in inst.requests)
        load[inst.version] += held.pop(None, 0)
        if held != Counter(inst.draining):
            problems.append(f"instance {inst.instance_id} draining {inst.draining} != {dict(held)}")
    if +load != +Counter(ledger.requests_on):
        problems.append(f"requests_on {dict(ledger.requests_on)} != recount {dict(load)}")
    for version, buckets in ledger.buckets.items():
        for n, bucket in enumerate(buckets):
            for i in bucket:
                inst = ledger.instances[i]
                if not inst.ready or inst.version != version or ledger.free_slots(inst) != n:
                    problems.append(f"instance {i} filed under v{version} with {n} free slots")
    if ledger.dispatched + ledger.carried - ledger.consumed - ledger.filtered != len(ledger.groups):
        problems.append("dispatched + carried - consumed - filtered != outstanding groups")
    return problems + _queues(ledger)


def _queues(ledger: Ledger) -> list[str]:
    queued = [gid for queue in ledger.done.values() for gid in queue]
    complete = {gid for gid, g in ledger.groups.items() if g.remaining == 0}
    problems = []
    if len(queued) != len(set(queued)) or set(queued) != complete:
        problems.append(
            f"queued groups {sorted(queued)} != complete outstanding {sorted(complete)}"
        )
    if len(queued) != ledger.queued:
        problems.append(f"{len(queued)} groups queued, counters say {ledger.queued}")
    cap = ledger.config.rollout.max_filtered_per_step
    if ledger.filtered_since_publish > cap:
        problems.append(
            f"{ledger.filtered_since_publish} groups filtered at v{ledger.newest} > {cap}"
        )
    return problems
