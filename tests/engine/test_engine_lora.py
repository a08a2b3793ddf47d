"""Several LoRA adapters resident on one engine, decoded in the same steps, against peft.

Two peft adapters of different ranks (every decoder projection adapted, B drawn non-zero so
each adapter changes the model) and the base run in one batch; each request's greedy tokens
must be what HF + peft generates with its adapter, and its logprobs what peft's forward gives.
"""

import copy

import pytest
import torch
from engine_testlib import FAMILIES, greedy, prompts, run_all, tiny_config
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import LlamaForCausalLM

from dorarl.config import ConfigError
from dorarl.engine import Engine, EngineConfig
from dorarl.engine.linear import onednn_works
from dorarl.engine.lora import merge_adapter
from dorarl.errors import UserInputError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# adapter name -> (version, rank, alpha): different ranks exercise the zero padding
ADAPTERS = {"one": (7, 4, 8.0), "two": (9, 8, 4.0)}
BASE_VERSION = 3


@pytest.fixture(scope="module")
def peft_model():
    """A tiny Llama with two random adapters; returns (peft model, base weights)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_config("llama")).eval()
    base_weights = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = None
    for name, (_, rank, alpha) in ADAPTERS.items():
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if ".lora_B." in pname:  # peft starts B at zero: the adapter would change nothing
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval(), base_weights


def _engine(base_weights, **cfg) -> Engine:
    model_config = tiny_config("llama")
    defaults = dict(
        max_num_seqs=8, block_size=4, num_blocks=128, max_model_len=128,
        prefill_chunk_size=16, max_versions=3, max_lora_rank=8, prefix_cache="off",
    )  # fmt: skip
    config = EngineConfig(**{**defaults, **cfg})
    return Engine.from_hf_config(model_config, config, base_weights, BASE_VERSION)


def _load_both(engine: Engine, model) -> None:
    for name, (version, rank, alpha) in ADAPTERS.items():
        engine.load_adapter(
            version, get_peft_model_state_dict(model, adapter_name=name), alpha, rank
        )


def _reference(
    model, adapter: str | None, prompt: list[int], n: int
) -> tuple[list[int], torch.Tensor]:
    """peft's greedy tokens under `adapter` (None: adapters off) and their logprobs by its
    teacher-forced forward."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), _adapter(model, adapter):
        gen = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        tokens = gen[0, len(prompt) :].tolist()
        logits = model(input_ids=gen).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])
    return tokens, logprobs.squeeze(1)


class _adapter:
    """peft with one adapter active, or with its adapters disabled (None)."""

    def __init__(self, model, name: str | None) -> None:
        self.model, self.name = model, name

    def __enter__(self):
        if self.name is None:
            self.off = self.model.disable_adapter()
            self.off.__enter__()
        else:
            self.model.set_adapter(self.name)

    def __exit__(self, *exc):
        if self.name is None:
            self.off.__exit__(*exc)


def test_adapters_and_base_decode_together_as_peft_does(peft_model):
    model, base_weights = peft_model
    engine = _engine(base_weights)
    _load_both(engine, model)
    assert engine.resident_versions() == [BASE_VERSION, 7, 9]
    # two requests per version, prompts of different lengths, all added before the first step
    runs = [(None, 0), ("one", 1), ("two", 2), ("one", 3), ("two", 4), (None, 5)]
    batch = prompts([5, 9, 3, 20, 11, 7], seed=2)
    for (name, i), prompt in zip(runs, batch, strict=True):
        version = ADAPTERS[name][0] if name else None
        engine.add_request(f"r{i}", prompt, greedy(12), version=version)
    engine.step()
    assert engine.last_step.versions == 3  # the base's and both adapters' rows in one step
    outs = run_all(engine)
    for (name, i), prompt in zip(runs, batch, strict=True):
        out = outs[f"r{i}"]
        tokens, logprobs = _reference(model, name, prompt, 12)
        assert out.output_ids == tokens, f"request {i} under {name}"
        torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, atol=1e-4, rtol=0)
        assert set(out.versions) == {ADAPTERS[name][0] if name else BASE_VERSION}
    assert engine.stats().multi_version_steps > 0


