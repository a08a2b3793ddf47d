"""LoRA training (trainer.lora.*): only the adapters train, the engines get peft's merged
weights, checkpoints are peft adapter folders that resume, world size 2 equals one process."""

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import _make_groups  # noqa: E402
from ranks import run_ranks  # noqa: E402

from dorarl.config import ConfigError, load_config  # noqa: E402
from dorarl.errors import UserInputError  # noqa: E402
from dorarl.jobs.config import TrainConfig  # noqa: E402
from dorarl.trainer import Trainer, TrainerConfig  # noqa: E402
from dorarl.trainer.config import LoraConfig  # noqa: E402
from dorarl.trainer.sharded import ShardedTrainer  # noqa: E402

VOCAB = 100


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings (as SmolLM2), vocabulary as the made-up groups'."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _config(**lora) -> TrainerConfig:
    return TrainerConfig(
        lr=1e-6,  # the base's rate: lora.lr must be the one used
        adam_eps=1e-6,
        max_grad_norm=1.0,
        micro_batch_tokens=40,
        lora=LoraConfig(**{"rank": 4, "alpha": 8.0, "lr": 1e-2, **lora}),
    )


def _steps(trainer: Trainer, first: int, count: int) -> list[tuple[float, float]]:
    metrics = [trainer.train_step(_make_groups(seed=first + i)) for i in range(count)]
    return [(m["loss"], m["grad_norm"]) for m in metrics]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 40).remainder(VOCAB).unsqueeze(0)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_step_trains_the_adapters_only(base_dir):
    trainer = Trainer.from_pretrained(base_dir, _config())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.accumulate_gradients(_make_groups(seed=1))
    params = dict(trainer.model.named_parameters())
    assert all(("lora_" in n) == p.requires_grad for n, p in params.items())
    assert all(p.grad is None for n, p in params.items() if "lora_" not in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())
    trainer.optimizer.zero_grad(set_to_none=True)
    _steps(trainer, 1, 2)
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-2
    changed = {k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)
    assert trainer.version == 2


def test_activation_checkpointing_gives_the_same_adapter_gradients(base_dir):
    grads = []
    for checkpointing in (False, True):
        config = _config()
        config.activation_checkpointing = checkpointing
        trainer = Trainer.from_pretrained(base_dir, config)
        trainer.accumulate_gradients(_make_groups(seed=1))
        named = trainer.model.named_parameters()
        grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_engines_get_peft_merge_and_unload(base_dir):
    trainer = Trainer.from_pretrained(base_dir, _config())
    _steps(trainer, 0, 2)
    sent = trainer.named_tensors()
    merged = copy.deepcopy(trainer.peft).merge_and_unload().state_dict()
    base = LlamaForCausalLM.from_pretrained(base_dir).state_dict()
    assert sent.keys() == merged.keys() == base.keys()  # the base's HF names
    for name, tensor in merged.items():
        torch.testing.assert_close(sent[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], base[q])  # the adapters are in what is sent
    on_device = trainer.named_tensors(on_device=True)
    assert all(torch.equal(on_device[n], sent[n]) for n in sent)


def test_engines_holding_adapters_get_them_by_pefts_names(base_dir):
    trainer = Trainer.from_pretrained(base_dir, _config())
    _steps(trainer, 0, 1)
    sent = trainer.adapter_tensors()
    want = get_peft_model_state_dict(trainer.peft)
    assert sent.keys() == want.keys() and len(sent) == 2 * 7 * 2  # A, B; 7 projections, 2 layers
    assert all(torch.equal(sent[n], want[n]) for n in want)
    assert all(
        t.device.type == "cpu" and t.data_ptr() != want[n].data_ptr() for n, t in sent.items()
    )


def test_a_checkpoint_is_an_adapter_folder_peft_loads(base_dir, tmp_path):
    trainer = Trainer.from_pretrained(base_dir, _config())
    _steps(trainer, 0, 2)
    folder = trainer.save_checkpoint(tmp_path / "version_00002", {"position": [1]})
    assert not (folder / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), folder)
    torch.testing.assert_close(_logits(loaded), _logits(trainer.peft), rtol=1e-5, atol=1e-6)


