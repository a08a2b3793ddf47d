"""A reward model's folder checked before a run (kind, one label, safetensors only) and
its scores: a batch scores as its texts one by one, a judge's number is parsed, and a
classifier set by hand scores exactly as the `exact` verifier on one-character answers."""

import json
import math
import shutil

import pytest
from reward_models import save_classifier, save_exact_classifier, save_judge

from dorarl.errors import UserInputError
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.reward_model import RewardModel, RewardModelSpec, check_folder, parse_score
from dorarl.tasks.rewards import exact_match


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("rm"))


def test_a_classifier_and_a_causal_lm_are_told_apart(classifier, tmp_path):
    judge = save_judge(tmp_path / "judge")
    assert check_folder(classifier) == "classifier" and check_folder(judge) == "judge"
    assert check_folder(classifier, "classifier") == "classifier"
    with pytest.raises(
        UserInputError, match="task.reward_model_kind: judge asked, but .* holds a classifier"
    ):
        check_folder(classifier, "judge")


def test_a_folder_that_is_no_reward_model_is_refused_naming_the_key(classifier, tmp_path):
    with pytest.raises(UserInputError, match="^task.reward_model: .* is not a folder"):
        check_folder(tmp_path / "missing")
    pickled = tmp_path / "pickled"
    shutil.copytree(classifier, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(UserInputError, match="holds only .bin weights"):
        check_folder(pickled)
    two = tmp_path / "two_labels"
    shutil.copytree(classifier, two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError, match="classifier of 2 labels; a reward model has one"):
        check_folder(two)
    config["architectures"] = ["LlamaModel"]
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError, match="names LlamaModel; expected a \\*ForSequence"):
        check_folder(two)


def test_a_batch_scores_as_its_texts_one_by_one(classifier, single_thread):
    model = RewardModel(RewardModelSpec(str(classifier)))
    pairs = [("a1b2=", "a11b23"), ("c4=", ""), ("a9b9c9d9=", "a99")]
    batch = model.score(pairs)
    alone = [model.score([pair])[0] for pair in pairs]
    assert all(isinstance(x, float) and math.isfinite(x) for x in batch)
    assert batch == pytest.approx(alone, abs=1e-5) and len(set(batch)) == 3


def test_a_judge_writes_a_number_or_gives_no_score(tmp_path, single_thread):
    assert parse_score(" 0.75 because") == 0.75 and parse_score("-1") == -1.0
    assert math.isnan(parse_score("good"))
    judge = RewardModel(RewardModelSpec(str(save_judge(tmp_path / "judge"))))
    scores = judge.score([("1+1=", "2"), ("2+2=", "5")])
    assert len(scores) == 2 and all(isinstance(x, float) for x in scores)


def test_the_hand_set_classifier_scores_as_the_exact_verifier_on_every_character(
    tmp_path, single_thread
):
    tokenizer = build_char_tokenizer()
    target = "7"
    model = RewardModel(
        RewardModelSpec(
            str(save_exact_classifier(tmp_path / "exact", tokenizer.convert_tokens_to_ids(target)))
        )
    )
    responses = [tokenizer.decode([i], skip_special_tokens=True) for i in range(len(tokenizer))]
    scores = model.score([("a3b4=", r) for r in responses])
    assert scores == [exact_match(r, target) for r in responses]
    assert sum(scores) == 1.0
