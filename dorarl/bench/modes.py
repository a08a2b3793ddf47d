"""`dorarl bench modes`: sync, one_step_off, partial_rollout and dora side by side, on devices
emulated by pacing.

    dorarl bench modes --out DIR [--quick] [--config FILE.yaml] [key=value ...]

Every mode runs on the Ray runtime with real engines and the real trainer, on the same
long-tailed forced-length workload, the same instances, prompts and seeds, on one set of
actors reset to a fresh engine and trainer before each mode. Before the modes run, the real
compute of a full-batch decode step, of prefill and of a training step is calibrated once;
every engine step and training step then lasts its device time (dorarl.record.pacing), so
N instances sharing the CPU cores behave like N dedicated accelerators, and every paced
figure is shown beside the real compute it covered. Writes DIR/modes.json, DIR/<mode>/ (the recorder's files,
trace.json included), DIR/timeline_<mode>.png and DIR/throughput.png; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import ray

from dorarl.bench.bars import check_bars, makespan_steps
from dorarl.bench.calibrate import (
    Calibration,
    PaceRule,
    calibrate,
    choose_pace,
    quiet_model_loading,
)
from dorarl.bench.cli_args import parse_bench_args
from dorarl.bench.clock import Stopwatch, load_window
from dorarl.bench.report import print_modes
from dorarl.config import ConfigError, load_config
from dorarl.controller import ControllerConfig, OrchestratorConfig
from dorarl.data.lengths import LengthDist, length_stats
from dorarl.engine import EngineConfig
from dorarl.engine.config import Backend
from dorarl.engine.vllm.config import VllmArgs
from dorarl.record.pacing import DeviceModel
from dorarl.report.figures import mode_figures, paced_reliably
from dorarl.report.timeline import plot_throughput, plot_timeline
from dorarl.run_layout import RunFolder
from dorarl.runtime.actors import EngineSpec, TrainerSpec, start_workers
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.ray_runtime import RayRunPlan, RayRuntime, RolloutSettings
from dorarl.tasks import Task, make_task
from dorarl.tasks.assets import shipped_base_model
from dorarl.trainer import TrainerConfig

log = logging.getLogger(__name__)

QUICK = ["steps=10", "warmup_steps=2"]
"""`--quick`: fewer steps per mode (applied before the user's overrides)."""


@dataclass(kw_only=True)
class WorkloadSection:
    """Forced response lengths: lognormal with p99/median >= 10, EOS ignored."""

    median: float = field(
        default=12.0, metadata={"help": "median response length (tokens)", "ge": 1}
    )
    p99_ratio: float = field(default=12.0, metadata={"help": "p99 / median (>= 10)", "ge": 1})
    max_len: int = field(default=240, metadata={"help": "longest response", "ge": 1})
    group_corr: float = field(
        default=0.5, metadata={"help": "share of log-variance per group", "ge": 0, "le": 1}
    )
    multi_turn: bool = field(
        default=False,
        metadata={
            "help": "episodes of workload.task at their natural lengths instead of forced lengths"
        },
    )
    task: Literal["multiturn_sum", "calculator"] = field(
        default="multiturn_sum",
        metadata={
            "help": "multi_turn: multiturn_sum (on the multi-turn base; every item revealed, "
            "long-tailed turn counts) | calculator (on a chat model, model=...: tool calls, "
            "each answered env_latency_s late, then the answer)"
        },
    )
    env_latency_s: float = field(
        default=0.05,
        metadata={"help": "multi_turn: simulated tool latency per env step (tool call)"},
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "multi_turn: sampling temperature (the calculator config's is 0.7)",
            "gt": 0,
        },
    )

    def dist(self) -> LengthDist:
        return LengthDist(
            median=self.median,
            p99_ratio=self.p99_ratio,
            max_len=self.max_len,
            group_corr=self.group_corr,
        )

    def validate(self) -> None:
        if self.p99_ratio < 10:
            raise ConfigError(f"p99_ratio: the benchmark's tail needs >= 10, got {self.p99_ratio}")


