"""The engine's request table (mixed into `Engine`): new requests checked and queued, the
requests it holds looked up, queued and dropped."""

from __future__ import annotations

import operator
import random
from typing import TYPE_CHECKING

from dorarl.data.routes import unrecorded
from dorarl.engine.config import EngineConfig, SamplingParams
from dorarl.engine.lora import ResidentAdapters
from dorarl.engine.model_spec import ModelSpec
from dorarl.engine.scheduler import Scheduler
from dorarl.engine.sequence import Sequence
from dorarl.engine.stop_strings import Decode, StopText
from dorarl.engine.token_ids import check_prompt, check_vocabulary, checked_token_ids
from dorarl.errors import UserInputError

if TYPE_CHECKING:
    import torch


class RequestIntake:
    """Requests in, each checked first (a bad one raises `UserInputError` and changes
    nothing), and the table of requests the other parts of the engine work on."""

    config: EngineConfig
    spec: ModelSpec
    decode: Decode | None
    version: int
    adapters: ResidentAdapters | None
    scheduler: Scheduler
    _seqs: dict[str, Sequence]
    _detached: dict[str, torch.Tensor]  # imported KV waiting for device blocks
    _seed_rng: random.Random

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        version: int | None = None,
    ) -> None:
        """Queue a request; it runs under `version` from its first token to its last: a
        resident adapter's (`load_adapter`), or None (or the hosted version) the full weights'."""
        params = params or SamplingParams()
        prompt = checked_token_ids(request_id, prompt_ids)
        self._check_new(request_id, prompt, params)
        adapter = self._adapter_version(request_id, version)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(request_id, prompt, params, seed, self._stop_ids(params))
        seq.lora_version = adapter
        seq.stop_text = self._stop_text(params, prompt, [])
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _adapter_version(self, request_id: str, version: int | None) -> int | None:
        """The adapter version a request asks for (None: the full weights), checked resident."""
        if version is None or version == self.version:
            return None
        if self.adapters is None or self.adapters.slot_of(version) is None:
            raise UserInputError(
                f"request {request_id!r}: version {version} is not resident in this engine "
                f"(resident: {self.resident_versions()})"
            )
        return version

    def _version_of(self, seq: Sequence) -> int:
        return self.version if seq.lora_version is None else seq.lora_version

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = self.spec.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        return frozenset(operator.index(t) for t in ids)  # checked by params.validate

    def _stop_text(
        self, params: SamplingParams, before: list[int], turn: list[int]
    ) -> StopText | None:
        if not params.stop_strings or params.target_len is not None:
            return None
        assert self.decode is not None, "checked by _check_new"
        return StopText.open(params.stop_strings, self.decode, before, turn)

    def _check_new(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise UserInputError(
                f"request {request_id!r}: a request with this id is already in the engine"
            )
        params.validate(request_id)
        if params.stop_strings and self.decode is None:
            raise UserInputError(
                f"request {request_id!r}: sampling.stop_strings needs the model's tokenizer "
                "(an engine from a model folder, or Engine(..., decode=...))"
            )
        limit = self.config.max_model_len
        check_prompt(request_id, prompt_ids, limit, self.spec.vocab_size)
        if params.target_len is not None and len(prompt_ids) + params.target_len > limit:
            raise UserInputError(
                f"request {request_id!r}: prompt {len(prompt_ids)} + target_len {params.target_len} tokens "
                f"exceeds max_model_len {limit} (engine.max_model_len)"
            )

    def _check_vocabulary(self, request_id: str, token_ids: list[int], what: str) -> None:
        """Refuse token ids outside the model's vocabulary (`what` names the tokens)."""
        check_vocabulary(request_id, token_ids, self.spec.vocab_size, what)

    def _no_routes(self, tokens: int) -> bytes:
        assert self.spec.moe is not None
        return unrecorded(tokens, self.spec.moe.route_width, self.spec.moe.num_experts)

    def has_unfinished(self) -> bool:
        """Any request in the engine, multi-turn ones waiting for their environment included."""
        return bool(self._seqs)

    def has_runnable(self) -> bool:
        """Any request a step can advance (not waiting for its environment)."""
        return self.scheduler.num_unfinished > 0

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    def progress(self, request_id: str) -> int:
        """Output tokens the request has so far."""
        return self._get(request_id).num_output

    def block_table(self, request_id: str) -> list[int]:
        """The device blocks the request reads now, in order (a copy; empty off the device)."""
        return list(self._get(request_id).block_table)

    def _enqueue(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        if seq.waits_env:
            self.scheduler.park(seq)
        else:
            self.scheduler.add(seq)

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._detached.pop(seq.request_id, None)
        del self._seqs[seq.request_id]

    def _get(self, request_id: str) -> Sequence:
        if request_id not in self._seqs:
            raise UserInputError(f"request {request_id!r} is not in this engine")
        return self._seqs[request_id]