@pytest.mark.skipif(not onednn_works(), reason="row independence is oneDNN's (linear.py)")
def test_a_request_computes_the_same_alone_or_beside_other_versions(peft_model):
    """Bit for bit: an adapter's rows and a base row, alone or in a step with other adapters;
    the base row also as on an engine that holds no adapters."""
    model, base_weights = peft_model
    batch = prompts([9, 5, 14], seed=3)
    mixed = _engine(base_weights)
    _load_both(mixed, model)
    for i, (prompt, version) in enumerate(zip(batch, [7, None, 9], strict=True)):
        mixed.add_request(f"r{i}", prompt, greedy(10), version=version)
    together = run_all(mixed)
    alone = _engine(base_weights)
    _load_both(alone, model)
    alone.add_request("r0", batch[0], greedy(10), version=7)
    plain = _engine(base_weights, max_versions=1, prefix_cache="on")
    plain.add_request("r1", batch[1], greedy(10))
    for out in (run_all(alone)["r0"], run_all(plain)["r1"]):
        assert out.output_ids == together[out.request_id].output_ids
        assert out.logprobs == together[out.request_id].logprobs


def test_an_adapter_request_migrates_to_an_engine_that_holds_its_version(peft_model):
    model, base_weights = peft_model
    source, target = _engine(base_weights), _engine(base_weights)
    _load_both(source, model)
    prompt = prompts([8], seed=4)[0]
    source.add_request("m", prompt, greedy(12), version=9)
    for _ in range(5):
        source.step()
    snap = source.export_request("m")
    assert snap.version == 9
    with pytest.raises(UserInputError, match="cannot be imported"):
        target.import_request(snap)
    _load_both(target, model)
    target.import_request(snap)
    out = run_all(target)["m"]
    tokens, logprobs = _reference(model, "two", prompt, 12)
    assert out.output_ids == tokens and set(out.versions) == {9}
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, atol=1e-4, rtol=0)


def test_an_adapter_on_some_projections_changes_only_their_slices():
    """q, v and up adapted: q's and v's columns of the fused q|k|v, up's of gate|up."""
    torch.manual_seed(5)
    base = LlamaForCausalLM(tiny_config("llama")).eval()
    base_weights = {k: v.detach().clone() for k, v in base.state_dict().items()}
    config = LoraConfig(r=6, lora_alpha=12.0, target_modules=["q_proj", "v_proj", "up_proj"])
    model = get_peft_model(base, config, adapter_name="some").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.3)
    engine = _engine(base_weights, max_versions=2)
    engine.load_adapter(4, get_peft_model_state_dict(model, adapter_name="some"), 12.0, 6)
    batch = prompts([6, 13], seed=6)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, greedy(10), version=4)
    outs = run_all(engine)
    for i, prompt in enumerate(batch):
        tokens, logprobs = _reference(model, "some", prompt, 10)
        assert outs[f"r{i}"].output_ids == tokens
        torch.testing.assert_close(
            torch.tensor(outs[f"r{i}"].logprobs), logprobs, atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_other_families_adapt_as_peft_does(arch):
    """Qwen3 (q/k norms after q|k|v, q wider than hidden) on every projection; Qwen2-MoE on
    attention and its one dense layer's MLP, whose expert blocks keep no adapters."""
    torch.manual_seed(7)
    base = FAMILIES[arch][1](tiny_config(arch)).eval()
    base_weights = {k: v.detach().clone() for k, v in base.state_dict().items()}
    # Qwen2-MoE: a regex (peft full-matches module names) leaves the shared experts out
    dense = r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"
    config = LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS if arch == "qwen3" else dense)
    model = get_peft_model(base, config, adapter_name="fam").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.3)
    tensors = get_peft_model_state_dict(model, adapter_name="fam")
    mlp_layers = {name.split(".")[4] for name in tensors if ".mlp." in name}
    assert mlp_layers == ({"0", "1"} if arch == "qwen3" else {"1"})  # Qwen2-MoE: layer 1 is dense
    model_config = tiny_config(arch)
    config = EngineConfig(
        max_num_seqs=4, block_size=4, num_blocks=64, max_model_len=64, prefill_chunk_size=16,
        max_versions=2, max_lora_rank=4, prefix_cache="off",
    )  # fmt: skip
    engine = Engine.from_hf_config(model_config, config, base_weights)
    engine.load_adapter(1, tensors, 8.0, 4)
    prompt = prompts([7], seed=8)[0]
    engine.add_request("r", prompt, greedy(8), version=1)
    out = run_all(engine)["r"]
    tokens, logprobs = _reference(model, "fam", prompt, 8)
    assert out.output_ids == tokens
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, atol=1e-4, rtol=0)