@dataclass(kw_only=True)
class ModesConfig:
    model: str | None = field(
        default=None,
        metadata={"help": "HF model folder (None: the shipped base model)", "path": True},
    )
    instances: int = field(
        default=4, metadata={"help": "rollout instances (emulated devices)", "ge": 1}
    )
    slots: int = field(default=16, metadata={"help": "running requests per instance", "ge": 1})
    tbs: int = field(default=8, metadata={"help": "groups per training step", "ge": 1})
    group_size: int = field(default=8, metadata={"help": "responses per prompt", "ge": 1})
    steps: int = field(default=24, metadata={"help": "training steps per mode", "ge": 1})
    warmup_steps: int = field(
        default=2, metadata={"help": "first steps left out of figures (fewer than steps)", "ge": 0}
    )
    dora_k: list[int] = field(default_factory=lambda: [1, 3], metadata={"help": "dora K values"})
    partial_k: int = field(default=1, metadata={"help": "partial_rollout staleness bound", "ge": 1})
    rebalance_period_s: float = field(default=1.0, metadata={"help": "dora temporal re-balance"})
    steps_per_call: int = field(
        default=2, metadata={"help": "engine steps per runtime call (reaction latency)", "ge": 1}
    )
    max_model_len: int = field(default=320, metadata={"help": "engine context (prompt + response)"})
    micro_batch_tokens: int = field(default=1024, metadata={"help": "trainer micro-batch tokens"})
    lr: float = field(default=1e-4, metadata={"help": "trainer learning rate"})
    seed: int = field(default=0, metadata={"help": "prompts, lengths, sampling, init"})
    backend: Backend = field(
        default="dorarl", metadata={"help": "the instances' engine: dorarl | vllm"}
    )
    vllm: VllmArgs = field(
        default_factory=lambda: VllmArgs(enforce_eager=True),
        metadata={"help": "backend vllm: vLLM's engine arguments (eager: starts in seconds)"},
    )
    workload: WorkloadSection = field(default_factory=WorkloadSection)
    pace: PaceRule = field(default_factory=PaceRule)

    def validate(self) -> None:
        if self.warmup_steps >= self.steps:
            raise ConfigError(f"warmup_steps: must be in [0, steps), got {self.warmup_steps}")
        if not self.dora_k or min(self.dora_k) < 1:
            raise ConfigError(f"dora_k: needs K values >= 1, got {self.dora_k}")
        if self.workload.multi_turn and self.workload.task == "calculator" and not self.model:
            raise ConfigError("model: workload.task=calculator needs a chat model folder")
        if self.workload.max_len >= self.max_model_len:
            raise ConfigError(
                f"workload.max_len: {self.workload.max_len} leaves no room for the prompt "
                f"under max_model_len={self.max_model_len}"
            )

    def modes(self) -> list[tuple[str, str, int]]:
        """(name, controller mode, K) in run order."""
        runs = [("sync", "sync", 0), ("one_step_off", "one_step_off", 1)]
        runs.append(("partial_rollout", "partial_rollout", self.partial_k))
        return runs + [(f"dora_k{k}", "dora", k) for k in self.dora_k]

    def engine(self) -> EngineConfig:
        return EngineConfig(
            max_num_seqs=self.slots, max_model_len=self.max_model_len, backend=self.backend,
            vllm=self.vllm,
        )  # fmt: skip

    def trainer(self) -> TrainerConfig:
        return TrainerConfig(lr=self.lr, micro_batch_tokens=self.micro_batch_tokens)

    def controller(self, mode: str, k: int) -> ControllerConfig:
        lockstep = mode in ("sync", "one_step_off")
        return ControllerConfig(
            mode=mode,
            K=k,
            rbs=self.tbs if lockstep else (k + 1) * self.tbs,  # the admission cap
            tbs=self.tbs,
            group_size=self.group_size,
            instances=self.instances,
            slots=self.slots,
            steps=self.steps,
            orchestrator=self._orchestrator(),
        )

    def _orchestrator(self) -> OrchestratorConfig:
        """The re-balance period, and what the backend's engines cannot carry out left
        unplanned (loads from peers, offloads)."""
        can = self.engine().capabilities
        orchestrator = OrchestratorConfig(rebalance_period_s=self.rebalance_period_s)
        return orchestrator.within(can.serves_weights, can.offload)


# ---- calibration -------------------------------------------------------------------------
def calibrate_modes(cfg: ModesConfig, model_folder: str, task: Task) -> Calibration:
    """Real compute alone: full-batch decode at about 4x the median length, a training step
    on the first batch's shape."""
    prompts = [p.prompt_ids for p in task.train_prompts()[: cfg.tbs]]
    dist = cfg.workload.dist()
    lengths = [dist.group_lengths(cfg.seed, g, cfg.group_size) for g in range(cfg.tbs)]
    decode_len = min(cfg.workload.max_len, max(8, round(4 * cfg.workload.median)))
    return calibrate(
        model_folder, cfg.engine(), cfg.trainer(), prompts, lengths, len(task.tokenizer),
        decode_len, cfg.seed,
    )  # fmt: skip


