from dorarl.report.plots import plot_training_curve
from dorarl.report.tensorboard import ScalarLogger, flatten_scalars


def test_flatten_scalars_nests_and_skips_non_numbers():
    row = {"loss": 1.5, "overhead_s": {"load_balance": 0.25}, "mode": "dora", "ok": True}
    assert flatten_scalars(row) == {"loss": 1.5, "overhead_s/load_balance": 0.25}


def test_scalar_logger_writes_event_file(tmp_path):
    logger = ScalarLogger(tmp_path)
    logger.log({"step": 1, "reward_mean": 0.5})
    logger.close()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 0


def test_training_curve_png(tmp_path):
    curve = {"steps": [1, 2, 3, 4], "reward_mean": [0.1, 0.2, 0.3, 0.4],
             "eval": [{"version": 0, "accuracy": 0.1}, {"version": 4, "accuracy": 0.5}]}  # fmt: skip
    path = plot_training_curve(curve, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_curve_legend_sits_above_the_axes_with_integer_versions(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    curve = {"steps": [1, 2, 3], "reward_mean": [0.9, 0.95, 1.0],
             "eval": [{"version": 0, "accuracy": 0.9}, {"version": 3, "accuracy": 1.0}]}  # fmt: skip
    plot_training_curve(curve, tmp_path / "curve.png")
    (ax,) = figures[0].axes
    renderer = figures[0].canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.y0 >= ax.get_window_extent(renderer).y1 - 1  # points near 1.0 stay visible
    locator = ax.xaxis.get_major_locator()
    assert isinstance(locator, MaxNLocator) and locator._integer
