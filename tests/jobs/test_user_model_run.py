"""A user's workload end to end: a Qwen2-shaped Hugging Face folder (random weights from
`save_pretrained`, a byte-level BPE tokenizer trained here with a chat template) on a
GSM8K-style file, through `dorarl train` on local Ray, with sampled evaluation and soft
overlong punishment on; the checkpoint it writes loads back into the engine."""

import json

import pytest
from tiny_model import gsm8k_rows, save_family_model

from dorarl.cli import main as cli_main
from dorarl.engine import Engine, EngineConfig
from dorarl.jobs.evaluation import with_evaluations

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

SMALL = ["instances=2", "tbs=4", "rbs=8", "group_size=4", "engine.max_num_seqs=16",
         "sampling.max_new_tokens=32", "eval.max_prompts=6", "eval.every=0", "progress=false"]  # fmt: skip


def test_qwen2_folder_trains_on_gsm8k_rows_through_the_chat_template(tmp_path, caplog, capsys):
    rows = gsm8k_rows(40)
    model = save_family_model(
        tmp_path / "qwen2", "qwen2", [r["question"] + r["answer"] for r in rows]
    )
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    bar = [f"model={model}", "task.name=jsonl", f"task.path={data}", "task.format=gsm8k",
           "task.reward=math", "task.chat_template=true", "steps=3"]  # fmt: skip
    extras = ["eval.samples=2", "trainer.loss.overlong=soft", "trainer.loss.overlong_buffer=8"]
    assert cli_main(["train", *bar, *SMALL, *extras, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert summary["steps"] == 3 and summary["dropped_total"] == 0 and len(metrics) == 3
    assert summary["reward_errors"] == 0
    assert set(summary["eval_sampled"]) == {"0", "3"}
    metrics = with_evaluations(out)  # evaluations.jsonl joined to the steps, by version
    for row in (metrics[0], metrics[-1]):
        assert {"eval_accuracy", "eval_mean@2", "eval_pass@2"} <= set(row)
    assert all(m["response_len_max"] <= 32 for m in metrics)
    # Random weights seldom stop: the cap cuts them, and the first step says which key to raise.
    cut = [r.getMessage() for r in caplog.records if r.name == "dorarl.jobs.truncation"]
    assert cut and cut[0].startswith("step 0:") and "raise sampling.max_new_tokens" in cut[0]
    # 40 rows hold out 4 prompts: said at the start, warned of, and beside every accuracy.
    assert "held-out: 4 prompts" in capsys.readouterr().out
    assert any("only 4 prompts" in r.getMessage() for r in caplog.records)
    assert summary["eval_n"] == 4
    # No engine.max_model_len given: the folder's max_position_embeddings (512), not 256.
    assert json.loads((out / "config.json").read_text())["engine"]["max_model_len"] == 512
    checkpoint = out / "checkpoints" / "version_00003"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "qwen2"
    engine = Engine.from_pretrained(checkpoint, EngineConfig(max_num_seqs=2, max_model_len=128))
    assert engine.spec.tie_word_embeddings and engine.version == 0


def _tensorboard_tags(out) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


def test_a_qwen3_moe_folder_trains_at_world_sizes_one_and_two(tmp_path):
    """A random Qwen3-MoE folder: its routes recorded and replayed at world size 1, its
    load-balancing loss on under FSDP2 at world size 2; the expert load in every figure."""
    rows = gsm8k_rows(24)
    model = save_family_model(
        tmp_path / "moe", "qwen3_moe", [r["question"] + r["answer"] for r in rows]
    )
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bar = [f"model={model}", "task.name=jsonl", f"task.path={data}", "task.format=gsm8k",
           "steps=3", "eval.every=0", "eval.max_prompts=4", "checkpoint_every=0"]  # fmt: skip
    runs = {
        "replay": ["engine.record_routes=true", "trainer.moe.route_replay=true"],
        "sharded": ["trainer.world_size=2", "trainer.moe.aux_loss_coef=0.01"],
    }
    for name, extra in runs.items():
        out = tmp_path / name
        one_engine = [*SMALL, "instances=1"]  # what is checked is the trainer's side
        assert cli_main(["train", *bar, *one_engine, *extra, "--out", str(out)]) == 0, name
        summary = json.loads((out / "summary.json").read_text())
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        assert summary["steps"] == 3 and summary["dropped_total"] == 0, name
        for row in metrics:
            assert row["moe_imbalance_max"] >= row["moe_imbalance"] >= 1.0
            assert sum(row["moe_tokens_per_expert"].values()) > 0
        events = json.loads((out / "trace.json").read_text())["traceEvents"]
        assert sum(e["name"] == "tokens per expert" for e in events) == 3
        assert {"train/moe_imbalance", "train/moe_tokens_per_expert/0"} <= _tensorboard_tags(out)
    replay = [json.loads(line) for line in (tmp_path / "replay" / "metrics.jsonl").open()]
    assert all(m["moe_routes_compared"] > 0 and m["moe_route_mismatch"] == 0 for m in replay)
    sharded = [json.loads(line) for line in (tmp_path / "sharded" / "metrics.jsonl").open()]
    assert all(m["moe_aux_loss"] > 0 for m in sharded)
