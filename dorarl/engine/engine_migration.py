"""Requests leaving and joining the engine (mixed into `Engine`): export with KV, import of
a same-version snapshot, resume from tokens under any version, abort."""

from __future__ import annotations

import torch

from dorarl.data.routes import route_bytes
from dorarl.engine.config import EngineConfig
from dorarl.engine.kv_cache import KVCache
from dorarl.engine.lora import ResidentAdapters
from dorarl.engine.model_spec import ModelSpec
from dorarl.engine.outputs import RequestSnapshot
from dorarl.engine.sequence import KVPlace, Sequence
from dorarl.engine.token_ids import check_snapshot, checked_token_ids
from dorarl.errors import UserInputError


class Migration:
    """A request's full state out as a `RequestSnapshot` and back in: with its KV between
    engines of its version (no re-prefill), from its tokens alone under any version."""

    config: EngineConfig
    spec: ModelSpec
    version: int
    kv: KVCache
    adapters: ResidentAdapters | None
    record_routes: bool
    _detached: dict[str, torch.Tensor]
    _counters: dict[str, int]

    def export_request(self, request_id: str, to_host: bool = True) -> RequestSnapshot:
        """Remove a request and return its full state with its KV (no re-prefill needed):
        on the CPU, or with `to_host=False` KV in the device pool stays on the device."""
        seq = self._get(request_id)
        kv = self._export_kv(seq, to_host)
        snap = snapshot_of(seq, self._version_of(seq), kv)
        self._drop(seq)
        self._counters["migrations_out"] += 1
        return snap

    def _export_kv(self, seq: Sequence, to_host: bool) -> torch.Tensor | None:
        if seq.num_computed == 0:
            return None
        if seq.kv_place is KVPlace.DEVICE:
            return self.kv.export(seq.block_table, seq.num_computed, to_host)
        if seq.kv_place is KVPlace.HOST:
            return self.kv.export_host(seq.host_table, seq.num_computed)
        detached = self._detached[seq.request_id]  # on the device if it came device to device
        return self.kv.host_copy(detached) if to_host else detached

    def import_request(self, snap: RequestSnapshot) -> None:
        """Continue a request exported by an engine of the same version (its full weights or
        a resident adapter), reusing its KV."""
        resident = self.adapters is not None and self.adapters.slot_of(snap.version) is not None
        if snap.version != self.version and not resident:
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot of version {snap.version} cannot be imported into an "
                f"engine of version {self.version} (its KV belongs to other weights; use resume_request)"
            )
        self._check_snapshot_kv(snap)
        seq = self._sequence_from(snap)
        seq.lora_version = None if snap.version == self.version else snap.version
        seq.migrations += 1
        snap.migrations = seq.migrations
        if snap.kv is not None and snap.num_computed > 0:
            seq.num_computed = snap.num_computed
            seq.kv_place = KVPlace.DETACHED
            seq.kv_version = None if snap.kv_mixed else snap.version
            self._detached[seq.request_id] = snap.kv
        self._enqueue(seq)
        self._counters["migrations_in"] += 1

    def resume_request(self, snap: RequestSnapshot, version: int | None = None) -> None:
        """Continue a request from its tokens by re-prefill, under this engine's version or
        the resident adapter `version`.

        Earlier tokens keep their versions and logprobs (partial rollout); new ones get
        the version it continues under."""
        adapter = self._adapter_version(snap.request_id, version)
        seq = self._sequence_from(snap)
        seq.lora_version = adapter
        seq.reprefill_tokens += max(0, seq.num_tokens - 1)
        self._enqueue(seq)

    def abort(self, request_id: str) -> RequestSnapshot:
        """Interrupt a request; returns its tokens-only snapshot (KV dropped)."""
        seq = self._get(request_id)
        snap = snapshot_of(seq, self._version_of(seq), None)
        self._drop(seq)
        return snap

    def _sequence_from(self, snap: RequestSnapshot) -> Sequence:
        prompt_ids = checked_token_ids(snap.request_id, snap.prompt_ids)
        output_ids = checked_token_ids(snap.request_id, snap.output_ids, "output_ids")
        self._check_new(snap.request_id, prompt_ids, snap.params)
        check_snapshot(snap, self.config.max_model_len)
        seq = Sequence(
            snap.request_id, prompt_ids, snap.params, snap.seed, frozenset(snap.stop_token_ids),
            token_ids=prompt_ids + output_ids, logprobs=list(snap.logprobs),
            versions=list(snap.versions), migrations=snap.migrations, offloads=snap.offloads,
            reprefill_tokens=snap.reprefill_tokens,
            observed=list(snap.observed) or [False] * len(output_ids),
            turn_start=snap.turn_start, waits_env=snap.waits_env,
            routes=bytearray(self._snapshot_routes(snap)), earlier=snap.earlier,
        )  # fmt: skip
        if seq.waits_env:
            seq.finish_reason, seq.stop_string = snap.turn_reason, snap.turn_stop_string
        opened = seq.num_prompt + seq.turn_start
        seq.stop_text = self._stop_text(snap.params, seq.token_ids[:opened], seq.token_ids[opened:])
        return seq

    def _snapshot_routes(self, snap: RequestSnapshot) -> bytes:
        """The snapshot's routes, one per output token, or none where this engine records
        none; tokens sampled by an engine that did not record get 'no route'."""
        if not self.record_routes:
            return b""
        assert self.spec.moe is not None
        tokens, m = len(snap.output_ids), self.spec.moe
        if not snap.routes:
            return self._no_routes(tokens)
        if len(snap.routes) != route_bytes(tokens, m.route_width, m.num_experts):
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot routes hold {len(snap.routes)} bytes, "
                f"{tokens} output tokens of this model take "
                f"{route_bytes(tokens, m.route_width, m.num_experts)}"
            )
        return snap.routes

    def _check_snapshot_kv(self, snap: RequestSnapshot) -> None:
        if snap.kv is None:
            return
        s = self.spec
        expected = (2, s.num_layers, s.num_kv_heads, snap.num_computed, s.head_dim)
        if tuple(snap.kv.shape) != expected:
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot KV has shape {tuple(snap.kv.shape)}, "
                f"this engine expects {expected}"
            )
        if snap.num_computed >= snap.num_tokens:
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot KV covers more tokens than it holds"
            )


def snapshot_of(seq: Sequence, version: int, kv: torch.Tensor | None) -> RequestSnapshot:
    """A request's full state under `version`, with `kv` (None: tokens only)."""
    return RequestSnapshot(
        request_id=seq.request_id,
        prompt_ids=list(seq.prompt_ids),
        output_ids=seq.output_ids,
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        params=seq.params,
        seed=seq.seed,
        version=version,
        num_computed=seq.num_computed if kv is not None else 0,
        kv=kv,
        migrations=seq.migrations,
        offloads=seq.offloads,
        reprefill_tokens=seq.reprefill_tokens,
        stop_token_ids=sorted(seq.stop_ids),
        observed=list(seq.observed),
        turn_start=seq.turn_start,
        waits_env=seq.waits_env,
        turn_reason=seq.finish_reason if seq.waits_env else None,
        kv_mixed=kv is not None and seq.kv_version is None,  # None once a weight load came
        turn_stop_string=seq.stop_string if seq.waits_env else None,
        routes=bytes(seq.routes),
        earlier=seq.earlier,
    )
