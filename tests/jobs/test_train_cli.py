"""`dorarl train` refuses bad input with one line naming the key, file or line, exit code 2."""

import json
from pathlib import Path

import pytest
from reward_models import save_classifier, save_judge
from tiny_model import save_mistral_model, save_with_head_dim

from dorarl.cli import main as cli_main
from dorarl.config import ConfigError, load_config
from dorarl.engine.vllm.config import vllm_missing
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import model_spec
from dorarl.jobs.evaluation import eval_versions
from dorarl.jobs.workload import build_task, eval_sampling


def _err(capsys, *args):
    rc = cli_main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["bogus=1"], "unknown config key bogus"),
        (["K=x"], "K: expected int"),
        (["mode=fast"], "mode: must be one of"),
        (["rbs=2", "tbs=4"], "rbs: must be >= tbs"),
        (["instances=0"], "instances: must be >= 1"),
        (["engine.max_num_seqs=0"], "engine.max_num_seqs: must be > 0"),
        (["engine.block_size=0"], "engine.block_size: must be > 0"),
        (["trainer.lr=-1"], "trainer.lr: must be > 0"),
        (["task.name=jsonl"], "task.path: the jsonl task needs a data file"),
        (["task.name=arith"], "task.name=arith needs a chat model"),  # the shipped char model
        (["weights.transport=nccl"], "weights.transport: must be one of"),
        (["weights.bucket_mb=0"], "weights.bucket_mb: must be >= 1"),
        (["task.max_segments=0"], "task.max_segments: must be >= 1"),
        (["weights.transport=collective", "engine.device=cuda"], "weights.transport: collective"),
        (["--frobnicate"], "unknown option --frobnicate"),
    ],
)
def test_bad_settings_exit_2_with_one_line(capsys, args, needle):
    rc, err = _err(capsys, *args, "progress=false")
    assert rc == 2
    assert len(err) == 1 and needle in err[0], err


def test_bad_yaml_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("mode: dora\nK: [1\n")
    rc, err = _err(capsys, "--config", str(path))
    assert rc == 2 and f"{path}:" in err[0]


def test_malformed_jsonl_row_names_file_and_line(tmp_path, capsys, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n{not json\n")
    rc, err = _err(
        capsys, f"model={tiny_model_dir}", "task.name=jsonl", f"task.path={data}",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert rc == 2 and f"{data}:2" in err[0], err


def test_prompt_over_context_limit_is_refused(tmp_path, capsys, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "x" * 400, "answer": "2"}) + "\n")
    rc, err = _err(
        capsys, f"model={tiny_model_dir}", "task.name=jsonl", f"task.path={data}",
        "engine.max_model_len=128", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert rc == 2 and f"{data}:1" in err[0], err


def test_help_lists_the_main_keys(capsys):
    assert cli_main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for key in ("mode", "K", "runtime", "steps", "instances", "rbs", "tbs", "group_size", "seed"):
        assert f"\n  {key} " in text


def test_eval_versions_cover_first_and_last():
    config = load_config(TrainConfig, overrides=["steps=7", "eval.every=3"])
    assert eval_versions(config) == {0, 3, 6, 7}
    off = load_config(TrainConfig, overrides=["steps=7", "eval.every=off"])
    assert eval_versions(off) == set()


def test_with_evaluation_off_nothing_is_asked_of_an_evaluator(tmp_path):
    from dorarl.jobs.eval_actor import Evaluations

    record = tmp_path / "evaluations.jsonl"
    for defer in (False, True):
        evals = Evaluations(None, set(), 0, defer, record, timeout_s=1)
        evals.offer(1, None, None)  # a published version, unwanted
        assert evals.finished() == {} and evals.all() == {} and not record.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["trainer.device=cuda:1"], "trainer.device: use cpu or cuda"),
     (["engine.device=tpu"], "engine.device: use cpu or cuda")],
)  # fmt: skip
def test_devices_are_cpu_or_the_gpu_ray_assigns(capsys, args, needle):
    rc, err = _err(capsys, *args, "progress=false")
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_cuda_settings_load_on_any_machine(capsys):
    # whether GPUs exist is the cluster's to say (tests/runtime/test_placement.py): a config
    # naming cuda loads and prints here, so a plan can be checked before it runs
    assert cli_main(["train", "--print-config", "engine.device=cuda", "trainer.device=cuda"]) == 0
    assert "device: cuda" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="^engine.device: use cpu or cuda"):
        load_config(TrainConfig, overrides=["engine.device=cuda:1"])


