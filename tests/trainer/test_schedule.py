"""Learning-rate schedules: closed-form values, the rate a step logs, resume continuity, and
config errors naming the key."""

import math

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer.schedule import LrSchedule

PEAK, WARMUP, DECAY, FLOOR = 1e-3, 4, 20, 0.1


@pytest.mark.parametrize("step", [0, 3, 4, 9, 12, 19, 20, 35])
def test_cosine_and_linear_match_their_formulas(step):
    cosine = LrSchedule(PEAK, "cosine", WARMUP, DECAY, FLOOR)
    linear = LrSchedule(PEAK, "linear", WARMUP, DECAY, FLOOR)
    if step < WARMUP:
        expected_cos = expected_lin = PEAK * (step + 1) / WARMUP
    else:
        t = min(1.0, (step - WARMUP) / (DECAY - WARMUP))
        expected_cos = PEAK * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * t)))
        expected_lin = PEAK * (FLOOR + (1 - FLOOR) * (1 - t))
    assert cosine.at(step) == pytest.approx(expected_cos, rel=1e-12)
    assert linear.at(step) == pytest.approx(expected_lin, rel=1e-12)


def test_schedule_landmarks():
    cosine = LrSchedule(PEAK, "cosine", WARMUP, DECAY, FLOOR)
    assert cosine.at(WARMUP) == pytest.approx(PEAK)  # the peak right after warmup
    assert cosine.at(12) == pytest.approx(PEAK * (FLOOR + (1 - FLOOR) / 2))  # half way
    assert cosine.at(DECAY) == cosine.at(10 * DECAY) == pytest.approx(PEAK * FLOOR)
    assert LrSchedule(PEAK, "constant", 0, DECAY, FLOOR).at(DECAY) == PEAK


def test_decay_horizon_follows_the_run_steps_unless_given():
    cfg = load_config(TrainConfig, None, ["steps=30", "trainer.lr_schedule=linear"])
    assert cfg.trainer.decay_steps() == 30
    cfg = load_config(
        TrainConfig, None, ["steps=30", "trainer.lr_schedule=linear", "trainer.lr_decay_steps=10"]
    )
    assert cfg.trainer.decay_steps() == 10


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.lr_schedule=exp"], "trainer.lr_schedule"),
        (["trainer.lr_floor=1.5"], "trainer.lr_floor"),
        (["trainer.lr_decay_steps=0"], "trainer.lr_decay_steps"),
        (["trainer.lr_schedule=cosine", "trainer.warmup_steps=8", "steps=8"], "lr_decay_steps"),
        (
            ["trainer.lr_schedule=linear", "trainer.lr_decay_steps=3", "trainer.warmup_steps=5"],
            "trainer.lr_decay_steps",
        ),
    ],
)
def test_bad_schedules_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TrainConfig, None, overrides)


def test_a_trainer_built_directly_needs_a_horizon(tiny_model_dir):
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        Trainer.from_pretrained(tiny_model_dir, TrainerConfig(lr=1e-3, lr_schedule="cosine"))


def _config() -> TrainerConfig:
    return TrainerConfig(
        lr=1e-3,
        warmup_steps=2,
        lr_schedule="cosine",
        lr_decay_steps=6,
        lr_floor=0.2,
        micro_batch_tokens=64,
    )


def test_each_step_logs_the_rate_it_applied(tiny_model_dir, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, _config())
    schedule = _config().schedule()
    logged = [trainer.train_step(make_groups(seed=s, version=s))["lr"] for s in range(3)]
    assert logged == pytest.approx([schedule.at(s) for s in range(3)])
    assert logged[0] == pytest.approx(1e-3 / 2)


def test_a_resumed_trainer_continues_the_schedule(tiny_model_dir, make_groups, tmp_path):
    unstopped = Trainer.from_pretrained(tiny_model_dir, _config())
    for s in range(3):
        unstopped.train_step(make_groups(seed=s, version=s))
    folder = unstopped.save_checkpoint(tmp_path / "ckpt", {})
    resumed, _ = Trainer.resume(folder, _config())
    for s in range(3, 7):
        groups = make_groups(seed=s, version=s)
        expected = unstopped.train_step(groups)["lr"]
        got = resumed.train_step(groups)["lr"]
        assert got == expected == pytest.approx(_config().schedule().at(s))
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
