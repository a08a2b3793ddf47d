"""What the engines are asked to sample and what comes back: requests in, scored samples out.

`RolloutSettings` are the sampling knobs of a run; `RolloutPlan` turns the driver's
request specs into engine requests (prompt tokens from the task, the request's own seed,
its forced length) and finished engine outputs into `Sample`s with their reward. A reward
function that raises scores 0 and is counted (`reward_errors`), never stopping the run.
With a reward model (`reward_model`), a finished sample is held until the model's score
is mixed into its reward (`finished`, then `rescored`), the engines going on meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dorarl.data import Sample
from dorarl.data.lengths import LengthDist
from dorarl.driver import RequestSpec
from dorarl.engine import RequestOutput, SamplingParams
from dorarl.runtime.episodes import Episodes
from dorarl.runtime.reward_scoring import RewardModelScoring
from dorarl.runtime.workers.engine_worker import NewRequest
from dorarl.tasks import Prompt, Task
from dorarl.tasks.episodes import EpisodeState
from dorarl.tasks.scoring import score_all
from dorarl.tasks.user_rewards import Scored


@dataclass
class RolloutSettings:
    """What the runtime needs beyond the controller: sampling and the seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)  # a chat environment's, e.g. </tool_call>
    seed: int = 0
    forced_lengths: LengthDist | None = None  # benchmarks: target lengths, EOS ignored


class RolloutPlan:
    def __init__(self, task: Task, settings: RolloutSettings) -> None:
        self.task, self.settings = task, settings
        self.prompts: list[Prompt] = task.train_prompts()
        self.reward_errors = 0
        # A multi-turn task: each request is an episode, its reward the environment's.
        self.episodes = Episodes(task) if getattr(task, "multi_turn", False) else None
        self.reward_model: RewardModelScoring | None = None  # set by a run with one
        self._by_id = {p.prompt_id: p for p in self.prompts}

    @property
    def env_errors(self) -> int:
        return self.episodes.env_errors if self.episodes is not None else 0

    @property
    def episode_counts(self) -> dict[str, int]:
        """Episode sources' counts (an agent's refused calls, its context overflows)."""
        return dict(self.episodes.counts) if self.episodes is not None else {}

    def prompt(self, prompt_index: int) -> Prompt:
        return self.prompts[prompt_index % len(self.prompts)]

    def requests(
        self, specs: Sequence[RequestSpec], versions: Sequence[int | None]
    ) -> list[NewRequest]:
        """The engine requests of a single-turn task's `specs`, each under its own version
        or the one given."""
        return [
            self.request(spec, list(self.prompt(spec.prompt_index).prompt_ids), version)
            for spec, version in zip(specs, versions, strict=True)
        ]

    def request(self, spec: RequestSpec, prompt_ids: list[int], version: int | None) -> NewRequest:
        """The engine request of `spec` from its first prompt (an episode's: its reset's)."""
        v = spec.version if version is None else version
        return NewRequest(spec.request_id, prompt_ids, self._params(spec), v)

    def begin_episodes(self, specs: Sequence[RequestSpec]) -> None:
        """Reset an episode for each of `specs`; each first prompt comes back through
        `episodes.ready`."""
        assert self.episodes is not None, "episodes of a single-turn task"
        self.episodes.begin([(s.request_id, self.prompt(s.prompt_index)) for s in specs])

    def _params(self, spec: RequestSpec) -> SamplingParams:
        s = self.settings
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=max(s.max_new_tokens, spec.target_len or 0),
            stop_token_ids=list(s.stop_token_ids),
            stop_strings=list(s.stop_strings),
            seed=spec.seed,
            target_len=spec.target_len,
            multi_turn=self.episodes is not None,
        )

    def samples(self, finished: Sequence[tuple[RequestSpec, RequestOutput]]) -> list[Sample]:
        """Single-turn outputs as samples, scored together (users' rewards each bounded by
        `task.reward_timeout_s`)."""
        responses = [(self.prompt(spec.prompt_index), out.output_ids) for spec, out in finished]
        scored = score_all(self.task, responses)
        self.reward_errors += sum(s.error is not None for s in scored)
        return [self._sample(spec, out, s) for (spec, out), s in zip(finished, scored, strict=True)]

    def finished(self, instance_id: int, samples: list[Sample]) -> list[tuple[int, Sample]]:
        """The samples (finished on `instance_id`) to hand the driver now: all of them, or
        with a reward model none (each comes back from `rescored` with its score)."""
        if self.reward_model is None:
            return [(instance_id, s) for s in samples]
        self.reward_model.submit(instance_id, samples)
        return []

    def rescored(self) -> list[tuple[int, Sample]]:
        """Samples the reward model scored since the last call, with their instance."""
        if self.reward_model is None:
            return []
        before = self.reward_model.errors
        done = self.reward_model.ready()
        self.reward_errors += self.reward_model.errors - before
        return done

    @property
    def scoring(self) -> int:
        """Samples held for the reward model's score."""
        return 0 if self.reward_model is None else self.reward_model.pending

    def reward_texts(self, sample: Sample) -> tuple[str, str]:
        """What the reward model reads of `sample`: its prompt's text and its response's
        (up to its stop token)."""
        return self._by_id[sample.prompt_id].text, self.task.response_text(sample.response_ids)

    def sample(
        self, spec: RequestSpec, out: RequestOutput, episode: EpisodeState | None = None
    ) -> Sample:
        if episode is None:
            return self.samples([(spec, out)])[0]
        return self._sample(spec, out, Scored(episode.reward, episode.error), episode)

    def _sample(
        self,
        spec: RequestSpec,
        out: RequestOutput,
        scored: Scored,
        episode: EpisodeState | None = None,
    ) -> Sample:
        prompt = self.prompt(spec.prompt_index)
        return Sample(
            group_id=spec.group_id,
            sample_index=spec.sample_index,
            prompt_id=prompt.prompt_id,
            prompt_ids=list(out.prompt_ids),
            response_ids=list(out.output_ids),
            logprobs=list(out.logprobs),
            versions=list(out.versions),
            finish_reason=out.finish_reason,
            reward=scored.reward,
            reward_error=scored.error,
            reward_parts=scored.parts,
            reward_info=scored.info,
            migrations=out.migrations,
            offloads=out.offloads,
            observed=list(out.observed) if episode is not None else [],
            turns=list(episode.turns) if episode is not None else [],
            routes=out.routes,
            segments=list(out.segments),
        )
