"""The reward model beside rollout: its score mixed into a sample's reward (a named part
beside the verifier's), samples batched as they come (one batch out at a time), and an
actor that dies or hangs mid-batch replaced, its batch scored again by the new one."""

import sys
import time

import pytest
import ray
from ray import cloudpickle
from reward_models import save_classifier

from dorarl.data import Sample
from dorarl.errors import WorkerFailed
from dorarl.record import Recorder
from dorarl.runtime.reward_scoring import RewardModelScoring, failed, mixed
from dorarl.runtime.workers.reward_worker import RewardWorker
from dorarl.tasks.reward_model import RewardModel, RewardModelSpec

# The test workers below travel to Ray's workers by value (they cannot import this file).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPTS = ["a1=", "b2c3=", "d4e5f6=", "g7=", "h8i9=", "j0=", "k1l2="]


def _sample(i: int, reward: float = 0.0, **kw) -> Sample:
    return Sample(0, i, i, [1], [4], reward=reward, **kw)


def test_the_models_score_is_mixed_in_as_a_part_beside_the_verifiers():
    verifier_right = _sample(0, 1.0)
    assert mixed(verifier_right, 0.25, 1.0).reward == 0.25  # the model's score alone
    assert mixed(verifier_right, 0.25, 0.0).reward == 1.0  # the verifier's alone, score kept
    half = mixed(verifier_right, 0.25, 0.5)
    assert half.reward == 0.625 and half.reward_parts == {"verifier": 1.0, "reward_model": 0.25}
    users = mixed(_sample(1, 2.0, reward_parts={"hit": 1.0, "brevity": 1.0}), -1.0, 0.5)
    assert users.reward == 0.5 and users.reward_parts == {
        "hit": 1.0, "brevity": 1.0, "reward_model": -1.0,
    }  # fmt: skip
    broken = mixed(_sample(2, 0.0, reward_error="ValueError: x"), 1.0, 0.5)
    assert broken.reward == 0.5 and broken.reward_parts == {"reward_model": 1.0}
    assert broken.reward_error == "ValueError: x"  # still counted as the verifier's error
    nothing = failed(verifier_right, "gave no score (nan)")
    assert nothing.reward == 0.0 and nothing.reward_error == "reward model: gave no score (nan)"


class _Recorded:
    """What the scoring tells the recorder."""

    def __init__(self):
        self.batches, self.restarts, self.deaths = [], 0, []

    def reward_model_batch(self, size, seconds, start, end):
        self.batches.append(size)

    def reward_model_restarted(self, rescored, now):
        self.restarts += 1

    def died(self, worker, cause, now):
        self.deaths.append(cause)


class _Actor:
    """A stand-in for the actor: answers with refs of the scores it is set to give."""

    def __init__(self):
        self.sent = []

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    @property
    def score(self):
        def send(pairs):
            self.sent.append(len(pairs))
            return ray.put(([float(len(p)) for p, _ in pairs], 0.01))

        return self._Method(send)


@pytest.mark.slow
def test_samples_wait_in_batches_of_what_finished_while_one_was_out(shared_ray):
    actor = _Actor()
    scoring = RewardModelScoring(
        RewardModelSpec("unused", mix=1.0, max_batch=3),
        lambda s: (PROMPTS[s.prompt_id], ""), _Recorded(), time.monotonic, lambda spec: actor,
    )  # fmt: skip
    scoring.actor = actor
    scoring.submit(0, [_sample(0)])  # goes out at once, alone
    scoring.submit(1, [_sample(i) for i in (1, 2, 3, 4)])  # wait: one batch is out
    assert actor.sent == [1] and scoring.pending == 5
    done = _drained(scoring, 5)
    assert actor.sent == [1, 3, 1]  # then whatever finished, up to max_batch
    assert [(iid, s.sample_index, s.reward) for iid, s in done] == [
        (0, 0, 3.0), (1, 1, 5.0), (1, 2, 7.0), (1, 3, 3.0), (1, 4, 5.0),
    ]  # fmt: skip
    assert scoring.recorder.batches == [1, 3, 1] and scoring.pending == 0


def _drained(scoring: RewardModelScoring, n: int, within_s: float = 120.0) -> list:
    done, deadline = [], time.monotonic() + within_s
    while len(done) < n:
        assert time.monotonic() < deadline, f"{len(done)} of {n} scored within {within_s} s"
        done += scoring.ready()
        time.sleep(0.01)
    return done


class _SlowWorker(RewardWorker):
    """The reward worker, slow on its batches (`delay_s` each): killed mid-batch surely."""

    delay_s = 3.0

    def score(self, pairs):
        time.sleep(self.delay_s)
        return super().score(pairs)


class _StuckWorker(RewardWorker):
    def score(self, pairs):
        time.sleep(3600)


@pytest.mark.slow
def test_a_reward_actor_killed_or_stuck_mid_batch_is_replaced_and_the_batch_rescored(
    shared_ray, tmp_path
):
    spec = RewardModelSpec(str(save_classifier(tmp_path / "rm")), mix=0.5, timeout_s=20.0)
    spawned = []

    def spawn(spec):
        kinds = [_SlowWorker, _StuckWorker, RewardWorker]  # in the order they are needed
        actor = ray.remote(num_cpus=0)(kinds[len(spawned)]).remote(spec)
        spawned.append(actor)
        return actor

    recorder = Recorder(None, mode="dora", k=1, num_instances=1, slots_per_instance=4)
    scoring = RewardModelScoring(
        spec, lambda s: (PROMPTS[s.prompt_id], "a1"), recorder, time.monotonic, spawn
    )
    scoring.start()
    samples = [_sample(i, float(i % 2)) for i in range(4)]
    scoring.submit(0, samples)
    time.sleep(0.5)  # the batch is in the slow worker's hands
    ray.kill(spawned[0])
    deadline = time.monotonic() + 30
    while not recorder.faults["reward_model_restarts"]:  # its death seen: the stuck one has it
        assert scoring.ready() == [] and time.monotonic() < deadline
        time.sleep(0.05)
    assert len(spawned) == 2 and "killed" in recorder.deaths[0]["cause"]
    scoring.batch.deadline = time.monotonic() + 1.0  # past its load, stuck past its bound
    done = _drained(scoring, 4, within_s=60.0)
    assert len(spawned) == 3 and recorder.faults["reward_model_restarts"] == 2
    expected = RewardModel(spec).score([(PROMPTS[i], "a1") for i in range(4)])
    assert [s.reward_parts["reward_model"] for _, s in done] == pytest.approx(expected, abs=1e-5)
    assert [s.reward for _, s in done] == pytest.approx(
        [0.5 * (i % 2) + 0.5 * x for i, x in enumerate(expected)], abs=1e-5
    )
    assert scoring.errors == 0 and recorder.faults["reward_model_batches"] == 1
    assert [d["worker"] for d in recorder.deaths] == ["the reward model"] * 2
    assert "no answer within 20 s" in recorder.deaths[1]["cause"]
    scoring.spec = RewardModelSpec(spec.path, restarts=2)  # spent: the next death stops the run
    ray.kill(spawned[2])
    time.sleep(0.5)
    scoring.submit(0, [_sample(5)])
    with pytest.raises(WorkerFailed, match="the reward model failed: .*replaced 2 times"):
        _drained(scoring, 1, within_s=30.0)
    scoring.close()
