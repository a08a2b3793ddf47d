"""The table `dorarl train` ends with: counts, times, and the first and last evaluation (its
version, greedy accuracy, and mean@k and pass@j where it sampled), uncut off a terminal."""

from dorarl.jobs.train import _print_summary


def _cells(text: str) -> dict[str, str]:
    """The table's rows as metric -> value."""
    rows = [line.split("│")[1:3] for line in text.splitlines() if line.count("│") == 3]
    return {name.strip(): value.strip() for name, value in rows}


def test_the_table_shows_the_sampled_scores_of_the_first_and_last_evaluation(tmp_path, capsys):
    summary = {"mode": "dora", "K": 1, "steps": 4, "throughput_tokens_per_s": 123.4,
               "eval_version_first": 0, "eval_accuracy_first": 0.25,
               "eval_version_last": 4, "eval_accuracy_last": 0.5,
               "eval_sampled": {"0": {"mean@4": 0.3, "pass@2": 0.4, "pass@4": 0.5},
                                "4": {"mean@4": 0.45, "pass@2": 0.6, "pass@4": 0.75}}}  # fmt: skip
    _print_summary(summary, tmp_path)
    cells = _cells(capsys.readouterr().out)
    assert cells["throughput_tokens_per_s"] == "123.400"
    assert (cells["eval_version_first"], cells["eval_accuracy_first"]) == ("0", "0.250")
    assert (cells["eval_mean@4_first"], cells["eval_pass@4_first"]) == ("0.300", "0.500")
    assert (cells["eval_version_last"], cells["eval_accuracy_last"]) == ("4", "0.500")
    assert (cells["eval_mean@4_last"], cells["eval_pass@2_last"]) == ("0.450", "0.600")