def test_resume_continues_the_run(base_dir, tmp_path):
    trainer = Trainer.from_pretrained(base_dir, _config())
    _steps(trainer, 0, 2)
    folder = trainer.save_checkpoint(tmp_path / "version_00002", {"position": [1]})
    want = _steps(trainer, 2, 2)
    resumed, extra = Trainer.resume(folder, _config())
    assert extra == {"position": [1]} and resumed.version == 2 and resumed.optimizer_steps == 2
    assert resumed.base_path == str(base_dir.resolve())
    assert _steps(resumed, 2, 2) == want
    sent, want_sent = resumed.named_tensors(), trainer.named_tensors()
    assert all(torch.equal(sent[n], want_sent[n]) for n in want_sent)


def test_resume_refuses_a_mismatched_lora_setting(base_dir, tmp_path):
    trainer = Trainer.from_pretrained(base_dir, _config())
    lora_folder = trainer.save_checkpoint(tmp_path / "lora", {})
    full = Trainer.from_pretrained(base_dir, TrainerConfig()).save_checkpoint(tmp_path / "full")
    with pytest.raises(UserInputError, match=r"^trainer\.lora\.rank: .* holds LoRA adapters"):
        Trainer.resume(lora_folder, TrainerConfig())
    with pytest.raises(UserInputError, match=r"^trainer\.lora\.rank: .* full-weight checkpoint"):
        Trainer.resume(full, _config())
    with pytest.raises(UserInputError, match=r"^trainer\.lora\.rank: 8 differs from 4"):
        Trainer.resume(lora_folder, _config(rank=8))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.lora.rank=-1", "trainer.lora.rank: must be >= 0"),
        ("trainer.lora.dropout=1", "trainer.lora.dropout: must be in [0, 1)"),
        ("trainer.lora.alpha=0", "trainer.lora.alpha: must be > 0"),
        ("trainer.lora.lr=0", "trainer.lora.lr: must be > 0"),
        ("trainer.lora.target_modules=[lm_head]", "trainer.lora.target_modules: lm_head"),
        ("trainer.lora.rnak=4", "unknown config key trainer.lora.rnak"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        load_config(TrainConfig, overrides=[override])


def test_target_modules_choose_the_adapted_layers(base_dir):
    every = Trainer.from_pretrained(base_dir, _config()).model.state_dict()
    assert {k.split(".")[-4] for k in every if ".lora_A." in k} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    some = Trainer.from_pretrained(base_dir, _config(target_modules=["q_proj", "v_proj"]))
    adapted = {k.split(".")[-4] for k in some.model.state_dict() if ".lora_A." in k}
    assert adapted == {"q_proj", "v_proj"}


def test_a_target_the_model_lacks_names_the_key(base_dir):
    with pytest.raises(UserInputError, match=r"^trainer\.lora\.target_modules: "):
        Trainer.from_pretrained(base_dir, _config(target_modules=["qkv_proj"]))


def test_the_default_is_full_weight_training(base_dir):
    # The rate is dorarl train's to choose by the model (trainer.lr unset); given here.
    config = load_config(TrainConfig, overrides=["trainer.lr=2e-4"]).trainer
    assert config.lora.rank == 0 and not config.lora.enabled
    trainer = Trainer.from_pretrained(base_dir, config)
    assert trainer.peft is None and all(p.requires_grad for p in trainer.model.parameters())


def _sharded_lora(group, folder, checkpoint):
    trainer = ShardedTrainer.from_pretrained_group(folder, _config(), group)
    history = _steps(trainer, 0, 3)
    adapters = trainer.adapter_tensors()  # gathered without the base
    trainer.save_checkpoint(checkpoint, {})
    resumed, _ = ShardedTrainer.resume(checkpoint, _config(), group=group)
    weights = trainer.named_tensors()
    return history, weights, _steps(resumed, 3, 1), resumed.named_tensors(), adapters


def test_world_size_two_equals_one_process(base_dir, tmp_path):
    checkpoint = tmp_path / "version_00003"
    history, weights, resumed, resumed_weights, adapters = run_ranks(
        _sharded_lora, 2, base_dir, checkpoint
    )
    single = Trainer.from_pretrained(base_dir, _config())
    want = _steps(single, 0, 3)
    for (loss, norm), (want_loss, want_norm) in zip(history, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    _assert_close(weights, single.named_tensors())
    _assert_close(adapters, single.adapter_tensors())
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), checkpoint)
    torch.testing.assert_close(_logits(loaded), _logits(single.peft), rtol=1e-4, atol=1e-5)
    (loss, norm), (want_loss, want_norm) = resumed[0], _steps(single, 3, 1)[0]
    assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-4)
    _assert_close(resumed_weights, single.named_tensors())


def _assert_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        error = float((got[name] - want[name]).norm() / want[name].norm())
        assert error <= rel, f"{name}: relative error {error:.2e}"
