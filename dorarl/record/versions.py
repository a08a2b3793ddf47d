"""Which version each instance hosts over time: its lanes in the trace, and the instances
assigned to each version (a step row's `instances_per_version`)."""

from __future__ import annotations

from collections import Counter

from dorarl.controller import commands as cmd
from dorarl.controller import events as ev
from dorarl.record.trace import VERSION_TID, WEIGHTS_TID, TraceBuilder, instance_pid


class VersionLanes:
    """`keeps_old`: instances hold several versions, so the old one serves its requests on
    through a load, and its lane ends when the new version is in."""

    def __init__(
        self,
        instances: int,
        first_version: int,
        trace: TraceBuilder | None,
        keeps_old: bool = False,
    ) -> None:
        self.trace, self.keeps_old = trace, keeps_old
        self._hosted = [first_version] * instances
        self._assigned = [first_version] * instances  # hosted, or being loaded
        self._hosted_since = [0.0] * instances
        self._loading: dict[int, tuple[float, int, int]] = {}  # instance -> start, version, source

    def load_started(self, c: cmd.LoadWeights, now: float) -> None:
        i = c.instance_id
        if not self.keeps_old:
            self._hosted_slice(i, now)
        self._loading[i] = (now, c.version, c.source)
        self._assigned[i] = c.version

    def loaded(self, e: ev.WeightsLoaded) -> None:
        start, version, source = self._loading.pop(e.instance_id, (e.now, e.version, cmd.TRAINER))
        if self.trace is not None:
            name = f"load v{version} from " + (
                "trainer" if source == cmd.TRAINER else f"instance {source}"
            )
            self.trace.slice(instance_pid(e.instance_id), WEIGHTS_TID, name, start, e.now)
        if self.keeps_old:
            self._hosted_slice(e.instance_id, e.now)
        self._hosted[e.instance_id] = e.version
        self._hosted_since[e.instance_id] = e.now

    def per_version(self) -> dict[str, int]:
        return {str(v): n for v, n in sorted(Counter(self._assigned).items())}

    def close(self, now: float) -> None:
        """End every hosted-version lane that is not in a load at `now` (the lane of one that
        keeps its old version through the load goes on to `now`)."""
        for i in range(len(self._hosted)):
            if i not in self._loading or self.keeps_old:
                self._hosted_slice(i, now)

    def _hosted_slice(self, i: int, now: float) -> None:
        if self.trace is not None:
            name = f"v{self._hosted[i]}"
            self.trace.slice(instance_pid(i), VERSION_TID, name, self._hosted_since[i], now)
