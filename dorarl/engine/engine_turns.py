"""The engine's multi-turn requests (mixed into `Engine`): a request waiting for its
environment continues with an observation, opens a new segment, or ends."""

from __future__ import annotations

from dorarl.data.samples import SegmentStart
from dorarl.engine.config import EngineConfig
from dorarl.engine.engine_step import output_of
from dorarl.engine.model_spec import ModelSpec
from dorarl.engine.outputs import EarlierSegments, RequestOutput
from dorarl.engine.scheduler import Scheduler
from dorarl.engine.sequence import Sequence, next_segment_seed
from dorarl.engine.token_ids import checked_token_ids, segment_prompt
from dorarl.errors import UserInputError


class Turns:
    """Between steps, the turns of a multi-turn request: each observation appended on the
    KV the request kept (its history is not prefilled again), or a fresh segment opened."""

    config: EngineConfig
    spec: ModelSpec
    scheduler: Scheduler
    record_routes: bool
    _seqs: dict[str, Sequence]

    def continue_request(self, request_id: str, observation_ids: list[int]) -> bool:
        """Append an environment's observation to a request waiting for it and open its next
        turn on the KV it kept. False (nothing changed) when the observation would leave no
        room for a sampled token under max_model_len: the caller ends the episode."""
        seq = self._waiting(request_id)
        obs = checked_token_ids(request_id, observation_ids, "observation_ids")
        self._check_vocabulary(request_id, obs, "observation ")
        room = self.config.max_model_len - seq.num_tokens - len(obs)
        if room < (seq.params.target_len or 1):
            return False
        seq.observe(obs, self._version_of(seq))
        if self.record_routes:
            seq.routes += self._no_routes(len(obs))
        self.scheduler.unpark(seq)
        return True

    def start_segment(self, request_id: str, prompt_ids: list[int]) -> bool:
        """Open a new segment of a request waiting for its environment: `prompt_ids` is a
        fresh context (an agent's call that does not extend its conversation), its KV
        computed from scratch (or the prefix cache) under the request's version; the
        request's KV so far is freed and its tokens stay in its output, the new prompt
        observed there. False (nothing changed) when the prompt leaves no room for a
        sampled token under max_model_len: the caller ends the episode."""
        seq = self._waiting(request_id)
        needs = seq.params.target_len or 1
        prompt = segment_prompt(
            request_id, prompt_ids, self.spec.vocab_size, self.config.max_model_len, needs
        )
        if prompt is None:
            return False
        fresh = Sequence(
            request_id, prompt, seq.params, next_segment_seed(seq.seed), seq.stop_ids,
            migrations=seq.migrations, offloads=seq.offloads,
            reprefill_tokens=seq.reprefill_tokens,
            earlier=self._earlier(seq, prompt),
        )  # fmt: skip
        fresh.lora_version = seq.lora_version
        fresh.stop_text = self._stop_text(seq.params, prompt, [])
        self._drop(seq)
        self._seqs[request_id] = fresh
        self.scheduler.add(fresh)
        return True

    def _earlier(self, seq: Sequence, prompt: list[int]) -> EarlierSegments:
        """`seq`'s segments, its own included, with `prompt` opening the next one."""
        e = seq.earlier or EarlierSegments(list(seq.prompt_ids), [], [], [], [], b"", [])
        routes = self._no_routes(len(prompt)) if self.record_routes else b""
        return EarlierSegments(
            e.prompt_ids,
            e.output_ids + seq.output_ids + prompt,
            e.logprobs + seq.logprobs + [0.0] * len(prompt),
            e.versions + seq.versions + [self._version_of(seq)] * len(prompt),
            e.observed + seq.observed + [True] * len(prompt),
            e.routes + bytes(seq.routes) + routes,
            [*e.starts, SegmentStart(len(e.output_ids) + seq.num_output, len(prompt))],
        )

    def end_request(self, request_id: str) -> RequestOutput:
        """End a request waiting for its environment (the episode is done): its output,
        every turn and observation in it, and its blocks back to the pools."""
        seq = self._waiting(request_id)
        self._drop(seq)
        return output_of(seq)

    def _waiting(self, request_id: str) -> Sequence:
        seq = self._get(request_id)
        if not seq.waits_env:
            raise UserInputError(f"request {request_id!r} is not waiting for an observation")
        return seq