def test_task_keys_reach_the_arith_and_jsonl_tasks(tmp_path, tiny_chat_model_dir):
    overrides = ["task.name=arith", "task.min_value=10", "task.max_value=30", "seed=3",
                 "task.system_prompt=Reply with a number.", "sampling.max_new_tokens=24"]  # fmt: skip
    task = build_task(load_config(TrainConfig, overrides=overrides), str(tiny_chat_model_dir))
    assert (task.name, task.seed, task.max_new_tokens) == ("arith", 3, 24)
    assert (task.config.min_value, task.config.max_value) == (10, 30)
    assert "Reply with a number." in task.tokenizer.decode(task.train_prompts()[0].prompt_ids)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    overrides = ["task.name=jsonl", f"task.path={data}", "task.eval_path=" + str(data),
                 "task.chat_template=true"]  # fmt: skip
    task = build_task(load_config(TrainConfig, overrides=overrides), str(tiny_chat_model_dir))
    assert task.tokenizer.decode(task.train_prompts()[0].prompt_ids).endswith(
        "1+1=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_env_on_a_task_without_a_turn_cap_gets_the_cap_the_help_names(
    tmp_path, tiny_chat_model_dir
):
    from dorarl.config import describe
    from dorarl.tasks.env_task import DEFAULT_MAX_TURNS

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    overrides = ["task.name=jsonl", f"task.path={data}", f"task.eval_path={data}",
                 "task.env=dorarl.tasks.multiturn_sum:MultiTurnSumEnv"]  # fmt: skip
    task = build_task(load_config(TrainConfig, overrides=overrides), str(tiny_chat_model_dir))
    help_ = {key: text for key, _, text in describe(TrainConfig)}["task.max_turns"]
    assert task.max_turns == DEFAULT_MAX_TURNS
    assert f"0: the task's own; {DEFAULT_MAX_TURNS} for a task without one" in help_
    capped = load_config(TrainConfig, overrides=[*overrides, "task.max_turns=3"])
    assert build_task(capped, str(tiny_chat_model_dir)).max_turns == 3


async def _agent(client, prompt):  # task.agent for the test below; never called
    return 0.0


def test_an_agent_task_gets_max_segments_and_its_default_is_the_agents(
    tmp_path, tiny_chat_model_dir
):
    from dorarl.tasks.agent import DEFAULT_MAX_SEGMENTS

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    overrides = ["task.name=jsonl", f"task.path={data}", f"task.eval_path={data}",
                 f"task.agent={__name__}:_agent"]  # fmt: skip
    task = build_task(load_config(TrainConfig, overrides=overrides), str(tiny_chat_model_dir))
    assert task.max_segments == DEFAULT_MAX_SEGMENTS == 8
    capped = load_config(TrainConfig, overrides=[*overrides, "task.max_segments=2"])
    assert build_task(capped, str(tiny_chat_model_dir)).max_segments == 2


