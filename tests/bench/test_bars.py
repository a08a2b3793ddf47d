"""The staleness ceiling of `dorarl bench modes` (`dorarl.bench.bars`): per-batch arithmetic,
and dora on the bench's own shape, in the simulator, held to it."""

import pytest

from dorarl.bench.bars import check_bars, staleness_ceiling
from dorarl.bench.modes import QUICK, ModesConfig
from dorarl.config import load_config
from dorarl.report.figures import mode_figures
from dorarl.sim.runtime import SimRuntime
from dorarl.simulate.validate import local_from_bench


def test_batches_of_unequal_rollout_lower_the_ceiling_below_the_mean_one():
    # K=1, T = 1 s, R alternating 0 and 2 s (mean 1 s): max(T, (R+T)/2) would be a step every
    # 1 s (2x sync). Step 1 starts 2 s after the end of step -1 (the warm-up: 0), step 2 at
    # the end of step 1 (3 s; its batch took 0 s from the end of step 0), step 3 2 s after
    # the end of step 1 (5 s): 6 s for 4 steps against sync's 8.
    most, least = staleness_ceiling(1, [0.0, 2.0, 0.0, 2.0], [1.0] * 4)
    assert most == pytest.approx(8 / 6) and least == pytest.approx(2 / 6)


def test_from_k2_on_a_slow_group_may_trail_its_batch_so_the_means_bound_it():
    # R mean 1 s, T 1 s: a step every max(T, (R+T)/4) = 1 s, half sync's 2 s, never waiting
    assert staleness_ceiling(3, [0.0, 2.0, 0.0, 2.0], [1.0] * 4) == pytest.approx((2.0, 0.0))


def test_without_staleness_the_ceiling_is_sync_itself():
    rollout, train = [1.0, 3.0, 0.5, 2.0], [0.5, 1.5, 1.0, 0.7]
    most, least = staleness_ceiling(0, rollout, train)
    assert most == pytest.approx(1.0)
    assert least == pytest.approx(sum(rollout) / (sum(rollout) + sum(train)))


def _bench_in_sim(overrides: list[str]) -> dict[str, dict]:
    """Every run of `dorarl bench modes` (its schedule per mode, seed and steps) on the device
    model and workload of the bench run recorded for the `local` preset: figures per run."""
    cfg = load_config(ModesConfig, None, overrides)
    local = local_from_bench()
    figures = {}
    for name, mode, k in cfg.modes():
        sim = SimRuntime(
            cfg.controller(mode, k), local.cost, local.lengths, seed=cfg.seed, trace=False,
            trajectories=False,
        )  # fmt: skip
        figures[name] = mode_figures(sim.run().steps, cfg.warmup_steps, cfg.instances)
        figures[name]["K"] = k
    return figures


@pytest.mark.parametrize("overrides", [[], QUICK], ids=["default", "quick"])
def test_dora_on_the_bench_shape_reaches_its_staleness_ceiling(overrides):
    """K=1 trains every group at staleness 1 and waits for nothing but the bound: each step
    starts once the batch published two steps back has its slowest group done, or the
    training before it has ended. So it sits on its ceiling; a policy that left instances
    idle or held a version's dispatch back would fall below it."""
    figures = _bench_in_sim(overrides)
    k1 = {b["bar"]: b for b in check_bars(figures, "dora_k1")}
    speedup = k1["dora_k1 tokens/s / sync"]
    assert 0.95 * speedup["k_bound"] <= speedup["value"] <= 1.03 * speedup["k_bound"]
    share = k1["dora_k1 rollout-only share"]
    assert share["k_bound"] - 0.03 <= share["value"] <= share["k_bound"] + 0.03
    k3 = {b["bar"]: b for b in check_bars(figures, "dora_k3")}
    assert k3["dora_k3 tokens/s / sync"]["value"] >= 0.9 * k3["dora_k3 tokens/s / sync"]["k_bound"]
