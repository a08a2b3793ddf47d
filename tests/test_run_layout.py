"""dorarl.run_layout is the one module that knows a run folder's names: no other module
under dorarl/ spells a run folder file, folder or the checkpoint name pattern."""

from __future__ import annotations

import ast
from pathlib import Path

from dorarl import run_layout
from dorarl.run_layout import RunFolder, checkpoint_name, checkpoint_version

ROOT = Path(__file__).resolve().parents[1] / "dorarl"
NAMES = {
    run_layout.METRICS_FILE, run_layout.TRAJECTORIES_FILE, run_layout.EVALUATIONS_FILE,
    run_layout.SUMMARY_FILE, run_layout.TRACE_FILE, run_layout.SEGMENT_START_FILE,
    run_layout.STATE_FILE, run_layout.CHECKPOINTS, run_layout.SEGMENTS,
    run_layout.ROLLED_BACK, run_layout.TENSORBOARD, "reward_curve.png", "dashboard.png", "failure.txt",
}  # fmt: skip
"""config.json is left out: a model folder (Hugging Face's layout) has one too."""
CHECKPOINT_PREFIX = "version_"
KEY_LOOKUPS = ("get", "pop", "setdefault")


def _is_key_lookup(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr in KEY_LOOKUPS and bool(call.args)


def _not_names(tree: ast.AST) -> set[int]:
    """Ids of the string nodes that are prose or keys, not paths: docstrings, dict keys,
    subscripts and the key of a `.get`/`.pop`/`.setdefault` (a summary's `segments`)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))
        if isinstance(node, ast.Dict):
            skip.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            skip.add(id(node.slice))
        elif isinstance(node, ast.Call) and _is_key_lookup(node):
            skip.add(id(node.args[0]))
    return skip


def layout_literals(source: str) -> list[str]:
    """The string literals in `source` that name a run folder's file or folder, or start a
    checkpoint folder's name."""
    tree = ast.parse(source)
    skip = _not_names(tree)
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        if node.value in NAMES or node.value.startswith(CHECKPOINT_PREFIX)
    ]  # an f-string's literal parts are constants too: f"version_{v:05d}" starts one
    found.sort(key=lambda node: (node.lineno, node.col_offset))
    return [f"line {node.lineno}: {node.value!r}" for node in found]


def test_the_check_finds_the_layout_spelled_out_and_leaves_prose_and_keys_alone():
    spelled = '''
"""Writes metrics.jsonl."""
a = out / "checkpoints" / f"version_{v:05d}"
b = open(run / "metrics.jsonl")
c = parent.glob("version_*")
d = {"segments": [], "checkpoints": 1}
e = summary.get("segments", [])
f = "write prompt texts to trajectories.jsonl"
'''
    assert layout_literals(spelled) == [
        "line 3: 'checkpoints'", "line 3: 'version_'", "line 4: 'metrics.jsonl'",
        "line 5: 'version_*'",
    ]  # fmt: skip


def test_no_module_but_run_layout_knows_the_run_folders_names():
    found = [
        f"{path.relative_to(ROOT.parent)} {hit}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "run_layout.py"
        for hit in layout_literals(path.read_text())
    ]
    assert not found, "run folder names outside dorarl/run_layout.py:\n" + "\n".join(found)


def test_checkpoint_names_map_to_their_versions_and_back(tmp_path):
    run = RunFolder(tmp_path)
    assert run.checkpoint(12) == tmp_path / "checkpoints" / "version_00012"
    assert checkpoint_name(12) == "version_00012"
    assert checkpoint_version(run.checkpoint(12)) == 12
    assert checkpoint_version(run.checkpoints / "version_00012.old") == 12  # a displaced copy
    assert checkpoint_version(run.checkpoints / "version_00012.tmp") is None  # never complete
    assert run.rolled_back.metrics == tmp_path / "rolled_back" / "metrics.jsonl"
    assert run.segment(3) == tmp_path / "segments" / "003"
