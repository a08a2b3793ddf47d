"""Held-out evaluation: greedy accuracy, and mean@k / unbiased pass@k over seeded samples."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dorarl.tasks import make_task
from dorarl.tasks.assets import BASE_MODEL_DIR
from dorarl.tasks.evaluate import EvalSampling, evaluate, pass_at_k, pass_levels, sample_seed


@given(st.data())
def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_correct_sample(data):
    n = data.draw(st.integers(1, 8))
    correct = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    flags = [True] * correct + [False] * (n - correct)
    subsets = list(itertools.combinations(flags, k))
    assert pass_at_k(n, correct, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


def test_pass_at_k_hand_values_and_levels():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 1, 5) == 1.0
    assert pass_levels(8) == [2, 4, 8] and pass_levels(6) == [2, 4, 6] and pass_levels(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_sample_seeds_are_fixed_per_prompt_and_index():
    assert sample_seed(0, 7, 2) == sample_seed(0, 7, 2)
    seeds = {sample_seed(s, p, j) for s in range(2) for p in range(20) for j in range(8)}
    assert len(seeds) == 2 * 20 * 8 and all(0 <= x < 2**63 for x in seeds)


@pytest.fixture(scope="module")
def engine_and_task():
    from dorarl.engine import Engine, EngineConfig

    engine = Engine.from_pretrained(
        BASE_MODEL_DIR, EngineConfig(max_num_seqs=64, max_model_len=128)
    )
    return engine, make_task("running_sum", seed=0)


def test_samples_add_mean_and_pass_at_k_and_leave_greedy_as_it_was(engine_and_task, single_thread):
    engine, task = engine_and_task
    prompts = task.eval_prompts()[:24]
    greedy = evaluate(engine, task, prompts)
    assert set(greedy) == {"accuracy", "n", "mean_len", "reward_errors"}
    sampling = EvalSampling(samples=4, temperature=1.0, seed=3)
    sampled = evaluate(engine, task, prompts, sampling=sampling)
    assert {k: sampled[k] for k in greedy} == greedy
    assert 0.0 <= sampled["mean@4"] <= sampled["pass@2"] <= sampled["pass@4"] <= 1.0
    assert sampled["pass@4"] > sampled["mean@4"]  # some prompts are solved by some samples only
    assert evaluate(engine, task, prompts, sampling=sampling) == sampled  # seeded: repeatable
    other = evaluate(engine, task, prompts, sampling=EvalSampling(samples=4, seed=4))
    assert other != sampled


def test_near_zero_temperature_samples_score_as_greedy(engine_and_task, single_thread):
    engine, task = engine_and_task
    prompts = task.eval_prompts()[:24]
    result = evaluate(engine, task, prompts, sampling=EvalSampling(samples=2, temperature=1e-4))
    assert result["mean@2"] == result["pass@2"] == result["accuracy"]
