"""Settings whose default follows the model: `trainer.lr` left unset (None) is chosen here,
once, where the run's model folder is known, and the run's config.json holds the choice, so
a resumed run keeps its learning rate.

The shipped base models (about 1M parameters, trained from scratch for their tasks) take
2e-4, the rate they are tuned at. A pretrained model folder takes a fine-tuning rate by its
size: 1e-5 under 1B parameters (SmolLM2-135M learns arith at 2e-5 in
configs/smollm2-arith.yaml, and two steps at 2e-4 took its held-out accuracy from 1.0 to 0),
1e-6 from 1B up (configs/node-8gpu-qwen2.5-7b.yaml's rate, and the usual one of GRPO recipes
for 7B models). A run resumed from a checkpoint takes the rate the checkpoint trained at.
LoRA adapters left without `trainer.lora.lr` take ten times the model's full-weight rate
(adapters learn best at about 10x a full fine-tune's rate, Thinking Machines' "LoRA Without
Regret"; on SmolLM2 arith 2e-4 learned where full weights use 2e-5).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import model_spec
from dorarl.jobs.resume import STATE_FILE, ResumePoint
from dorarl.tasks.assets import BASE_MODEL_DIR, MULTITURN_BASE_DIR

SHIPPED_BASE_LR = 2e-4
SMALL_MODEL_LR = 1e-5
LARGE_MODEL_LR = 1e-6
LARGE_MODEL_PARAMETERS = 10**9
LORA_RATE_FACTOR = 10


@dataclass(frozen=True)
class DefaultLr:
    """The learning rate a run gets by its model, and why (for its start-up line)."""

    value: float
    why: str

    def line(self) -> str:
        return f"trainer.lr: {rate(self.value)} ({self.why}; trainer.lr=X sets another)"


def rate(value: float) -> str:
    """A learning rate as people write one: 2e-4, 2.5e-5."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def default_lr(folder: str, point: ResumePoint | None, backend: str = "dorarl") -> DefaultLr:
    """The learning rate for a run of the model in `folder` (resuming `point`, if any)."""
    recorded = _checkpoint_lr(point.folder) if point is not None else None
    if recorded is not None:
        return DefaultLr(recorded, f"the rate checkpoint {point.folder.name} trained at")
    shipped = f"the shipped base's is {rate(SHIPPED_BASE_LR)}"
    if is_shipped_base(folder):
        return DefaultLr(SHIPPED_BASE_LR, "the default for the shipped base model")
    spec, _ = model_spec(folder, backend)
    billions = spec.num_parameters() / 1e9
    if spec.num_parameters() < LARGE_MODEL_PARAMETERS:
        why = f"the default for a model folder under 1B parameters, {billions:.2g}B here; {shipped}"
        return DefaultLr(SMALL_MODEL_LR, why)
    why = (
        f"the default for a model folder of 1B parameters or more, {billions:.3g}B here; {shipped}"
    )
    return DefaultLr(LARGE_MODEL_LR, why)


def is_shipped_base(folder: str | Path) -> bool:
    return Path(folder).resolve() in (BASE_MODEL_DIR.resolve(), MULTITURN_BASE_DIR.resolve())


def with_model_defaults(
    config: TrainConfig, folder: str, point: ResumePoint | None
) -> tuple[TrainConfig, list[str]]:
    """`config` with its unset model-dependent settings chosen, and a line on each choice."""
    if config.trainer.lr is not None:
        return config, []
    chosen = default_lr(folder, point, config.engine.backend)
    trainer = dataclasses.replace(config.trainer, lr=chosen.value)
    lines = [chosen.line()]
    lora = trainer.lora
    if lora.enabled:  # only the adapters train: their rate is the one to say
        lines = []
        if lora.lr is None:
            adapters = LORA_RATE_FACTOR * chosen.value
            trainer = dataclasses.replace(trainer, lora=dataclasses.replace(lora, lr=adapters))
            lines = [
                f"trainer.lora.lr: {rate(adapters)} ({LORA_RATE_FACTOR}x the full-weight "
                f"{rate(chosen.value)}, {chosen.why}; trainer.lora.lr=X sets another)"
            ]
    return dataclasses.replace(config, trainer=trainer), lines


def _checkpoint_lr(folder: Path) -> float | None:
    """The learning rate in a checkpoint's trainer_state.json (its trainer's config)."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    lr = state.get("config", {}).get("lr")
    return float(lr) if isinstance(lr, int | float) else None
