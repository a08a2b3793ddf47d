"""Impossible events raise ProtocolError, also under `python -O`; the core imports no torch or Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dorarl.controller import (
    Controller,
    ControllerConfig,
    ProtocolError,
    Start,
    TrainDone,
    WeightsLoaded,
)


def controller() -> Controller:
    cfg = ControllerConfig(mode="dora", K=1, rbs=2, tbs=1, group_size=1, instances=2, slots=2)
    ctl = Controller(cfg)
    ctl.handle(Start())
    return ctl


def test_a_training_step_that_was_never_asked_for_is_refused():
    with pytest.raises(ProtocolError, match="no training step to v1 in flight"):
        controller().handle(TrainDone(1, 1.0))


def test_a_weight_load_for_an_instance_that_was_not_loading_is_refused():
    with pytest.raises(ProtocolError, match="instance 0 was not loading v3"):
        controller().handle(WeightsLoaded(0, 3, 1.0))


def run_python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_checks_survive_python_dash_O():
    done = run_python(
        """
        from dorarl.controller import *
        cfg = ControllerConfig(mode="dora", K=1, rbs=2, tbs=1, group_size=1, instances=2, slots=2)
        ctl = Controller(cfg)
        ctl.handle(Start())
        try:
            ctl.handle(TrainDone(1, 1.0))
        except ProtocolError:
            print("refused")
        """,
        "-O",
    )
    assert done.stdout.strip() == "refused", done.stderr


@pytest.mark.parametrize(
    "module", ["dorarl.controller", "dorarl.driver", "dorarl.record", "dorarl.sim"]
)
def test_the_core_the_driver_and_the_simulator_load_neither_torch_nor_ray(module):
    done = run_python(
        f"""
        import sys
        import {module}
        print(sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules))
        """
    )
    assert done.stdout.strip() == "[]", done.stderr
