"""running_sum: answers, exact-match reward, held-out split, long-tailed lengths, tokenizer."""

import random
import statistics

import numpy as np
from transformers import AutoTokenizer

from dorarl.tasks import make_task, score
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.running_sum import format_prompt, running_answer


def test_answer_shows_each_item_and_the_running_sum_mod_10():
    assert format_prompt([3, 1, 4, 1, 5]) == "a3b1c4d1e5="
    assert running_answer([3, 1, 4, 1, 5], 10) == "a33b14c48d19e54"
    assert running_answer([9, 9], 10) == "a99b98"
    assert running_answer([9, 9], 7) == "a92b94"


def test_reward_is_exact_match_up_to_the_first_stop_token():
    task = make_task("running_sum", seed=0, n_train=50, n_eval=10)
    prompt = task.eval_prompts()[0]
    ids = task.answer_ids(prompt)
    eos = task.tokenizer.eos_token_id
    assert ids[-1] == eos and task.reward(prompt, ids) == 1.0
    assert task.reward(prompt, ids + [5, 6, 7]) == 1.0  # after the stop: ignored
    assert task.reward(prompt, ids[:-2] + [eos]) == 0.0  # last sum missing
    wrong = list(ids)
    wrong[2] = task.tokenizer.convert_tokens_to_ids("7" if prompt.answer[2] != "7" else "8")
    assert task.reward(prompt, wrong) == 0.0
    assert task.reward(prompt, [eos]) == 0.0 and task.reward(prompt, []) == 0.0
    assert score(task, prompt, ids) == (1.0, None)


def test_prompts_are_deterministic_for_a_seed_and_differ_across_seeds():
    a = make_task("running_sum", seed=3, n_train=200, n_eval=50)
    b = make_task("running_sum", seed=3, n_train=200, n_eval=50)
    c = make_task("running_sum", seed=4, n_train=200, n_eval=50)
    assert a.train_prompts() == b.train_prompts() and a.eval_prompts() == b.eval_prompts()
    assert [p.text for p in a.train_prompts()] != [p.text for p in c.train_prompts()]


def test_eval_set_is_held_out_and_ids_are_unique():
    task = make_task("running_sum", seed=0, n_train=3000, n_eval=300)
    train_texts = {p.text for p in task.train_prompts()}
    for p in task.eval_prompts():
        assert len(p.answer) // 3 < 4 or p.text not in train_texts
    ids = [p.prompt_id for p in task.train_prompts() + task.eval_prompts()]
    assert len(ids) == len(set(ids))
    rng = random.Random(0)
    eval_texts = {p.text for p in task.eval_prompts() if len(p.answer) >= 12}
    for lengths in ("task", "uniform"):
        for _ in range(1000):
            prompt, answer_ids = task.sample_example(rng, lengths)
            assert prompt.text not in eval_texts
            assert task.reward(prompt, answer_ids) == 1.0


def test_correct_answer_lengths_are_long_tailed():
    task = make_task("running_sum", seed=0)
    lengths = [len(task.answer_ids(p)) for p in task.train_prompts()]
    median = statistics.median(lengths)
    p99 = float(np.percentile(lengths, 99))
    assert p99 / median >= 5.0, (median, p99)
    assert max(lengths) <= task.max_new_tokens


def test_char_tokenizer_round_trips_and_loads_offline(tmp_path):
    tok = build_char_tokenizer()
    text = "a3b1=\n\\frac{1}{2} x"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids[1:]) == text
    assert tok.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>"]) == [0, 1, 2, 3]
