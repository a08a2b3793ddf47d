"""The `local` preset and its validation against `dorarl bench modes` measured on this machine.

`dorarl bench modes` paces every engine and training step to a device model calibrated on
this machine; the `local` preset is that device model as a `CostModel`, with the bench's
instances, slots, batch and workload. `validate` re-runs the bench's named runs (sync,
one_step_off, partial_rollout, dora_k1, ...) in the simulator and compares step time and
consumed tokens/s per run within a tolerance.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dorarl.controller import ControllerConfig, OrchestratorConfig
from dorarl.data.lengths import LengthDist
from dorarl.errors import UserInputError
from dorarl.sim.cost import CostModel
from dorarl.simulate.config import SimulateConfig

TOLERANCE = 0.15
COMPARED = ("step_time_s.mean", "consumed_tokens_per_s")

# A `dorarl bench modes` run on this machine (2 CPU cores), trimmed to what the `local`
# preset and its validation read: the bench's settings, the paced device model and the
# measured figures per run. Refresh with `python -m dorarl.simulate.validate MODES_JSON`.
LOCAL_BENCH = Path(__file__).with_name("local_bench.json")
KEPT_FIGURES = ("K", "step_time_s", "consumed_tokens_per_s", "rollout_only_share",
                "train_time_s", "pace")  # fmt: skip
PROMPT_LEN = 8  # running_sum prompts with the chat template, about 8 tokens
TINY_WEIGHTS = 4.25e6  # bytes of the bench's base model (model.safetensors)


def recorded_bench() -> dict[str, Any]:
    """The bench run shipped with the package (see LOCAL_BENCH)."""
    return read_bench(LOCAL_BENCH)


def trim_bench(bench: dict[str, Any], source: str) -> dict[str, Any]:
    """What of a modes.json the `local` preset keeps (LOCAL_BENCH's layout)."""
    return {
        "source": source,
        "config": bench["config"],
        "emulation": {"device": bench["emulation"]["device"]},
        "modes": {
            name: {key: fig[key] for key in KEPT_FIGURES if key in fig}
            for name, fig in bench["modes"].items()
        },
    }


def local_from_bench(bench: dict[str, Any] | None = None) -> SimulateConfig:
    """`SimulateConfig` of this machine as `dorarl bench modes` paced it (`bench`: a
    modes.json; None: the recorded run)."""
    bench = bench or recorded_bench()
    device, config = bench["emulation"]["device"], bench["config"]
    work = config["workload"]
    lengths = LengthDist(
        median=work["median"],
        p99_ratio=work["p99_ratio"],
        group_corr=work["group_corr"],
        max_len=work["max_len"],
        prompt_len=PROMPT_LEN,
    )
    controller = ControllerConfig(
        tbs=config["tbs"],
        rbs=2 * config["tbs"],
        K=1,
        group_size=config["group_size"],
        instances=config["instances"],
        slots=config["slots"],
        steps=config["steps"],
        orchestrator=OrchestratorConfig(rebalance_period_s=config["rebalance_period_s"]),
    )
    return SimulateConfig(
        controller=controller,
        cost=_cost(device, config),
        lengths=lengths,
        seed=config["seed"],
        warmup_steps=config["warmup_steps"],
    )


def _cost(device: dict[str, float], config: dict[str, Any]) -> CostModel:
    """The paced device model; transfers are unpaced real CPU work on tiny tensors."""
    return CostModel(
        decode_fixed_s=device["decode_step_s"],
        decode_per_seq_s=0.0,  # the pace does not depend on the batch size
        decode_per_kv_token_s=device["kv_token_s"],
        prefill_per_token_s=device["prefill_token_s"],
        kv_capacity_tokens=config["slots"] * config["max_model_len"],
        kv_link_bytes_per_s=1e9,
        kv_link_latency_s=2e-3,  # a Ray object-store round trip
        host_link_bytes_per_s=5e9,
        weight_bytes=TINY_WEIGHTS,
        peer_link_bytes_per_s=1e9,
        trainer_link_bytes_per_s=1e9,
        weight_latency_s=0.02,
        free_cache_s=1e-4,
        train_fixed_s=device["train_fixed_s"],
        train_per_token_s=device["train_token_s"],
        instance_devices=1,  # each engine and the trainer paced as a device of its own
        trainer_devices=1,
    )


def read_bench(path: str | Path) -> dict[str, Any]:
    """A `dorarl bench modes` modes.json; errors name the file and what is missing."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserInputError(f"--validate {path}: {exc}") from None
    for key in ("config", "emulation", "modes"):
        if key not in data:
            raise UserInputError(f"--validate {path}: no {key!r} section (not a modes.json?)")
    for name, figures in data["modes"].items():
        for field in ("K", "step_time_s", "consumed_tokens_per_s"):
            if field not in figures:
                raise UserInputError(f"--validate {path}: modes.{name} has no {field!r}")
    return data


def bench_runs(bench: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(name, mode, K) of every run in a modes.json ('dora_k3' is dora with K=3)."""
    runs = []
    for name, figures in bench["modes"].items():
        mode = name.split("_k")[0] if name.startswith(("dora", "partial_rollout")) else name
        runs.append((name, mode, int(figures["K"])))
    return runs


def run_controller(base: ControllerConfig, mode: str, k: int) -> ControllerConfig:
    """The bench's schedule for one run: lockstep modes RBS = TBS, others the admission cap."""
    lockstep = mode in ("sync", "one_step_off")
    rbs = base.tbs if lockstep else (k + 1) * base.tbs
    return dataclasses.replace(base, mode=mode, K=k, rbs=rbs)


def bench_controllers(bench: dict[str, Any]) -> dict[str, ControllerConfig]:
    """Each run of a modes.json by name, as the controller config it ran with."""
    base = local_from_bench(bench).controller
    return {name: run_controller(base, mode, k) for name, mode, k in bench_runs(bench)}


def schedule(controller: ControllerConfig) -> str:
    """'sync', 'one_step_off', 'dora K=3 RBS 32': the mode, K and RBS in force."""
    if controller.lockstep:
        return controller.mode
    return f"{controller.mode} K={controller.effective_K} RBS {controller.rollout_batch}"


def measured_as(controller: ControllerConfig, measured: dict[str, ControllerConfig]) -> str | None:
    """The bench run that ran `controller`'s settings: same mode, K and RBS in force and every
    other controller setting the same; None when the bench measured no such run."""
    for name, bench in measured.items():
        if _in_force(bench) == _in_force(controller):
            return name
    return None


def _in_force(controller: ControllerConfig) -> ControllerConfig:
    """`controller` with K and RBS as the mode applies them (a knob the mode ignores differs
    between two configs that run the same)."""
    return dataclasses.replace(controller, K=controller.effective_K, rbs=controller.rollout_batch)


def unmeasured_reason(controller: ControllerConfig, measured: dict[str, ControllerConfig]) -> str:
    """Why no bench run matches `controller`: the schedules the bench ran, or the settings in
    which its run of the same schedule differs."""
    same = [b for b in measured.values() if schedule(b) == schedule(controller)]
    if not same:
        return f"the bench ran {', '.join(schedule(b) for b in measured.values())}"
    ours, theirs = _in_force(controller), _in_force(same[0])
    keys = [
        f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)
    ]
    return "the bench ran it with " + ", ".join(f"{k}={getattr(theirs, k)}" for k in keys)


