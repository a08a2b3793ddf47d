"""`dorarl report results`: docs/results.md is what its JSON records render, and `--check`
tells a page that is out of date."""

import json
import shutil
from pathlib import Path

import pytest

from dorarl.cli import main as cli_main
from dorarl.errors import UserInputError
from dorarl.report.results import read_record, read_records, render_page

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _args(records: Path, page: Path) -> list[str]:
    return ["report", "results", "--records", str(records), "--page", str(page)]


def test_the_results_page_is_up_to_date_with_its_records():
    assert cli_main([*_args(DOCS / "results", DOCS / "results.md"), "--check"]) == 0


def test_check_fails_when_a_record_changes_and_passes_once_rendered(tmp_path):
    shutil.copytree(DOCS / "results", tmp_path / "results")
    page = tmp_path / "results.md"
    assert cli_main(_args(tmp_path / "results", page)) == 0
    assert cli_main([*_args(tmp_path / "results", page), "--check"]) == 0
    record = tmp_path / "results" / "weights-qwen2-0.5b.json"
    raw = json.loads(record.read_text())
    raw["rows"][0][1] = 9.99
    record.write_text(json.dumps(raw))
    assert cli_main([*_args(tmp_path / "results", page), "--check"]) == 1
    assert cli_main(_args(tmp_path / "results", page)) == 0
    assert "| publish (at a step) | 9.99 |" in page.read_text()


def test_every_table_names_its_command_date_and_machine():
    records = read_records(DOCS / "results")
    page = render_page(records)
    for record in records:
        assert record.command and record.date and record.machine, record.name
        assert f"### {record.title}\n\n" in page
    assert len({r.name for r in records}) == len(records) > 10


def test_cells_follow_their_column_format(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(
        json.dumps({
            "section": "engine", "title": "t", "bench": "engine", "command": "dorarl bench engine",
            "date": "2026-12-01", "machine": "m",
            "columns": ["name", {"name": "s", "fmt": "{:.2f}x"}, {"name": "n", "fmt": "{:,}"}],
            "rows": [["a|b", 1.5, 12345], ["c", None, 7]],
        })
    )  # fmt: skip
    page = render_page([read_record(path)])
    assert "| a\\|b | 1.50x | 12,345 |" in page and "| c | - | 7 |" in page
    assert "command `dorarl bench engine` · 2026-12-01 · machine: m" in page


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("machine"), "missing field 'machine'"),
        (lambda r: r.update(colour="red"), "unknown field 'colour'"),
        (lambda r: r.update(section="misc"), "section must be one of"),
        (lambda r: r["rows"].append([1]), "rows[1] has 1 cells for 2"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_field(tmp_path, change, message):
    raw = {"section": "engine", "title": "t", "bench": "b", "command": "c", "date": "d",
           "machine": "m", "columns": ["a", "b"], "rows": [[1, 2]]}  # fmt: skip
    change(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(UserInputError, match=message.replace("[", r"\[")):
        read_record(path)