def test_a_resumed_request_continues_under_the_adapter_it_names(peft_model):
    model, base_weights = peft_model
    engine = _engine(base_weights)
    _load_both(engine, model)
    prompt = prompts([6], seed=9)[0]
    engine.add_request("p", prompt, greedy(10))  # the base's first tokens
    for _ in range(4):
        engine.step()
    snap = engine.abort("p")
    engine.resume_request(snap, version=7)
    out = run_all(engine)["p"]
    done = len(snap.output_ids)
    assert out.versions == [BASE_VERSION] * done + [7] * (10 - done)
    tokens, _ = _reference(model, "one", prompt + snap.output_ids, 10 - done)
    assert out.output_ids[done:] == tokens


def test_the_adapters_change_the_tokens(peft_model):
    """Guards the test above: with B non-zero each version greedy-decodes differently."""
    model, _ = peft_model
    prompt = prompts([9], seed=2)[0]
    runs = {name: _reference(model, name, prompt, 12)[0] for name in (None, "one", "two")}
    assert len({tuple(t) for t in runs.values()}) == 3


def test_refusals_name_the_key_and_unload_frees_the_slot(peft_model):
    model, base_weights = peft_model
    engine = _engine(base_weights)
    _load_both(engine, model)
    one = get_peft_model_state_dict(model, adapter_name="one")
    with pytest.raises(UserInputError, match="engine.max_versions"):
        engine.load_adapter(11, one, 8.0, 4)
    engine.add_request("r", [1, 2, 3], greedy(2), version=7)
    with pytest.raises(UserInputError, match="still run under it"):
        engine.unload_version(7)
    run_all(engine)
    engine.unload_version(7)
    assert engine.resident_versions() == [BASE_VERSION, 9]
    with pytest.raises(UserInputError, match="engine.max_lora_rank"):
        engine.load_adapter(11, one, 8.0, 16)
    with pytest.raises(UserInputError, match="not resident"):
        engine.add_request("gone", [1, 2], greedy(2), version=7)
    engine.load_adapter(11, one, 8.0, 4)  # into the freed slot
    assert engine.resident_versions() == [BASE_VERSION, 9, 11]


def test_a_refused_adapter_leaves_the_slots_as_they_were(peft_model):
    model, base_weights = peft_model
    engine = _engine(base_weights, max_versions=2)
    two = get_peft_model_state_dict(model, adapter_name="two")
    bad = dict(two)
    name = next(k for k in bad if "down_proj.lora_B" in k)
    bad[name] = bad[name][:, :4]  # rank 4 columns where the adapter's rank is 8
    with pytest.raises(UserInputError, match="down_proj"):
        engine.load_adapter(9, bad, 4.0, 8)
    assert engine.resident_versions() == [BASE_VERSION]
    with pytest.raises(UserInputError, match="not a LoRA A or B"):
        engine.load_adapter(9, {**two, "model.embed_tokens.lora_A.weight": two[name]}, 4.0, 8)


def test_one_version_engines_hold_no_adapters(peft_model):
    model, base_weights = peft_model
    engine = _engine(base_weights, max_versions=1, prefix_cache="on")
    assert engine.adapters is None
    with pytest.raises(UserInputError, match="engine.max_versions=1"):
        engine.load_adapter(7, get_peft_model_state_dict(model, adapter_name="one"), 8.0, 4)


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (dict(max_versions=0), "engine.max_versions"),
        (dict(max_lora_rank=0), "engine.max_lora_rank"),
        (dict(max_versions=2, prefix_cache="on"), "engine.max_versions"),
    ],
)
def test_config_refusals_name_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key):
        EngineConfig(**cfg)


def test_a_slot_reads_back_what_was_loaded_and_merges_as_peft_does(peft_model):
    """`adapter_tensors` gives the loaded A and B bit for bit (what a peer is served and a
    load is checked by); `merge_adapter` gives peft's merge_and_unload weights."""
    model, base_weights = peft_model
    engine = _engine(base_weights)
    _load_both(engine, model)
    for name, (version, rank, alpha) in ADAPTERS.items():
        sent = get_peft_model_state_dict(model, adapter_name=name)
        held, got_alpha, got_rank = engine.adapter_tensors(version)
        assert (got_alpha, got_rank) == (alpha, rank) and held.keys() == sent.keys()
        assert all(torch.equal(held[n], sent[n]) for n in sent)
    two = get_peft_model_state_dict(model, adapter_name="two")
    _, rank, alpha = ADAPTERS["two"]
    merged = merge_adapter(base_weights, two, alpha, rank)
    model.set_adapter("two")
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for key, tensor in want.items():
        torch.testing.assert_close(merged[key], tensor, atol=1e-6, rtol=0)
    assert any(not torch.equal(merged[k], base_weights[k]) for k in merged)
