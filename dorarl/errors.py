"""Errors the CLI turns into one line: bad user input (exit 2), a failed run (exit 1), a
resumed run that has nothing left to do (exit 0)."""


class UserInputError(ValueError):
    """Bad user input (data file, prompt, weights); the message names the field and place."""


class WorkerFailed(RuntimeError):
    """A worker (engine instance or trainer) failed mid-run: it died or one of its calls
    raised. `worker` names it; `detail` holds the worker's own error with its traceback."""

    def __init__(self, worker: str, detail: str) -> None:
        first = next((line for line in detail.splitlines() if line.strip()), "no detail")
        super().__init__(f"{worker} failed: {first.strip()}")
        self.worker, self.detail = worker, detail


class RunFailed(RuntimeError):
    """The run stopped on a failure that is not the user's input; the CLI prints it on one
    line with how to resume, exit code 1."""


class RunComplete(Exception):
    """`resume=` names a run whose checkpoint is already at its last step: nothing to train.
    Not an error (a stop that lands after the last step leaves exactly this); exit 0."""