def _get(figures: dict[str, Any], dotted: str) -> float:
    value: Any = figures
    for part in dotted.split("."):
        value = value[part]
    return float(value)


def compare(
    predicted: dict[str, dict[str, Any]],
    measured: dict[str, dict[str, Any]],
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """Per run and figure: predicted, measured, relative error and whether it is within."""
    rows: dict[str, dict[str, Any]] = {}
    for name, real in measured.items():
        if name not in predicted:
            continue
        rows[name] = {"context": _context(predicted[name], real)}
        for key in COMPARED:
            want, got = _get(real, key), _get(predicted[name], key)
            error = (got - want) / want if want else float("inf")
            rows[name][key] = {
                "predicted": got,
                "measured": want,
                "rel_error": error,
                "within": abs(error) <= tolerance,
            }
    ok = all(row[key]["within"] for row in rows.values() for key in COMPARED)
    return {"tolerance": tolerance, "all_within": ok, "runs": rows}


def _context(predicted: dict[str, Any], real: dict[str, Any]) -> dict[str, float]:
    """What explains a gap: training time, and the real compute the bench could not pace.

    The simulator assumes dedicated devices; on a 2-core machine the bench's pacing breaks
    when real compute exceeds the pace (engines and trainer contending for cores).
    """
    pace = real.get("pace", {})
    return {
        "train_time_s_predicted": float(predicted.get("train_time_s", 0.0)),
        "train_time_s_measured": float(real.get("train_time_s", 0.0)),
        "pace_excess_train_s": float(pace.get("train", {}).get("excess_s", 0.0)),
        "pace_excess_engine_s": float(pace.get("engine", {}).get("excess_s", 0.0)),
    }


def main(argv: list[str] | None = None) -> int:
    """Record a modes.json as the `local` preset's bench run (LOCAL_BENCH)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dorarl.simulate.validate MODES_JSON", file=sys.stderr)
        return 2
    trimmed = trim_bench(
        read_bench(args[0]), source=f"dorarl bench modes --out {Path(args[0]).parent}"
    )
    LOCAL_BENCH.write_text(json.dumps(trimmed, indent=2) + "\n")
    print(f"wrote {LOCAL_BENCH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
