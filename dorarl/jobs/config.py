"""`TrainConfig`: the root configuration of `dorarl train`, one section per component.

The main knobs sit at the top level (mode, K, runtime, steps, instances, rbs, tbs,
group_size, seed); components keep their own dataclasses (engine, trainer, ray, weights) as
sections. Settings only: a simple bound is declared on its field (`metadata` ge, gt, le, lt,
checked by the loader: dorarl.config.fields), `validate()` checks the keys' relations, and
nothing here reads a file or builds a runtime object (the checkpoint `resume=` names is read
by `dorarl.jobs.train`, the placement and the weight transport are the runtime's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from dorarl.config import ConfigError, Problems, check_fields
from dorarl.controller import ControllerConfig, Mode, OrchestratorConfig, RolloutConfig
from dorarl.data.lengths import LengthDist
from dorarl.engine import EngineConfig
from dorarl.engine.config import ADAPTED_PROJECTIONS
from dorarl.jobs.resume import ResumePoint
from dorarl.jobs.task_config import TaskSection
from dorarl.runtime.ray_config import RayConfig
from dorarl.runtime.transfer.weights_config import WeightsConfig
from dorarl.trainer import LossConfig, TrainerConfig


@dataclass(kw_only=True)
class SamplingSection:
    temperature: float = field(
        default=1.0, metadata={"help": "rollout sampling temperature (> 0 for RL)", "gt": 0}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "nucleus sampling (1: off)", "gt": 0, "le": 1}
    )
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0: off)", "ge": 0})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "response cap (None: the task's own)"}
    )
    warn_truncated: float = field(
        default=0.2,
        metadata={
            "help": "warn when more than this share of a step's responses were cut by a "
            "length limit (engine.max_model_len or the response cap), naming the key to "
            "raise; again only when it gets worse by 0.1 (1: never)",
            "ge": 0,
            "le": 1,
        },
    )


@dataclass(kw_only=True)
class ForcedLengthsSection:
    """Benchmarks and tests: force response lengths (ignore EOS) from a long-tailed lognormal."""

    enabled: bool = field(default=False, metadata={"help": "force response lengths"})
    median: float = field(default=16.0, metadata={"help": "median forced length (tokens)", "ge": 1})
    p99_ratio: float = field(
        default=10.0, metadata={"help": "p99 / median of forced lengths", "ge": 1}
    )
    max_len: int = field(default=200, metadata={"help": "longest forced length", "ge": 1})
    group_corr: float = field(
        default=0.5, metadata={"help": "share of log-variance per group", "ge": 0, "le": 1}
    )

    def dist(self, prompt_len: int = 16) -> LengthDist:
        return LengthDist(
            median=self.median,
            p99_ratio=self.p99_ratio,
            max_len=self.max_len,
            group_corr=self.group_corr,
            prompt_len=prompt_len,
        )


@dataclass(kw_only=True)
class EvalSection:
    every: int | Literal["off"] = field(
        default=10,
        metadata={
            "help": "evaluate every N versions (0: first/last; off: none, and no evaluator "
            "actor is started)",
            "ge": 0,
        },
    )
    max_prompts: int = field(
        default=200, metadata={"help": "held-out prompts per evaluation", "ge": 1}
    )
    samples: int = field(
        default=0,
        metadata={
            "help": "k responses per held-out prompt sampled at the run's sampling settings, "
            "for mean@k and pass@k beside greedy accuracy (0: greedy only)",
            "ge": 0,
        },
    )
    timeout_s: float = field(
        default=1800.0,
        metadata={
            "help": "seconds the run's end waits for its evaluations; one not finished by "
            "then is left out with a warning",
            "gt": 0,
        },
    )


@dataclass(kw_only=True)
class RecordSection:
    text: bool = field(
        default=False,
        metadata={"help": "write prompt, answer and response text to trajectories.jsonl"},
    )


def _default_engine() -> EngineConfig:
    return EngineConfig(max_num_seqs=64, max_model_len=256, block_size=16)


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(lr=None, loss=LossConfig())  # the learning rate follows the model


@dataclass(kw_only=True)
class TrainConfig:
    mode: Mode = field(
        default="dora", metadata={"help": "sync | one_step_off | partial_rollout | dora"}
    )
    K: int = field(default=1, metadata={"help": "staleness bound (dora, partial_rollout)", "ge": 0})
    runtime: Literal["ray", "sim"] = field(default="ray", metadata={"help": "ray | sim"})
    steps: int = field(
        default=60,
        metadata={"help": "training steps (a resumed run ends at this version)", "ge": 1},
    )
    instances: int = field(default=2, metadata={"help": "rollout instances", "ge": 1})
    rbs: int = field(default=24, metadata={"help": "groups outstanding (dispatched, not consumed)"})
    tbs: int = field(default=16, metadata={"help": "groups per training step", "ge": 1})
    group_size: int = field(default=8, metadata={"help": "responses per prompt (G)", "ge": 1})
    seed: int = field(default=0, metadata={"help": "seed of data order, sampling and init"})
    model: str | None = field(
        default=None,
        metadata={"help": "HF model folder (None: the shipped base model)", "path": True},
    )
    checkpoint_every: int | Literal["off"] = field(
        default=20,
        metadata={
            "help": "checkpoint every N versions and at the end (0: at the end only; off: "
            "none, and a stopped or failed run cannot be resumed)",
            "ge": 0,
        },
    )
    checkpoint_keep: int = field(
        default=3,
        metadata={
            "help": "newest checkpoints kept in the run folder (0: all); only the newest keeps "
            "its optimizer state (twice the weights in float32), the one a resume reads",
            "ge": 0,
        },
    )
    checkpoint_timeout_s: float = field(
        default=1800.0,
        metadata={
            "help": "seconds the run's end waits for its checkpoint writes before it fails "
            "naming the newest checkpoint written",
            "gt": 0,
        },
    )
    stop_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds a stop (Ctrl-C) waits for the requests in flight to finish; "
            "groups still sampling then are dropped and sampled again on resume",
            "gt": 0,
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "checkpoint folder, or run folder (its newest), to continue from",
            "path": True,
        },
    )
    wandb: bool = field(default=False, metadata={"help": "also log to Weights & Biases"})
    progress: bool = field(default=True, metadata={"help": "live progress display"})
    task: TaskSection = field(default_factory=TaskSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    forced_lengths: ForcedLengthsSection = field(default_factory=ForcedLengthsSection)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalSection = field(default_factory=EvalSection)
    record: RecordSection = field(default_factory=RecordSection)
    ray: RayConfig = field(default_factory=RayConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    engine: EngineConfig = field(default_factory=_default_engine)
    trainer: TrainerConfig = field(default_factory=_default_trainer)

    # The trainer divides logits by the temperature the engines sampled at, or its ratios
    # would not be 1 on fresh data: one setting, sampling.temperature, gives both.
    # The cap that soft overlong punishment ends at is the engines' cap, by the same rule.
    DERIVED_KEYS: ClassVar[dict[str, str]] = {
        "trainer.temperature": "sampling.temperature",
        "trainer.loss.response_cap": "sampling.max_new_tokens",
        "trainer.run_steps": "steps",
        "trainer.loss.mask_truncated": "trainer.loss.overlong",  # its old name, for old runs
    }

    def __post_init__(self) -> None:
        self.trainer.temperature = self.sampling.temperature
        self.trainer.loss.response_cap = self.sampling.max_new_tokens
        self.trainer.run_steps = self.steps

    def validate(self) -> None:
        """Every check between keys; ConfigError naming the key, one line per problem found
        (several: `ManyProblems`)."""
        problems = Problems()
        problems.check(check_fields, self)  # the loader checked what it read; code, here
        for key, device in (
            ("engine.device", self.engine.device),
            ("trainer.device", self.trainer.device),
        ):
            problems.check(_check_device, key, device)
        if not problems:  # the transport follows the devices
            problems.check(self.weights.resolve, self.engine.device, self.trainer.device)
        problems.check(self.controller_config(None).validate)
        for check in (
            self._check_resume,
            self._check_task,
            self._check_overlong,
            self._check_norm_length,
            self._check_adapters,
            self._check_routes,
            self._check_lengths,
            self._check_schedule,
        ):
            problems.check(check)
        problems.raise_any()

    def _check_resume(self) -> None:
        if self.resume and self.runtime != "ray":
            raise ConfigError("resume: only runtime=ray resumes (the sim runtime holds no weights)")

    def _check_task(self) -> None:
        if self.task.name == "jsonl" and not self.task.path:
            raise ConfigError("task.path: the jsonl task needs a data file")

    def _check_routes(self) -> None:
        if self.trainer.moe.route_replay and not self.engine.record_routes:
            raise ConfigError(
                "trainer.moe.route_replay: needs engine.record_routes=true (the engines record "
                "the routes it replays)"
            )

    def _check_lengths(self) -> None:
        """Forced lengths that leave no room for a prompt in the engines' context (the
        response cap is checked before a run, once the context follows the model:
        `check_response_cap`)."""
        limit = self.engine.max_model_len
        if self.forced_lengths.enabled and self.forced_lengths.max_len >= limit:
            raise ConfigError(
                f"forced_lengths.max_len: {self.forced_lengths.max_len} leaves no room for the "
                f"prompt under engine.max_model_len={limit}"
            )

    def check_response_cap(self) -> None:
        """A response cap that leaves no room for a prompt in the engines' context."""
        cap, limit = self.sampling.max_new_tokens, self.engine.max_model_len
        if cap is not None and cap >= limit:
            raise ConfigError(
                f"sampling.max_new_tokens: {cap} leaves no room for the prompt under "
                f"engine.max_model_len={limit}; raise engine.max_model_len or lower the cap"
            )

    @property
    def adapter_versions(self) -> bool:
        """A LoRA run whose engines hold adapters: each version travels and is served as its
        adapter over the base (docs/training.md)."""
        return self.trainer.lora.enabled and self.engine.max_versions > 1

    def _check_adapters(self) -> None:
        """What an engine's adapter slot takes, refused before anything starts."""
        if not self.adapter_versions:
            return
        lora = self.trainer.lora
        if lora.rank > self.engine.max_lora_rank:
            raise ConfigError(
                f"trainer.lora.rank: {lora.rank} is over engine.max_lora_rank="
                f"{self.engine.max_lora_rank} (with engine.max_versions > 1 each version is an "
                "adapter in an engine slot of that rank)"
            )
        targets = set(lora.target_modules) - {"all-linear"}
        unknown = sorted(targets - ADAPTED_PROJECTIONS)
        if unknown:
            raise ConfigError(
                f"trainer.lora.target_modules: the engines hold adapters of "
                f"{'|'.join(sorted(ADAPTED_PROJECTIONS))} only, not {', '.join(unknown)} "
                "(or engine.max_versions=1: merged full weights)"
            )

    def _check_schedule(self) -> None:
        """The decay's horizon against warmup, once it follows `steps`."""
        try:
            self.trainer.check_schedule()
        except ConfigError as exc:
            raise ConfigError(f"trainer.{exc}") from None

    def _check_overlong(self) -> None:
        loss = self.trainer.loss
        if loss.overlong != "soft":
            return
        if self.sampling.max_new_tokens is None:
            raise ConfigError(
                "trainer.loss.overlong: soft needs sampling.max_new_tokens, the cap its "
                "penalty ends at"
            )
        try:
            loss.validate()
        except ConfigError as exc:
            raise ConfigError(f"trainer.loss.{exc}") from None

    def _check_norm_length(self) -> None:
        loss = self.trainer.loss
        unset = loss.norm_length is None and self.sampling.max_new_tokens is None
        if loss.aggregation == "seq_sum_norm" and unset:
            raise ConfigError(
                "trainer.loss.norm_length: aggregation=seq_sum_norm needs it, or "
                "sampling.max_new_tokens (the cap it defaults to)"
            )

    def controller_config(self, point: ResumePoint | None) -> ControllerConfig:
        """The controller's view, starting where `point` (the checkpoint a run resumes, None:
        a fresh run) left off: its knobs carry the names they have here (K, steps, instances,
        rbs, tbs, group_size, orchestrator.*, rollout.*), so its errors name the keys a user
        typed."""
        return ControllerConfig(
            mode=self.mode,
            K=self.K,
            rbs=self.rbs,
            tbs=self.tbs,
            group_size=self.group_size,
            instances=self.instances,
            slots=self.engine.max_num_seqs,
            versions_per_instance=self.versions_per_instance,
            steps=self.steps,
            orchestrator=self.engine_orchestrator(),
            rollout=self.rollout,
            **(point.controller_keys() if point else {}),
        )

    def engine_orchestrator(self) -> OrchestratorConfig:
        """`orchestrator.*` as the engines can carry it out: engines that serve no weights
        get every load from the trainer, and ones that offload no KV are relieved by
        migration only (vLLM preempts under pressure on its own)."""
        can = self.engine.capabilities
        return self.orchestrator.within(can.serves_weights, can.offload)

    @property
    def versions_per_instance(self) -> int:
        """Versions one engine serves at once: in a dora run whose engines hold adapters,
        its `engine.max_versions - 1` adapter slots (the base serves version 0 beside them)
        when they hold the K+1 versions a window spans; else one, the adapters then
        travelling and being swapped one version at a time."""
        slots = self.engine.max_versions - 1
        k = ControllerConfig(mode=self.mode, K=self.K).effective_K
        several = self.adapter_versions and self.mode == "dora" and slots >= k + 1
        return slots if several else 1


def _check_device(key: str, device: str) -> None:
    """cpu, or cuda: Ray gives each actor its GPU share and makes that GPU the only one it
    sees, so a cuda:N other than 0 would name a device the actor cannot see. Whether the
    cluster has GPUs is checked when the actors are placed (`dorarl.runtime.placement`)."""
    if device not in ("cpu", "cuda", "cuda:0"):
        raise ConfigError(
            f"{key}: use cpu or cuda (Ray assigns each actor its GPU), got {device!r}"
        )
