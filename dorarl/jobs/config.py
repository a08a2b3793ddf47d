"""`TrainConfig`: the root configuration of `dorarl train`, one section per component.

The main knobs sit at the top level (mode, K, runtime, steps, instances, rbs, tbs,
group_size, seed); components keep their own dataclasses (engine, trainer) as sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from dorarl.config import ConfigError
from dorarl.controller import ControllerConfig, Mode, OrchestratorConfig, RolloutConfig
from dorarl.data.lengths import LengthDist
from dorarl.engine import EngineConfig
from dorarl.errors import RunComplete
from dorarl.jobs.resume import ResumePoint, read_resume_point
from dorarl.runtime.placement import PlacementPlan, check_resource_names, plan_placement
from dorarl.runtime.weights_config import TransportSpec, WeightsConfig
from dorarl.trainer import LossConfig, TrainerConfig


@dataclass(kw_only=True)
class TaskSection:
    name: str = field(
        default="running_sum", metadata={"help": "running_sum | jsonl | arith | multiturn_sum"}
    )
    path: str | None = field(
        default=None, metadata={"help": "jsonl: data file (.jsonl, or .parquet with .[data])"}
    )
    eval_path: str | None = field(
        default=None, metadata={"help": "jsonl: held-out file (None: split off the data)"}
    )
    format: Literal["prompt_answer", "gsm8k", "math"] = field(
        default="prompt_answer",
        metadata={
            "help": "jsonl rows: prompt_answer {prompt, answer}; gsm8k {question, answer "
            "ending in '#### N'}; math {problem, solution with the answer in \\boxed{}}"
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "jsonl: the prompt as a Python format string over the row's fields, e.g. "
            "'{question} Put the final answer in \\boxed{{}}.' (None: the question field)"
        },
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "jsonl: exact | math (None: math for gsm8k and math rows, exact for "
            "prompt_answer; arith: always the final answer)"
        },
    )
    chat_template: bool = field(
        default=False, metadata={"help": "jsonl: render prompts through the chat template"}
    )
    min_value: int = field(default=1, metadata={"help": "arith: smallest operand"})
    max_value: int = field(default=99, metadata={"help": "arith: largest operand"})
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "arith, and jsonl with chat_template: system message (None: the template's own)"
        },
    )

    env: str | None = field(
        default=None,
        metadata={
            "help": "multi-turn: 'module:Class', a dorarl.tasks.env.Env subclass; the task's "
            "prompts become episodes and the env gives the reward (None: the task's own)"
        },
    )
    max_turns: int = field(
        default=0, metadata={"help": "multi-turn: turns per episode at most (0: the task's own)"}
    )
    env_timeout_s: float = field(
        default=30.0, metadata={"help": "multi-turn: timeout of one env call (reset or step)"}
    )
    env_latency_s: float = field(
        default=0.0, metadata={"help": "multiturn_sum: simulated tool latency per env step"}
    )

    def validate(self) -> None:
        if self.max_turns < 0:
            raise ConfigError(
                f"task.max_turns: must be >= 0 (0: the task's own), got {self.max_turns}"
            )
        if self.env_timeout_s <= 0:
            raise ConfigError(f"task.env_timeout_s: must be > 0, got {self.env_timeout_s}")
        if self.env_latency_s < 0:
            raise ConfigError(f"task.env_latency_s: must be >= 0, got {self.env_latency_s}")

    def resolved_reward(self) -> str:
        """The reward the jsonl task scores with: the key, else what the rows' format calls for."""
        if self.reward is not None:
            return self.reward
        return "exact" if self.format == "prompt_answer" else "math"


@dataclass(kw_only=True)
class SamplingSection:
    temperature: float = field(default=1.0, metadata={"help": "rollout sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (1: off)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0: off)"})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "response cap (None: the task's own)"}
    )

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ConfigError("temperature: must be > 0 for RL rollouts")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k: must be >= 0 (0: off), got {self.top_k}")


@dataclass(kw_only=True)
class ForcedLengthsSection:
    """Benchmarks and tests: force response lengths (ignore EOS) from a long-tailed lognormal."""

    enabled: bool = field(default=False, metadata={"help": "force response lengths"})
    median: float = field(default=16.0, metadata={"help": "median forced length (tokens)"})
    p99_ratio: float = field(default=10.0, metadata={"help": "p99 / median of forced lengths"})
    max_len: int = field(default=200, metadata={"help": "longest forced length"})
    group_corr: float = field(default=0.5, metadata={"help": "share of log-variance per group"})

    def dist(self, prompt_len: int = 16) -> LengthDist:
        return LengthDist(
            median=self.median,
            p99_ratio=self.p99_ratio,
            max_len=self.max_len,
            group_corr=self.group_corr,
            prompt_len=prompt_len,
        )

    def validate(self) -> None:
        self.dist().validate()


@dataclass(kw_only=True)
class EvalSection:
    every: int = field(default=10, metadata={"help": "evaluate every N versions (0: first/last)"})
    max_prompts: int = field(default=200, metadata={"help": "held-out prompts per evaluation"})
    samples: int = field(
        default=0,
        metadata={
            "help": "k responses per held-out prompt sampled at the run's sampling settings, "
            "for mean@k and pass@k beside greedy accuracy (0: greedy only)"
        },
    )


