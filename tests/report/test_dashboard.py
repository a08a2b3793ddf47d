"""dashboard.png: the panels of the signals a run is watched by, drawn from a run folder's
metrics.jsonl and evaluations.jsonl, integer versions on x, legends off the data."""

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.ticker import MaxNLocator

from dorarl.record.evaluations import append_evaluation
from dorarl.report.dashboard import PANELS, dashboard_figure, write_dashboard
from dorarl.report.run_curve import read_history

TITLES = [
    "reward and held-out accuracy", "loss", "clipped share (tokens)", "KL (k3, per token)",
    "engine vs trainer |log-prob gap| (per token)", "entropy (per token)", "gradient norm (before clipping)", "learning rate",
    "response length (tokens)", "truncated share", "staleness (versions)", "tokens/s",
    "step time (s)",
]  # fmt: skip


def _run_folder(path, steps=6, trainer=True):
    rows = []
    for i in range(steps):
        row = {"step": i, "version": i, "new_version": i + 1, "time_s": 2.0 * (i + 1),
               "reward_mean": 0.1 * i, "response_len_mean": 20.0 + i, "response_len_max": 32,
               "truncated_fraction": 0.5 - 0.05 * i, "staleness_mean": 0.5, "staleness_max": 1,
               "tokens_per_s": 100.0 + i, "step_time_s": 2.0, "rollout_only_s": 0.5,
               "train_time_s": 1.5}  # fmt: skip
        if trainer:
            row |= {"loss": 0.01 * i, "clip_frac_low": 0.01, "clip_frac_high": 0.02 * i,
                    "kl_behavior": 1e-3, "entropy": 1.0 - 0.1 * i, "grad_norm": 0.5,
                    "lr": 1e-6 * (i + 1), "rollout_logp_abs_diff_fresh": 1e-4,
                    "rollout_logp_abs_diff": 0.01 * i}  # fmt: skip
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for version, accuracy in ((0, 0.2), (3, 0.4), (steps, 0.6)):
        append_evaluation(path / "evaluations.jsonl",
                          {"version": version, "accuracy": accuracy, "n": 60})  # fmt: skip
    return path


@pytest.fixture
def figure(tmp_path):
    fig = dashboard_figure(read_history(_run_folder(tmp_path)), "dora (K=2)")
    fig.canvas.draw()
    yield fig
    plt.close(fig)


def test_the_dashboard_has_the_expected_panels_with_integer_versions(figure):
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title(loc="left") for ax in panels] == TITLES == [p.title for p in PANELS]
    for ax in panels:
        locator = ax.xaxis.get_major_locator()
        assert isinstance(locator, MaxNLocator) and locator._integer
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    reward = panels[0]
    labels = [line.get_label() for line in reward.get_lines()]
    assert labels == ["reward mean", "held-out accuracy (greedy, n=60)"]
    assert list(reward.get_lines()[1].get_xdata()) == [0, 3, 6]  # each at its version
    assert list(panels[2].get_lines()[1].get_ydata()) == pytest.approx([0.02 * i for i in range(6)])


def test_legends_sit_outside_the_plotting_area_and_cover_no_point(figure):
    renderer = figure.canvas.get_renderer()
    with_legend = [ax for ax in figure.axes if ax.get_legend() is not None]
    assert len(with_legend) == 7  # reward, clipping, KL, log-prob gap, length, staleness, step time
    for ax in with_legend:
        box = ax.get_legend().get_window_extent(renderer)
        area = ax.get_window_extent(renderer)
        assert box.y0 >= area.y1 - 1, ax.get_title(loc="left")  # above the axes
        for line in ax.get_lines():
            points = ax.transData.transform(np.column_stack(line.get_data()))
            assert not any(box.contains(x, y) for x, y in points)


def test_a_run_without_trainer_metrics_says_so_in_its_panels(tmp_path):
    fig = dashboard_figure(read_history(_run_folder(tmp_path, trainer=False)))
    texts = {ax.get_title(loc="left"): [t.get_text() for t in ax.texts] for ax in fig.axes}
    plt.close(fig)
    assert texts["loss"] == ["not recorded in this run"]
    assert texts["tokens/s"] == []


def test_write_dashboard_writes_the_run_folders_png(tmp_path):
    path = write_dashboard(_run_folder(tmp_path, steps=1), "sync")
    assert path == tmp_path / "dashboard.png" and path.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert write_dashboard(tmp_path / "empty") is None


@pytest.mark.parametrize(
    "locs",
    [
        [-0.05, -0.025, 0.0, 0.025, 0.05],
        [9.6e-5, 9.8e-5, 1e-4, 1.02e-4],  # a constant learning rate's axis
        [4.6005, 4.601, 4.6015],
        [0.0, 2e-6, 4e-6],
    ],
)
def test_tick_labels_tell_close_ticks_apart(locs):
    from dorarl.report.dashboard import TickLabels

    labels = TickLabels()
    labels.set_locs(locs)
    shown = [labels(v) for v in locs]
    assert len(set(shown)) == len(locs) and labels.get_offset() == ""
    assert [float(s) for s in shown] == pytest.approx(locs, rel=1e-6, abs=1e-12)
