"""The evaluator checks a version's weights as engines check theirs: what arrives against the
trainer's manifest, and full weights once copied into its engine; weights unlike the
manifest refuse the evaluation in one line (never scored), weights sent without one too,
and the version that matches is scored."""

import pytest
import torch

from dorarl.engine import EngineConfig
from dorarl.runtime.transfer.weight_layout import WeightsRefused, build_manifest, wire_tensors
from dorarl.runtime.workers.eval_worker import EvalWorker
from dorarl.tasks import make_task


@pytest.fixture(scope="module")
def evaluator(tiny_model_dir):
    config = EngineConfig(max_num_seqs=4, max_model_len=128)
    return EvalWorker(str(tiny_model_dir), config, make_task("running_sum", seed=0), 2)


def _version(evaluator, version: int):
    """A trained version's full weights (the base, nudged) and the trainer's manifest."""
    named = {n: t.clone() for n, t in evaluator.engine.state_dict().items()}
    for tensor in named.values():
        tensor.add_(1e-3 * version)
    wire = wire_tensors(named, torch.float32)
    return wire, build_manifest(wire, version, bucket_bytes=1 << 16)


def test_weights_unlike_the_trainers_manifest_are_refused_not_scored(evaluator):
    weights, manifest = _version(evaluator, 3)
    name = next(iter(weights))
    tampered = {n: t.clone() for n, t in weights.items()}
    tampered[name].view(-1)[0] += 1.0
    with pytest.raises(WeightsRefused) as refused:
        evaluator.evaluate(tampered, 3, manifest)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"weights of version 3 refused on the evaluator: tensor {name!r}")
    with pytest.raises(WeightsRefused, match="no manifest to check"):
        evaluator.evaluate(weights, 3, None)
    result = evaluator.evaluate(weights, 3, manifest)
    assert result["version"] == 3 and "accuracy" in result


def test_a_copy_that_lands_unlike_the_manifest_is_refused(evaluator, monkeypatch):
    """What the engine holds after the copy is checked too: a copy that corrupts one value
    (here the engine's load, made to) refuses the evaluation."""
    weights, manifest = _version(evaluator, 4)
    engine = evaluator.engine
    load = engine.load_weights

    def corrupting(named, version):
        load(named, version)
        engine.model.weights.norm.view(-1)[0] += 1.0

    monkeypatch.setattr(engine, "load_weights", corrupting)
    with pytest.raises(WeightsRefused, match=r"^weights of version 4 refused on the evaluator "
                       r"after the copy: tensor 'model.norm.weight'"):  # fmt: skip
        evaluator.evaluate(weights, 4, manifest)
