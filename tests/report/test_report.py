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