def test_help_is_fast_it_imports_no_torch_ray_or_transformers():
    import subprocess
    import sys

    code = (
        "import sys; from dorarl.cli import main; main(['train', '--help']); "
        "print(sorted(m for m in ('torch', 'ray', 'transformers', 'matplotlib') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_bench_help_lists_the_benchmarks(capsys):
    assert cli_main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    for name in ("engine", "modes", "convergence"):
        assert f"bench {name}" in text
    assert cli_main(["bench", "nope"]) == 2
    assert "unknown command 'bench nope'" in capsys.readouterr().err


def test_an_unsupported_model_is_refused_in_one_line_before_anything_starts(
    tmp_path, capsys, tiny_model_dir
):
    model = tmp_path / "mistral"
    model.mkdir()
    for item in tiny_model_dir.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    rc, err = _err(capsys, f"model={model}", "--out", str(tmp_path / "run"))
    assert rc == 2 and len(err) == 1, err
    assert f"{model}/config.json: model_type 'mistral' is not supported" in err[0]
    assert not (tmp_path / "run").exists()


def test_data_format_keys_reach_the_jsonl_task(tmp_path, tiny_chat_model_dir):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    overrides = ["task.name=jsonl", f"task.path={data}", f"task.eval_path={data}",
                 "task.format=gsm8k", "task.prompt_template=Q: {question}",
                 "task.chat_template=true", "task.system_prompt=Be brief."]  # fmt: skip
    task = build_task(load_config(TrainConfig, overrides=overrides), str(tiny_chat_model_dir))
    (prompt,) = task.train_prompts()
    assert (prompt.text, prompt.answer) == ("Q: 1+1?", "2")
    text = task.tokenizer.decode(prompt.prompt_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert task.reward_fn.__name__ == "math_equivalent"  # the default for gsm8k rows
    exact = build_task(
        load_config(TrainConfig, overrides=[*overrides, "task.reward=exact"]),
        str(tiny_chat_model_dir),
    )
    assert exact.reward_fn.__name__ == "exact_match"


def test_eval_samples_sample_at_the_runs_settings():
    config = load_config(
        TrainConfig,
        overrides=["eval.samples=8", "sampling.temperature=0.7", "sampling.top_p=0.9", "seed=5"],
    )
    sampling = eval_sampling(config)
    assert (sampling.samples, sampling.temperature, sampling.top_p, sampling.seed) == (
        8, 0.7, 0.9, 5,
    )  # fmt: skip
    assert eval_sampling(load_config(TrainConfig)).samples == 0
    with pytest.raises(ConfigError, match="^eval.samples: must be >= 0"):
        load_config(TrainConfig, overrides=["eval.samples=-1"])


def test_sampled_scores_reach_the_metrics_rows_and_the_summary():
    from dorarl.jobs.evaluation import _attach_eval, eval_fields
    from dorarl.record.evaluations import sampled_eval_summary

    evals = {0: {"version": 0, "accuracy": 0.25, "mean@4": 0.3, "pass@2": 0.4, "pass@4": 0.5}}
    row = {"step": 0, "version": 0, "new_version": 1}
    _attach_eval(row, evals, first_step=0)
    assert row["eval_accuracy"] == 0.25 and row["eval_pass@4"] == 0.5 and row["eval_mean@4"] == 0.3
    assert eval_fields(row) == {
        "eval_accuracy": 0.25, "eval_mean@4": 0.3, "eval_pass@2": 0.4, "eval_pass@4": 0.5,
    }  # fmt: skip
    summary = sampled_eval_summary(list(evals.values()))
    assert summary == {"eval_sampled": {"0": {"mean@4": 0.3, "pass@2": 0.4, "pass@4": 0.5}}}
    assert sampled_eval_summary([{"version": 0, "accuracy": 0.1}]) == {}


def test_help_lists_the_workload_keys(capsys):
    assert cli_main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for key in ("task.format", "task.prompt_template", "task.system_prompt", "eval.samples",
                "trainer.loss.overlong", "trainer.loss.overlong_buffer"):  # fmt: skip
        assert f"\n  {key} " in text
    assert "response_cap" not in text and "mask_truncated" not in text


def test_a_block_size_triton_cannot_run_exits_2_before_anything_starts(capsys):
    rc, err = _err(
        capsys, "engine.device=cuda", "trainer.device=cuda", "engine.attention=triton",
        "engine.block_size=24", "progress=false",
    )  # fmt: skip
    assert rc == 2 and len(err) == 1 and err[0].startswith("dorarl: error: engine.block_size:")


def test_a_head_dim_triton_cannot_run_exits_2_before_ray_starts(tmp_path, capsys, tiny_model_dir):
    import ray

    model = save_with_head_dim(tiny_model_dir, tmp_path / "odd_heads", 24)
    rc, err = _err(
        capsys, f"model={model}", "engine.device=cuda", "trainer.device=cuda",
        "engine.attention=triton", "progress=false", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert rc == 2 and len(err) == 1, err
    assert "engine.attention: triton needs head_dim a power of two >= 16" in err[0]
    assert f"{model}/config.json has head_dim 24" in err[0]
    assert not (tmp_path / "run").exists() and not ray.is_initialized()


def test_print_placement_shows_each_engines_kv_budget(tmp_path, capsys):
    from transformers import Qwen2Config

    from dorarl.bench.shapes import SHAPES

    config = Path(__file__).resolve().parents[2] / "configs" / "gpu-1.yaml"
    gpu_1 = ["--print-placement", "1", "--config", str(config)]
    assert cli_main(["train", *gpu_1, "ray.gpu_memory_gb=24"]) == 0
    out = capsys.readouterr().out
    assert "KV budget per engine on a 24.0 GB GPU:" in out
    for engine in ("engine0", "engine1"):  # 64 full sequences of 256 tokens: all it can use
        assert f"  {engine}: KV 1024 blocks of 16 tokens" in out and "in 0.3333 of 24.0 GB" in out
    Qwen2Config(**SHAPES["qwen2.5-7b"]).save_pretrained(tmp_path)  # its config.json alone
    long = [f"model={tmp_path}", "engine.max_model_len=32768"]
    assert cli_main(["train", *gpu_1, *long, "ray.gpu_memory_gb=141"]) == 0
    assert "engine0: KV 32" in capsys.readouterr().out  # ~32k blocks of the 131k 64 x 32k need
    assert cli_main(["train", *gpu_1, *long, "ray.gpu_memory_gb=24"]) == 0
    assert "engine0: does not fit: 0.3333 of 24.0 GB (8.00 GB) cannot hold" in (
        capsys.readouterr().out
    )


def _without_tokenizer(tmp_path, model_dir):
    """A model folder whose weights came without their tokenizer files."""
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (model_dir / name).is_file():
            (folder / name).write_bytes((model_dir / name).read_bytes())
    return folder


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["task.env=nomodule_xyz:X"], "task.env: cannot import module 'nomodule_xyz'"),
        (["task.agent=nomodule_xyz:f"], "task.agent: cannot import module 'nomodule_xyz'"),
        (["task.env=dorarl.tasks.multiturn_sum:Nope"],
         "task.env: module 'dorarl.tasks.multiturn_sum' has no 'Nope' (its environments: "
         "MultiTurnSumEnv)"),
        (["model=/nonexistent/model"], "model: no folder /nonexistent/model"),
        (["task.name=jsonl", "task.path=/nonexistent/train.jsonl"],
         "task.path: no such data file /nonexistent/train.jsonl"),
    ],
)  # fmt: skip
def test_print_config_checks_what_a_run_reads(capsys, args, needle):
    rc, err = _err(capsys, "--print-config", *args)
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"dorarl: error: {needle}"), err


