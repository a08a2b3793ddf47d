"""`dorarl train` refuses bad input with one line naming the key, file or line, exit code 2."""

import json

import pytest

from dorarl.cli import main as cli_main
from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.evaluation import eval_versions
from dorarl.jobs.workload import build_task


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
