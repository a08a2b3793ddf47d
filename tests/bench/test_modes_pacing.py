"""Device emulation: a paced worker never returns before its device time, and every step whose
real compute exceeded the pace is counted; engine and trainer workers pace the work they did."""

import time

import pytest

from dorarl.bench.calibrate import Calibration, PaceRule, choose_pace
from dorarl.config import ConfigError
from dorarl.data import Group, Sample
from dorarl.engine import EngineConfig, SamplingParams
from dorarl.record.pacing import DeviceModel, Pacer, PaceStats
from dorarl.runtime.workers.engine_worker import EngineWorker, NewRequest
from dorarl.runtime.workers.trainer_worker import TrainerWorker
from dorarl.trainer import TrainerConfig


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("device_s", [0.0005, 0.004, 0.02])
@pytest.mark.parametrize("work_s", [0.0, 0.002])
def test_paced_call_never_returns_before_its_device_time(device_s, work_s):
    pacer = Pacer()
    for _ in range(5):
        started = time.perf_counter()
        _busy(work_s)
        compute = pacer.finish(started, device_s)
        assert time.perf_counter() - started >= device_s
        assert compute >= work_s
    stats = pacer.take()
    assert stats.steps == 5 and stats.paced_s == pytest.approx(5 * device_s)
    assert pacer.stats.steps == 0  # take() starts a fresh count


def test_over_pace_steps_are_counted_and_keep_their_real_time(monkeypatch):
    # what the pacer decides, not wall-clock margins (which a loaded CPU breaks): an
    # over-pace step returns without sleeping, an under-pace one sleeps to its deadline
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    pacer = Pacer()
    started = time.perf_counter()
    _busy(0.03)
    over = pacer.finish(started, 0.01)
    assert slept == [] and over >= 0.03
    started = time.perf_counter()
    pacer.finish(started, 0.01)
    assert slept and time.perf_counter() - started >= 0.01
    stats = pacer.stats
    assert stats.steps == 2 and stats.over == 1 and stats.over_share == 0.5
    assert stats.excess_s == pytest.approx(over - 0.01)
    assert stats.worst_ratio == pytest.approx(over / 0.01)


def test_pace_stats_merge_and_dict():
    a, b = PaceStats(), PaceStats()
    a.record(0.01, 0.02)
    b.record(0.05, 0.02)
    a.merge(b)
    d = a.to_dict()
    assert d["steps"] == 2 and d["over"] == 1 and d["over_share"] == 0.5
    assert d["compute_s"] == pytest.approx(0.06) and d["worst_ratio"] == pytest.approx(2.5)


def test_device_model_arithmetic_and_validation():
    dev = DeviceModel(decode_step_s=0.01, kv_token_s=1e-6, prefill_token_s=1e-4,
                      train_fixed_s=0.5, train_token_s=1e-3)  # fmt: skip
    assert dev.engine_step_s(100, 1000) == pytest.approx(0.01 + 0.01 + 0.001)
    assert dev.train_step_s(1000) == pytest.approx(1.5)
    assert DeviceModel.from_dict(dev.to_dict()) == dev
    with pytest.raises(ConfigError, match="decode_step_s"):
        DeviceModel(decode_step_s=0.0).validate()
    with pytest.raises(ConfigError, match="train_token_s"):
        DeviceModel(decode_step_s=0.01, train_token_s=-1.0).validate()


def test_paced_engine_worker_charges_prefill_and_decode(tiny_model_dir):
    dev = DeviceModel(decode_step_s=0.004, prefill_token_s=0.0005)
    worker = EngineWorker(
        0, str(tiny_model_dir), EngineConfig(max_num_seqs=4, max_model_len=64), pace=dev
    )
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13]]
    worker.add(
        [
            NewRequest(f"r{i}", p, SamplingParams(target_len=3, seed=i))
            for i, p in enumerate(prompts)
        ]
    )
    started = time.perf_counter()
    report = worker.run(max_steps=10, until_finished=False)
    wall = time.perf_counter() - started
    assert report.steps == 3 and len(report.finished) == 3  # one prefill step, two decode steps
    prefill_beyond_rows = sum(len(p) for p in prompts) - len(prompts)
    expected = 3 * dev.decode_step_s + prefill_beyond_rows * dev.prefill_token_s
    assert report.pace.steps == 3
    assert report.pace.paced_s == pytest.approx(expected)
    assert wall >= expected
    assert worker.run(max_steps=4).pace.steps == 0  # nothing left: no step, nothing paced


def test_unpaced_engine_worker_reports_no_pace(tiny_model_dir):
    worker = EngineWorker(0, str(tiny_model_dir), EngineConfig(max_num_seqs=2, max_model_len=64))
    worker.add([NewRequest("r", [1, 5, 6], SamplingParams(target_len=2, seed=0))])
    assert worker.run(max_steps=4).pace is None


