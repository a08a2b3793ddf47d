"""Which failed call is whose death: an engine's own, or the trainer's seen through a load."""

from ray.exceptions import ActorDiedError, RayTaskError

from dorarl.runtime.ray_runtime import _death_inside


def test_a_death_raised_inside_a_call_is_told_from_the_callees_own():
    inner = RayTaskError("receive_weights", "traceback", ActorDiedError()).as_instanceof_cause()
    assert _death_inside(inner)  # the engine ran; the trainer it asked to send was gone
    assert not _death_inside(ActorDiedError())  # the engine itself died: engine recovery's
    raised = RayTaskError("receive_weights", "traceback", ValueError("bad")).as_instanceof_cause()
    assert not _death_inside(raised)  # a bug in the call, no death