def test_a_model_folder_without_tokenizer_files_says_which_are_missing(
    tmp_path, capsys, tiny_model_dir
):
    folder = _without_tokenizer(tmp_path, tiny_model_dir)
    for args in (["--print-config"], ["--out", str(tmp_path / "run")]):
        rc, err = _err(capsys, f"model={folder}", *args)
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"dorarl: error: {folder}: cannot load a tokenizer: no ")
        assert "tokenizer.json" in err[0] and "sentencepiece" not in err[0]
    assert not (tmp_path / "run").exists()


def test_print_config_says_what_the_rate_comes_to_for_the_model(capsys, tiny_model_dir, tmp_path):
    assert cli_main(["train", "--print-config", f"model={tiny_model_dir}"]) == 0
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if line.startswith("  lr:")]  # trainer.lr
    assert line.startswith("  lr: null  # by the model: 1e-5 here (the default for a model")
    path = tmp_path / "printed.yaml"
    path.write_text(printed)  # the comment aside, it reads back as the same config
    assert load_config(TrainConfig, path) == load_config(
        TrainConfig, None, [f"model={tiny_model_dir}"]
    )


@pytest.mark.skipif(vllm_missing() is not None, reason="vllm is not installed here")
def test_a_family_only_vllm_runs_passes_its_checks_on_backend_vllm_alone(capsys, tmp_path):
    """A Mistral folder: our engine refuses its model_type in one line; on backend vllm
    the run reads its sizes alone (placement, the default rate) and starts."""
    folder = save_mistral_model(tmp_path / "mistral")
    capsys.readouterr()
    rc, err = _err(capsys, "--print-config", f"model={folder}")
    assert rc == 2 and err == [
        f"dorarl: error: {folder}/config.json: model_type 'mistral' is not supported by the "
        "engine (supported: llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral)"
    ]
    assert cli_main(["train", "--print-config", f"model={folder}", "engine.backend=vllm"]) == 0
    assert "by the model: 1e-5 here" in capsys.readouterr().out
    spec, _ = model_spec(str(folder), "vllm")
    assert (spec.model_type, spec.num_layers, spec.head_dim, spec.num_kv_heads) == (
        "mistral", 2, 32, 1,
    )  # fmt: skip


