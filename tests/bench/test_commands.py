"""`dorarl bench NAME`: one sub-command per engine bench, each refusing bad input in one line
before it starts anything; every bench the docs and scripts name exists, with the options
they give it; the real-model and device benches end to end at a tiny shape."""

import importlib
import json
import re
from pathlib import Path

import pytest

from dorarl.cli import COMMANDS, main

ENGINE_BENCHES = ("engine", "engine-model", "engine-device", "migration")
ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("scripts/*.sh"))]
MENTION = re.compile(r"dorarl(?:\.cli)? bench ([a-z][a-z-]*)([^`#\n\\]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


def _mentions() -> list[tuple[str, str, list[str]]]:
    """(where, bench, its --flags) for every `dorarl bench NAME ...` of the docs and scripts."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            following = number
            while line.endswith("\\") and following < len(lines):  # a shell line continued
                line = line[:-1].rstrip() + " " + lines[following].strip()
                lines[following] = ""
                following += 1
            for name, rest in MENTION.findall(line):
                found.append((f"{page.relative_to(ROOT)}:{number}", name, FLAG.findall(rest)))
    return found


def test_every_bench_the_docs_name_exists_with_the_options_they_give_it():
    mentions = _mentions()
    assert {name for _, name, _ in mentions} >= set(ENGINE_BENCHES)
    for where, name, flags in mentions:
        assert f"bench {name}" in COMMANDS, f"{where}: no command `dorarl bench {name}`"
        if name in ENGINE_BENCHES:
            module = importlib.import_module(COMMANDS[f"bench {name}"][0])
            known = module.arguments()._option_string_actions
            unknown = [flag for flag in flags if flag not in known]
            assert not unknown, f"{where}: `dorarl bench {name}` has no {unknown}"


def test_bench_help_gives_each_engine_bench_one_line(capsys):
    assert main(["bench", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ENGINE_BENCHES:
        assert len([line for line in lines if line.split()[:2] == ["bench", name]]) == 1, name


@pytest.mark.parametrize("bench", ["engine-device", "migration"])
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "meta"])
def test_a_device_that_is_not_cpu_or_cuda_is_one_line(tmp_path, capsys, bench, device):
    assert main(["bench", bench, "--out", str(tmp_path), "--device", device]) == 2
    assert capsys.readouterr().err == f"dorarl: error: --device: cpu or cuda, got {device!r}\n"


def test_migration_refuses_bad_contexts_before_starting_ray(tmp_path, capsys):
    argv = ["bench", "migration", "--out", str(tmp_path), "--device", "cpu", "--contexts", "1,x"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("dorarl: error: --contexts: ")


def test_engine_set_keys_are_each_bench_s_own(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--device", "cpu", "--engine-set", "linear_kernel=torch"]
    assert main(["bench", "engine-device", *argv]) == 2
    assert capsys.readouterr().err.startswith("dorarl: error: --engine-set: ")


def test_the_real_model_bench_needs_a_model_or_a_shape(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "engine-model", "--out", str(tmp_path)])
    assert exit_.value.code == 2


@pytest.mark.slow
def test_engine_model_on_a_tiny_shape_writes_engine_json(tmp_path):
    argv = ["bench", "engine-model", "--out", str(tmp_path), "--shape", "tiny", "--skip-hf"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "engine.json").read_text())
    real = report["real_model"]
    assert real["source"] == "tiny" and set(real["batches"]) == {"32", "64"}
    assert real["batches"]["64"]["engine"]["tokens_per_s"] > 0
    assert len(report["load_average_start"]) == len(report["load_average"]) == 3


@pytest.mark.slow
def test_engine_device_on_the_cpu_writes_engine_json_and_drops_the_partial(tmp_path):
    argv = ["bench", "engine-device", "--out", str(tmp_path), "--device", "cpu", "--quick"]
    assert main([*argv, "--engine-set", "cuda_graphs=off"]) == 0
    report = json.loads((tmp_path / "engine.json").read_text())
    bench = report["device_bench"]
    assert bench["shape"] == "tiny" and bench["device"] == "cpu"  # the cpu's default shape
    assert bench["spec"]["engine_set"] == [["cuda_graphs", "off"]]
    assert report["quick"] is True and report["tokens_per_s"]["engine"] > 0
    assert not (tmp_path / "engine.partial.json").exists()