@dataclass(kw_only=True)
class RecordSection:
    text: bool = field(
        default=False,
        metadata={"help": "write prompt, answer and response text to trajectories.jsonl"},
    )


@dataclass(kw_only=True)
class RaySection:
    address: str | None = field(
        default=None, metadata={"help": "Ray cluster address (None: start local Ray)"}
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address a local Ray's services listen on (127.0.0.1: this machine)"},
    )
    threads_per_actor: int = field(
        default=0,
        metadata={
            "help": "torch threads in each actor (0: share this machine's cores: the trainer "
            "all of them, engines an equal share at lower priority, the evaluator one)"
        },
    )
    max_engine_restarts: int = field(
        default=3,
        metadata={"help": "dead engine instances replaced mid-run before the run stops"},
    )
    max_trainer_restarts: int = field(
        default=1,
        metadata={
            "help": "times a dead trainer (any rank of a sharded one) restarts from the newest checkpoint mid-run"
        },
    )
    engine_gpus: float | None = field(
        default=None,
        metadata={"help": "GPU share of each engine on cuda (None: fit the node; 0.25: 4 a GPU)"},
    )
    trainer_gpus: float | None = field(
        default=None, metadata={"help": "GPU share of the trainer on cuda (None: fit the node)"}
    )
    eval_gpus: float | None = field(
        default=None,
        metadata={
            "help": "GPU share of the evaluator, inside the trainer's bundle (None: 0.1 of it)"
        },
    )
    placement_timeout_s: float = field(
        default=60.0, metadata={"help": "seconds to wait for Ray to place the actors' GPUs"}
    )
    gpu_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "memory of each GPU, to check the engines' KV budgets before any actor "
            "starts and for --print-placement (None: what nvidia-smi reports here)"
        },
    )
    engine_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": "custom Ray resources each engine asks for, e.g. {rollout: 0.01}: engines "
            "run only on nodes started with them (ray start --resources='{\"rollout\": 1}')"
        },
    )
    trainer_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": "custom Ray resources the trainer (each rank) asks for, and the evaluator "
            "beside it (beside the first engine when only the engines are on cuda)"
        },
    )

    def validate(self) -> None:
        if self.max_engine_restarts < 0:
            raise ConfigError("max_engine_restarts: must be >= 0")
        if self.max_trainer_restarts < 0:
            raise ConfigError("max_trainer_restarts: must be >= 0")
        for key in ("engine_gpus", "trainer_gpus", "eval_gpus"):
            share = getattr(self, key)
            if share is not None and not share > 0:
                raise ConfigError(f"{key}: must be > 0 (or unset), got {share}")
        if not self.placement_timeout_s > 0:
            raise ConfigError("placement_timeout_s: must be > 0")
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ConfigError(f"gpu_memory_gb: must be > 0 (or unset), got {self.gpu_memory_gb}")
        check_resource_names("engine_resources", self.engine_resources)
        check_resource_names("trainer_resources", self.trainer_resources)


def _default_engine() -> EngineConfig:
    return EngineConfig(max_num_seqs=64, max_model_len=256, block_size=16)


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(lr=2e-4, loss=LossConfig())