def _long_prompt_data(tmp_path: Path) -> Path:
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "x" * 100, "answer": "2"},
    ]  # fits 256, not 128
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def test_print_config_reports_every_problem_one_line_each(tmp_path, capsys, tiny_model_dir):
    data = _long_prompt_data(tmp_path)
    rc, err = _err(
        capsys, "--print-config", f"model={tiny_model_dir}", "task.name=jsonl",
        f"task.path={data}", "task.reward=myreward:score", "task.env=nomodule_xyz:X",
        "engine.max_model_len=128",
    )  # fmt: skip
    assert rc == 2 and len(err) == 3, err
    assert all(line.startswith("dorarl: error: ") for line in err)
    assert any("task.reward: cannot import module 'myreward'" in line for line in err), err
    assert any("task.env: cannot import module 'nomodule_xyz'" in line for line in err), err
    assert any(f"{data}:2: prompt is " in line for line in err), err  # the data checked too


def test_print_config_imports_a_users_reward_and_refuses_a_missing_module_or_function(
    tmp_path, capsys, tiny_model_dir, monkeypatch
):
    data = _long_prompt_data(tmp_path)
    monkeypatch.chdir(tmp_path)  # where the reward's module is found, as task.env's
    (tmp_path / "cli_reward_mod.py").write_text("def score(row, response):\n    return 1.0\n")
    common = ["--print-config", f"model={tiny_model_dir}", "task.name=jsonl", f"task.path={data}"]
    assert _err(capsys, *common, "task.reward=cli_reward_mod:score") == (0, [])
    assert _err(capsys, *common, "task.rewards=cli_reward_mod:score*0.5,math") == (0, [])
    for args, line in (
        (
            ["task.reward=cli_reward_mod:nope"],
            "task.reward: module 'cli_reward_mod' has no function 'nope'",
        ),
        (["task.rewards=nomodule_xyz:f*0.5,math"], "task.rewards: cannot import module"),
        (
            ["task.rewards=cli_reward_mod:score*high"],
            "task.rewards[0]: weight 'high' is not a number",
        ),
        (["task.reward=math", "task.rewards=exact"], "task.rewards: set task.reward or"),
    ):
        rc, err = _err(capsys, *common, *args)
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"dorarl: error: {line}"), err
    rc, err = _err(capsys, *common, "task.reward=cli_reward_mod:score", "task.env=nomodule_xyz:X")
    assert rc == 2 and len(err) == 1 and "task.env" in err[0], err


