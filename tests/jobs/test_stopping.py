"""The first SIGINT/SIGTERM asks a run to stop (exit 128 + signal); a second aborts at once."""

import os
import signal

import pytest

from dorarl.jobs.stopping import StopRequest


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_asks_to_stop_the_second_aborts(capsys, signum, code):
    before = signal.getsignal(signum)
    with StopRequest() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signum)
        assert stop.requested() and stop.exit_code == code
        assert stop.name == signal.Signals(signum).name
        assert "stopping after the current training step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signum) is before  # the previous handlers are back
