"""Which failed call is whose death: an engine's own, or the trainer's seen through a load;
and whether an actor lives, when it is busy or gone."""

import time

import ray
from ray.exceptions import ActorDiedError, RayTaskError

from dorarl.runtime.calls import lives
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.ray_runtime import _death_inside


def test_a_death_raised_inside_a_call_is_told_from_the_callees_own():
    inner = RayTaskError("receive_weights", "traceback", ActorDiedError()).as_instanceof_cause()
    assert _death_inside(inner)  # the engine ran; the trainer it asked to send was gone
    assert not _death_inside(ActorDiedError())  # the engine itself died: engine recovery's
    raised = RayTaskError("receive_weights", "traceback", ValueError("bad")).as_instanceof_cause()
    assert not _death_inside(raised)  # a bug in the call, no death


@ray.remote(num_cpus=0)
class _Worker:
    def busy(self, seconds: float) -> None:
        time.sleep(seconds)

    def ping(self) -> int:
        return 1


def test_an_actor_busy_with_a_long_call_lives_and_a_killed_one_does_not():
    start_local_ray(num_cpus=2)
    try:
        actor = _Worker.remote()
        ray.get(actor.ping.remote())
        actor.busy.remote(10)
        started = time.monotonic()
        assert lives(actor.ping.remote(), wait_s=0.5)  # its answer waits behind the long call
        assert time.monotonic() - started < 5
        ray.kill(actor, no_restart=True)
        assert not lives(actor.ping.remote())
    finally:
        ray.shutdown()