def sync_rollout_steps(cfg: ModesConfig, batches: int) -> float:
    """Mean engine steps of a synchronous rollout over the first `batches` batches."""
    dist, per_batch = cfg.workload.dist(), []
    for b in range(batches):
        groups = range(b * cfg.tbs, (b + 1) * cfg.tbs)
        lengths = [n for g in groups for n in dist.group_lengths(cfg.seed, g, cfg.group_size)]
        per_batch.append(makespan_steps(lengths, cfg.instances * cfg.slots) + 1)  # + prefill
    return sum(per_batch) / len(per_batch)


def workload_stats(cfg: ModesConfig, dispatched: int, groups: int = 4000) -> dict[str, Any]:
    """Length stats of the distribution (`groups` groups) and of the groups the runs used;
    multi-turn episodes run at their natural lengths, so no forced lengths to show."""
    if cfg.workload.multi_turn:
        return asdict(cfg.workload)

    def lengths(n: int) -> list[int]:
        dist = cfg.workload.dist()
        return [x for g in range(n) for x in dist.group_lengths(cfg.seed, g, cfg.group_size)]

    return asdict(cfg.workload) | {
        "sampled": length_stats(lengths(groups)),
        "dispatched": length_stats(lengths(dispatched)),
    }


# ---- one mode ----------------------------------------------------------------------------
def run_mode(
    cfg: ModesConfig,
    name: str,
    mode: str,
    k: int,
    actors: tuple[list[Any], Any],
    task: Task,
    out: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One mode on the bench's actors, reset first to a fresh engine and trainer on the base
    weights; returns the recorder's summary and its step rows."""
    workers, trainer = actors
    ray.get([actor.reset.remote() for actor in [*workers, trainer]])
    controller = cfg.controller(mode, k)
    multi = cfg.workload.multi_turn
    rollout = RolloutSettings(
        temperature=cfg.workload.temperature if multi else 1.0,
        max_new_tokens=task.max_new_tokens if multi else cfg.workload.max_len,
        stop_token_ids=list(task.stop_token_ids),
        stop_strings=list(getattr(task, "stop_strings", [])),  # the calculator's </tool_call>
        seed=cfg.seed,
        forced_lengths=None if multi else cfg.workload.dist(),
    )
    plan = RayRunPlan(
        controller, task, rollout, workers, trainer,
        steps_per_call=cfg.steps_per_call, out_dir=out / name,
        capabilities=cfg.engine().capabilities,
    )  # fmt: skip
    runtime = RayRuntime(plan)
    with load_window() as window:
        summary = runtime.run()
    load = [window.start[0], window.end[0]]
    return summary | {"load_avg_1min": load}, runtime.recorder.steps


# ---- the whole bench ---------------------------------------------------------------------
def run_bench(cfg: ModesConfig, out: Path, *, say=print) -> dict[str, Any]:
    """Calibrate, run every mode, write modes.json and the PNGs; returns what modes.json holds."""
    model_folder, task = _workload_task(cfg)
    out.mkdir(parents=True, exist_ok=True)
    watch = Stopwatch()
    cal = calibrate_modes(cfg, model_folder, task)
    device, derivation = choose_pace(
        cal,
        cfg.pace,
        num_instances=cfg.instances,
        kv_pool_tokens=cfg.engine().kv_blocks * cfg.engine().block_size,
        sync_rollout_steps=sync_rollout_steps(cfg, cfg.steps),
    )
    say(f"calibrated in {watch.wall_s():.1f}s: decode step pace "
        f"{device.decode_step_s * 1e3:.1f} ms (real {cal.decode_step_s * 1e3:.2f} ms)")  # fmt: skip
    runs, summaries = _run_all(cfg, model_folder, task, device, out, say)
    result = _assemble(cfg, out, cal, device, derivation, runs, summaries)
    result["bench_wall_s"] = watch.wall_s()
    (out / "modes.json").write_text(json.dumps(result, indent=2) + "\n")
    _plots(cfg, out, runs, result["modes"])
    return result


def _workload_task(cfg: ModesConfig) -> tuple[str, Task]:
    """The model folder and task of the workload: running_sum at forced lengths,
    multiturn_sum episodes that play every turn, each env step `env_latency_s` late, or
    calculator episodes whose tool calls are each answered `env_latency_s` late."""
    if not cfg.workload.multi_turn:
        folder = str(cfg.model or shipped_base_model())
        return folder, make_task("running_sum", seed=cfg.seed, tokenizer=_tokenizer(folder))
    if cfg.workload.task == "calculator":
        assert cfg.model is not None, "validate() asks for the chat model"
        task = make_task(
            "calculator",
            seed=cfg.seed,
            tokenizer=str(cfg.model),
            max_model_len=cfg.max_model_len,
            latency_s=cfg.workload.env_latency_s,
        )
        return str(cfg.model), task
    folder = str(cfg.model or shipped_base_model("multiturn_sum"))
    task = make_task(
        "multiturn_sum",
        seed=cfg.seed,
        tokenizer=_tokenizer(folder),
        latency_s=cfg.workload.env_latency_s,
        stop_on_wrong=False,
    )
    return folder, task


def _run_all(
    cfg: ModesConfig, model_folder: str, task: Task, device: DeviceModel, out: Path, say
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Every mode in turn on one set of actors (process start-up paid once, not per mode)."""
    start_local_ray()
    runs: dict[str, list[dict]] = {}
    summaries: dict[str, dict] = {}
    try:
        watch = Stopwatch()
        engine, trainer = (
            EngineSpec(model_folder, cfg.engine()),
            TrainerSpec(model_folder, cfg.trainer()),
        )
        actors = start_workers(cfg.instances, engine, trainer, device)
        say(f"started {cfg.instances} engine actors and the trainer in "
            f"{watch.wall_s():.1f}s")  # fmt: skip
        for name, mode, k in cfg.modes():
            watch = Stopwatch()
            summaries[name], runs[name] = run_mode(cfg, name, mode, k, actors, task, out)
            say(f"{name}: {cfg.steps} steps in {summaries[name]['wall_time_s']:.1f}s "
                f"({watch.wall_s():.1f}s with the reset)")  # fmt: skip
    finally:
        ray.shutdown()
    return runs, summaries


def _assemble(
    cfg: ModesConfig,
    out: Path,
    cal: Calibration,
    device: DeviceModel,
    derivation: dict[str, float],
    runs: dict[str, list[dict]],
    summaries: dict[str, dict],
) -> dict[str, Any]:
    figures = {
        name: mode_figures(rows, cfg.warmup_steps, cfg.instances) for name, rows in runs.items()
    }
    for name, fig in figures.items():
        fig["dropped_total"] = summaries[name]["dropped_total"]
        fig["K"] = summaries[name]["K"]
        fig["load_avg_1min"] = summaries[name]["load_avg_1min"]
        fig["paced_reliably"] = paced_reliably(fig)
    sync = figures["sync"]
    ratio = sync["train_time_s"] / max(1e-9, sync["step_time_s"]["mean"] - sync["train_time_s"])
    consumed = [n for name in runs for n in _consumed_lengths(out / name)]
    return {
        "config": asdict(cfg),
        "workload": workload_stats(cfg, max(s["dispatched"] for s in summaries.values()))
        | {"consumed": length_stats(consumed) if consumed else {}},
        "emulation": {
            "calibration_real": cal.to_dict(),
            "device": device.to_dict(),
            "derivation": derivation,
            "rule": asdict(cfg.pace),
            "measured_sync_train_over_rollout": ratio,
            "not_paced": "weight loads, request transfers (export/import), cache freeing: real CPU time",
        },
        "modes": figures,
        "bars": {f"dora_k{k}": check_bars(figures, f"dora_k{k}") for k in cfg.dora_k},
    }


def _consumed_lengths(run_dir: Path) -> list[int]:
    """Response lengths of the trajectories a mode's trainer consumed (its run files)."""
    path = RunFolder(run_dir).trajectories
    if not path.exists():
        return []
    with path.open() as lines:
        return [json.loads(line)["response_tokens"] for line in lines]


def _plots(cfg: ModesConfig, out: Path, runs: dict[str, list[dict]], figures: dict) -> None:
    for name in runs:
        trace = RunFolder(out / name).trace
        if trace.exists():
            title = f"{name}: lane height = busy slots / {cfg.slots}, colour = hosted version"
            plot_timeline(trace, out / f"timeline_{name}.png", cfg.slots, title)
    plot_throughput(runs, figures, out / "throughput.png")


def _tokenizer(model_folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


# ---- command line ------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_bench_args(argv, "dorarl bench modes", __doc__, ModesConfig, QUICK)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    overrides = (QUICK if args.quick else []) + list(args.overrides)
    cfg = load_config(ModesConfig, args.config, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_model_loading()
    out = Path(args.out)
    result = run_bench(cfg, out)
    print_modes(result, out)
    dropped = sum(m["dropped_total"] for m in result["modes"].values())
    return 0 if dropped == 0 else 1