def test_print_config_refuses_what_the_run_refuses(tmp_path, capsys, tiny_model_dir):
    data = _long_prompt_data(tmp_path)
    for args, first in (
        (["task.reward=myreward:score"], "task.reward"),
        (["engine.max_model_len=128"], str(data)),  # a prompt over the context: its row
        (["sampling.max_new_tokens=300"], "sampling.max_new_tokens"),  # over the context (256)
    ):
        common = [f"model={tiny_model_dir}", "task.name=jsonl", f"task.path={data}", *args]
        checked, checked_err = _err(capsys, "--print-config", *common)
        ran, ran_err = _err(capsys, *common, "--out", str(tmp_path / "run"), "progress=false")
        assert checked == ran == 2 and checked_err == ran_err, ran_err
        # the cap over the context also puts the long prompt over it: a second line then
        assert ran_err[0].startswith(f"dorarl: error: {first}") and len(ran_err) <= 2, ran_err
    assert not (tmp_path / "run").exists()


def test_settings_problems_are_reported_together_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  learning_rate: 1.0e-5\nrollout:\n  filter_groups: yes\n")
    rc, err = _err(capsys, "--print-config", "--config", str(path), "rbs=2", "tbs=4")
    assert rc == 2 and set(err) == {
        f"dorarl: error: unknown config key trainer.learning_rate ({path}) on line 2; "
        "did you mean trainer.lr or trainer.lora.lr?",
        f"dorarl: error: rollout.filter_groups: write true or false, not 'yes' ({path})",
    }, err  # rbs against tbs: checked once every value is good


def test_print_config_checks_the_reward_model_folder_and_its_keys(tmp_path, capsys):
    classifier = save_classifier(tmp_path / "rm")
    judge = save_judge(tmp_path / "judge")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((classifier / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    capsys.readouterr()  # the saves' progress bars
    assert _err(capsys, "--print-config", f"task.reward_model={classifier}") == (0, [])
    assert _err(capsys, "--print-config", f"task.reward_model={judge}", "task.reward_mix=0.5") == (
        0,
        [],
    )
    for args, line in (
        ([f"task.reward_model={tmp_path / 'none'}"], "task.reward_model: "),
        ([f"task.reward_model={pickled}"], "task.reward_model: "),
        (
            [f"task.reward_model={judge}", "task.reward_model_kind=classifier"],
            "task.reward_model_kind: classifier asked, but",
        ),
        ([f"task.reward_model={classifier}", "task.reward_mix=1.5"], "task.reward_mix"),
        (
            [f"task.reward_model={judge}", "task.reward_model_rubric=Rate {answer}: {response}"],
            "task.reward_model_rubric: not a format string of {prompt} and {response}",
        ),
        (
            [f"task.reward_model={classifier}", "task.name=multiturn_sum"],
            "task.reward_model: a reward model scores single-turn tasks",
        ),
    ):
        rc, err = _err(capsys, "--print-config", *args)
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"dorarl: error: {line}"), err
    rc, err = _err(capsys, "--print-config", f"task.reward_model={pickled}")
    assert "holds only .bin weights" in err[0]


def test_print_config_takes_a_saved_data_set_and_refuses_a_name_held_nowhere(
    tmp_path, capsys, tiny_model_dir, monkeypatch
):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)} | {
        "test": datasets.Dataset.from_list(rows[:1])
    }).save_to_disk(str(folder))  # fmt: skip
    common = ["--print-config", f"model={tiny_model_dir}", "task.name=jsonl"]
    assert cli_main(["train", *common, f"task.path={folder}", "task.split=train"]) == 0
    assert "split: train" in capsys.readouterr().out
    rc, err = _err(capsys, *common, f"task.path={folder}")
    assert rc == 2 and err == [
        f"dorarl: error: task.split: {folder} has several splits; choose one of train, test "
        "with task.split=NAME"
    ], err
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # a name is kept as given, not made a path
    rc, err = _err(capsys, *common, "task.path=myorg/none")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("dorarl: error: task.path: no such data file myorg/none, nor a ")
    assert str(tmp_path / "cache" / "myorg___none") in err[0]