def test_paced_trainer_step_lasts_its_device_time(tiny_model_dir):
    dev = DeviceModel(decode_step_s=0.01, train_fixed_s=0.05, train_token_s=0.002)
    worker = TrainerWorker(str(tiny_model_dir), TrainerConfig(lr=1e-4), pace=dev)
    samples = [Sample(0, i, 0, [1, 5, 6], [7] * (4 + i), [-1.0] * (4 + i), [0] * (4 + i),
                      reward=float(i)) for i in range(2)]  # fmt: skip
    started = time.perf_counter()
    metrics = worker.train_step([Group(0, 0, 0, samples)])
    tokens = 2 * 3 + 4 + 5
    assert metrics["train_paced_s"] == pytest.approx(0.05 + 0.002 * tokens)
    assert time.perf_counter() - started >= metrics["train_paced_s"]
    assert metrics["train_over_pace"] == int(metrics["train_compute_s"] > metrics["train_paced_s"])


def _cal(decode=0.002, train=0.3) -> Calibration:
    return Calibration(decode, 16, 40, 2e-5, 0.1 * train, 0.9 * train / 1000, 1000, train)


@pytest.mark.parametrize(
    ("decode", "train", "sync_steps", "bound"),
    [(0.002, 0.3, 500.0, "cpu_share"), (0.002, 3.0, 20.0, "train_margin"),
     (0.01, 0.001, 500.0, "cpu_share"), (0.002, 0.3, 20.0, "train_margin")],
)  # fmt: skip
def test_pace_meets_margin_cpu_share_and_train_ratio(decode, train, sync_steps, bound):
    cal, rule = (
        _cal(decode, train),
        PaceRule(margin=2.0, cpu_share=0.5, cores=2, train_ratio=0.5, min_decode_s=0.0),
    )
    dev, notes = choose_pace(
        cal, rule, num_instances=4, kv_pool_tokens=5000, sync_rollout_steps=sync_steps
    )
    t = dev.train_step_s(cal.train_tokens)
    assert dev.decode_step_s >= rule.margin * cal.decode_step_s * 0.999
    assert t >= rule.margin * cal.train_step_s * 0.999
    assert dev.prefill_token_s == pytest.approx(rule.margin * cal.prefill_token_s)
    demand = 4 * cal.decode_step_s / dev.decode_step_s + cal.train_step_s / t
    assert demand <= rule.cpu_share * rule.cores * 1.001
    assert notes["cpu_demand_cores"] == pytest.approx(demand)
    assert t == pytest.approx(0.5 * sync_steps * dev.decode_step_s)  # the stated ratio
    assert notes["bound"] == bound
    assert dev.kv_token_s * 5000 == pytest.approx(rule.kv_share * dev.decode_step_s)


def test_decode_margin_binds_when_alone():
    dev, notes = choose_pace(_cal(0.002, 0.001), PaceRule(cores=64, min_decode_s=0.0),
                             num_instances=1, kv_pool_tokens=1, sync_rollout_steps=500)  # fmt: skip
    assert notes["bound"] == "decode_margin" and dev.decode_step_s == pytest.approx(0.004)


def test_a_fast_machine_still_gets_the_least_decode_time():
    # real compute so small that every other bound asks for a sub-ms step: the floor holds,
    # so per-call runtime latency stays small beside a step, as on an accelerator
    dev, notes = choose_pace(_cal(0.0001, 0.001), PaceRule(cores=64, min_decode_s=0.02),
                             num_instances=1, kv_pool_tokens=1, sync_rollout_steps=500)  # fmt: skip
    assert notes["bound"] == "min_decode" and dev.decode_step_s == pytest.approx(0.02)
    assert dev.train_step_s(1000) == pytest.approx(0.5 * 500 * 0.02)  # the train ratio holds


def test_pace_grows_with_instances_sharing_the_cores():
    cal = _cal()
    rule = PaceRule(cores=2, min_decode_s=0.0)
    few, _ = choose_pace(cal, rule, num_instances=1, kv_pool_tokens=1, sync_rollout_steps=500)
    many, _ = choose_pace(cal, rule, num_instances=16, kv_pool_tokens=1, sync_rollout_steps=500)
    assert many.decode_step_s > few.decode_step_s


def test_pace_rule_names_bad_keys():
    with pytest.raises(ConfigError, match="margin"):
        PaceRule(margin=0.5).validate()
    with pytest.raises(ConfigError, match="train_ratio"):
        PaceRule(train_ratio=0.0).validate()
    with pytest.raises(ConfigError, match="cpu_share"):
        PaceRule(cpu_share=1.5).validate()
    with pytest.raises(ConfigError, match="min_decode_s"):
        PaceRule(min_decode_s=-1.0).validate()