@dataclass(kw_only=True)
class TrainConfig:
    mode: Mode = field(
        default="dora", metadata={"help": "sync | one_step_off | partial_rollout | dora"}
    )
    K: int = field(default=1, metadata={"help": "staleness bound (dora, partial_rollout)"})
    runtime: Literal["ray", "sim"] = field(default="ray", metadata={"help": "ray | sim"})
    steps: int = field(
        default=60, metadata={"help": "training steps (a resumed run ends at this version)"}
    )
    instances: int = field(default=2, metadata={"help": "rollout instances"})
    rbs: int = field(default=24, metadata={"help": "groups outstanding (dispatched, not consumed)"})
    tbs: int = field(default=16, metadata={"help": "groups per training step"})
    group_size: int = field(default=8, metadata={"help": "responses per prompt (G)"})
    seed: int = field(default=0, metadata={"help": "seed of data order, sampling and init"})
    model: str | None = field(
        default=None, metadata={"help": "HF model folder (None: the shipped base model)"}
    )
    checkpoint_every: int = field(
        default=20, metadata={"help": "checkpoint every N versions (0: at the end only)"}
    )
    checkpoint_keep: int = field(
        default=3, metadata={"help": "newest checkpoints kept in the run folder (0: all)"}
    )
    resume: str | None = field(
        default=None,
        metadata={"help": "checkpoint folder, or run folder (its newest), to continue from"},
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
    ray: RaySection = field(default_factory=RaySection)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    engine: EngineConfig = field(default_factory=_default_engine)
    trainer: TrainerConfig = field(default_factory=_default_trainer)

    # The trainer divides logits by the temperature the engines sampled at, or its ratios
    # would not be 1 on fresh data: one setting, sampling.temperature, gives both.
    # The cap that soft overlong punishment ends at is the engines' cap, by the same rule.
    DERIVED_KEYS: ClassVar[dict[str, str]] = {
        "trainer.temperature": "sampling.temperature",
        "trainer.loss.response_cap": "sampling.max_new_tokens",
        "trainer.loss.mask_truncated": "trainer.loss.overlong",  # its old name, for old runs
    }

    def __post_init__(self) -> None:
        self.trainer.temperature = self.sampling.temperature
        self.trainer.loss.response_cap = self.sampling.max_new_tokens
        self._resume_read: tuple[str, ResumePoint] | None = None  # not a setting: a cache

    def validate(self) -> None:
        for key, device in (
            ("engine.device", self.engine.device),
            ("trainer.device", self.trainer.device),
        ):
            _check_device(key, device)
        self.weights.resolve(self.engine.device, self.trainer.device)
        if self.checkpoint_every < 0 or self.checkpoint_keep < 0:
            raise ConfigError("checkpoint_every: checkpoint_every and checkpoint_keep must be >= 0")
        if self.resume and self.runtime != "ray":
            raise ConfigError("resume: only runtime=ray resumes (the sim runtime holds no weights)")
        self._check_work_left()
        self.controller_config().validate()
        self.task.validate()
        if self.task.name == "jsonl" and not self.task.path:
            raise ConfigError("task.path: the jsonl task needs a data file")
        if self.engine.max_num_seqs < 1:
            raise ConfigError("engine.max_num_seqs: must be >= 1")
        if self.eval.every < 0 or self.eval.max_prompts < 1:
            raise ConfigError("eval: every must be >= 0 and max_prompts >= 1")
        if self.eval.samples < 0:
            raise ConfigError(
                f"eval.samples: must be >= 0 (0: greedy only), got {self.eval.samples}"
            )
        self._check_overlong()
        if self.trainer.moe.route_replay and not self.engine.record_routes:
            raise ConfigError(
                "trainer.moe.route_replay: needs engine.record_routes=true (the engines record "
                "the routes it replays)"
            )
        if self.forced_lengths.enabled and self.forced_lengths.max_len >= self.engine.max_model_len:
            raise ConfigError(
                f"forced_lengths.max_len: {self.forced_lengths.max_len} leaves no room for the "
                f"prompt under engine.max_model_len={self.engine.max_model_len}"
            )

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

    def _check_work_left(self) -> None:
        point = self.resume_point()
        if point is not None and point.version >= self.steps:
            raise RunComplete(
                f"{point.folder} is version {point.version} and steps={self.steps}: the run is "
                f"complete; steps=N (N > {point.version}) trains it further"
            )

    def controller_config(self) -> ControllerConfig:
        """The controller's view: its knobs carry the names they have here (K, steps, instances,
        rbs, tbs, group_size, orchestrator.*, rollout.*), so its errors name the keys a user
        typed."""
        point = self.resume_point()
        return ControllerConfig(
            mode=self.mode,
            K=self.K,
            rbs=self.rbs,
            tbs=self.tbs,
            group_size=self.group_size,
            instances=self.instances,
            slots=self.engine.max_num_seqs,
            steps=self.steps,
            orchestrator=self.orchestrator,
            rollout=self.rollout,
            **(point.controller_keys() if point else {}),
        )

    def placement(self, node_gpus: float) -> PlacementPlan:
        """GPU shares of the engines, trainer and evaluator on a node with `node_gpus` GPUs,
        and the custom resources they ask for (the nodes they may run on)."""
        return plan_placement(
            instances=self.instances,
            engine_on_gpu=self.engine.device != "cpu",
            trainer_on_gpu=self.trainer.device != "cpu",
            node_gpus=node_gpus,
            engine_gpus=self.ray.engine_gpus,
            trainer_gpus=self.ray.trainer_gpus,
            eval_gpus=self.ray.eval_gpus,
            engine_resources=self.ray.engine_resources,
            trainer_resources=self.ray.trainer_resources,
            trainer_ranks=self.trainer.world_size,
        )

    def transport(self) -> TransportSpec:
        """How weights reach the engines (`weights.*`, resolved for the devices)."""
        return self.weights.spec(self.engine.device, self.trainer.device, self.engine.dtype)

    def resume_point(self) -> ResumePoint | None:
        """The checkpoint `resume` names, read once (at validation) for the value it has."""
        if not self.resume:
            return None
        read = self._resume_read
        if read is None or read[0] != self.resume:
            read = self._resume_read = (self.resume, read_resume_point(self.resume))
        return read[1]


def _check_device(key: str, device: str) -> None:
    """cpu, or cuda: Ray gives each actor its GPU share and makes that GPU the only one it
    sees, so a cuda:N other than 0 would name a device the actor cannot see. Whether the
    cluster has GPUs is checked when the actors are placed (`dorarl.runtime.placement`)."""
    if device not in ("cpu", "cuda", "cuda:0"):
        raise ConfigError(
            f"{key}: use cpu or cuda (Ray assigns each actor its GPU), got {device!r}"
        )
