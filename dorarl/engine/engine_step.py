"""The engine's step (mixed into `Engine`): schedule, move KV, run the batch, postprocess
its sampled tokens into requests and finished outputs."""

from __future__ import annotations

import torch

from dorarl.engine.config import EngineConfig
from dorarl.engine.device_runner import DeviceRunner
from dorarl.engine.kv_cache import KVCache
from dorarl.engine.lora import BASE_SLOT, ResidentAdapters
from dorarl.engine.model_runner import ModelRunner
from dorarl.engine.outputs import RequestOutput, StepWork, with_earlier
from dorarl.engine.scheduler import Batch, Restore, Scheduler
from dorarl.engine.sequence import KVPlace, Sequence


class Stepping:
    """One step over the running requests, and a request's KV moved to host memory between
    steps; the step's work is counted in `_counters` and described in `last_step`."""

    config: EngineConfig
    kv: KVCache
    scheduler: Scheduler
    adapters: ResidentAdapters | None
    runner: ModelRunner | DeviceRunner
    record_routes: bool
    last_step: StepWork
    _seqs: dict[str, Sequence]
    _detached: dict[str, torch.Tensor]
    _counters: dict[str, int]

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule, move KV, forward + sample, postprocess. Returns finished
        requests; `last_step` then says what it computed."""
        batch = self.scheduler.schedule()
        assert not (batch.empty and self.scheduler.num_unfinished), (
            "scheduler stalled with unfinished requests"
        )
        self._move_kv(batch)
        versions = self._begin_adapters(batch) if self.adapters is not None else 1
        sampled = self.runner.run(batch) if batch.decode or batch.prefill else []
        self._counters["steps"] += 1
        finished = self._postprocess(batch, sampled)
        prefill = sum(n for _, n in batch.prefill)
        self._counters["prefill_tokens"] += prefill
        self._counters["prefill_saved_tokens"] += batch.saved_tokens
        self.last_step = StepWork(
            rows=len(batch.decode) + len(batch.prefill),
            decode_tokens=len(batch.decode),
            prefill_tokens=prefill,
            resident_tokens=sum(seq.num_computed for seq in self.scheduler.running),
            saved_tokens=batch.saved_tokens,
            versions=versions,
        )
        return finished

    def _begin_adapters(self, batch: Batch) -> int:
        """Each row's adapter slot for the step's products, from the sequences it runs;
        returns how many versions the step runs."""
        assert self.adapters is not None
        items = batch.items
        slots = [self._slot_of(seq) for seq, _ in items]
        self.adapters.begin_step(slots, [n for _, n in items])
        if len(set(slots)) > 1:
            self._counters["multi_version_steps"] += 1
        return max(1, len(set(slots)))

    def _slot_of(self, seq: Sequence) -> int:
        if seq.lora_version is None:
            return BASE_SLOT
        assert self.adapters is not None
        slot = self.adapters.slot_of(seq.lora_version)
        assert slot is not None, "unload_version refuses versions with requests"
        return slot

    def _move_kv(self, batch: Batch) -> None:
        # Offloads first: a restore or a copy may reuse device blocks an offload just vacated.
        for off in batch.offloads:
            self.kv.offload(off.device_blocks, off.host_blocks)
        for res in batch.restores:
            self._restore(res)
        if batch.copies:
            self.kv.copy_blocks([c.src for c in batch.copies], [c.dst for c in batch.copies])
            self.scheduler.copied(batch)
        self._counters["offloads"] += len(batch.offloads)
        self._counters["restores"] += sum(r.source is KVPlace.HOST for r in batch.restores)
        self._counters["preemptions"] += len(batch.preempted)

    def _restore(self, res: Restore) -> None:
        """A sequence's KV back into the pool, but for its first `skip` blocks, which it
        reads from the prefix cache instead."""
        kv = self._detached.pop(res.seq.request_id, None)
        if not res.device_blocks:
            return
        if res.source is KVPlace.HOST:
            self.kv.restore(res.host_blocks[res.skip :], res.device_blocks)
        else:
            assert kv is not None, f"request {res.seq.request_id!r}: no imported KV to restore"
            self.kv.load(kv[:, :, :, res.skip * self.config.block_size :], res.device_blocks)

    def _postprocess(
        self, batch: Batch, sampled: list[tuple[Sequence, int, float]]
    ) -> list[RequestOutput]:
        self.scheduler.computed(batch)
        finished = []
        routes = self.runner.last_routes if self.record_routes else None
        for row, (seq, token, logprob) in enumerate(sampled):
            seq.append(token, logprob, self._version_of(seq), self.config.max_model_len)
            if routes is not None:
                seq.routes += routes[row].numpy().tobytes()
            if seq.finished and seq.params.multi_turn:
                self.scheduler.park(seq)  # a turn ended: the caller continues or ends it
                finished.append(output_of(seq))
            elif seq.finished:
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
                finished.append(output_of(seq))
        self._counters["tokens"] += len(sampled)
        return finished

    def offload(self, request_id: str) -> bool:
        """Move a running (or waiting-for-env) request's KV to the host pool now; False if
        its KV is not on the device or the host pool lacks room. It is restored when the scheduler readmits it."""
        seq = self._get(request_id)
        batch = Batch()
        if not self.scheduler.offload(seq, batch):
            return False
        self._move_kv(batch)
        return True


def output_of(seq: Sequence) -> RequestOutput:
    """A request's output as it stands: every segment, turn and observation in it."""
    out = RequestOutput(
        request_id=seq.request_id,
        prompt_ids=list(seq.prompt_ids),
        output_ids=seq.output_ids,
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        finish_reason=seq.finish_reason or "length",
        migrations=seq.migrations,
        offloads=seq.offloads,
        reprefill_tokens=seq.reprefill_tokens,
        observed=list(seq.observed),
        turn_start=seq.turn_start,
        waits_env=seq.waits_env,
        stop_string=seq.stop_string,
        routes=bytes(seq.routes),
    )
    return out if seq.earlier is None else with_earlier(out, seq.earlier)
