"""scripts/objective_gradients.py on the shipped base model: GRPO's own gradient is its
reference, and CISPO's departs from it only where GRPO's clip stops tokens."""

import pytest
from scripts_dir import load_script

from dorarl.tasks.assets import BASE_MODEL_DIR


@pytest.mark.parametrize("lr", [1e-12, 0.02])
def test_objectives_are_compared_on_a_stale_batch(tmp_path, lr):
    script = load_script("objective_gradients")
    out = tmp_path / "grads.json"
    argv = ["--model", str(BASE_MODEL_DIR), "--groups", "2", "--out", str(out)]
    result = script.main([*argv, "--objectives", "cispo,gspo", f"trainer.lr={lr}"])
    rows = {row["objective"]: row for row in result["objectives"]}
    assert rows.keys() == {"grpo", "cispo", "gspo"} and result["stale_groups"] == 2
    assert rows["grpo"]["norm"] > 0 and rows["grpo"]["distance"] == 0.0
    assert rows["gspo"]["distance"] > 1e-3  # its own ratio, clip and aggregation
    if lr < 1e-6:  # the step moved nothing: every ratio is 1, no token clipped
        assert result["clipped_by_grpo"] == [] and rows["cispo"]["distance"] < 1e-5
    else:
        assert result["clipped_by_grpo"] and rows["cispo"]["distance"] > 0.1
    assert out.is_file()
