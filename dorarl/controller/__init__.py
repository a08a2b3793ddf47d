"""Sans-IO controller: rollout manager, staleness window, transfer queue and orchestrator.

Runtimes feed `Controller.handle(event)` and execute the returned commands (see
`commands.py` for each command's obligations). Imports neither torch nor Ray.
"""

from dorarl.controller.commands import (
    TRAINER,
    Command,
    Dispatch,
    DropGroup,
    FilterGroup,
    Finish,
    Interrupt,
    LoadWeights,
    Migrate,
    Offload,
    ReleaseVersion,
    Resume,
    SetTimer,
    Train,
    parse_request_id,
    request_id,
)
from dorarl.controller.config import (
    MODES,
    ControllerConfig,
    Mode,
    OrchestratorConfig,
    RolloutConfig,
)
from dorarl.controller.controller import Controller
from dorarl.controller.errors import ProtocolError
from dorarl.controller.events import (
    CarriedGroup,
    EnvAnswered,
    EnvWaiting,
    Event,
    InstanceStats,
    MigrationDone,
    SampleDone,
    Start,
    Stop,
    Timer,
    TrainDone,
    WeightsLoaded,
)

__all__ = [
    "MODES",
    "TRAINER",
    "CarriedGroup",
    "Command",
    "Controller",
    "ControllerConfig",
    "Dispatch",
    "DropGroup",
    "EnvAnswered",
    "EnvWaiting",
    "Event",
    "FilterGroup",
    "Finish",
    "InstanceStats",
    "Interrupt",
    "LoadWeights",
    "Migrate",
    "MigrationDone",
    "Mode",
    "Offload",
    "OrchestratorConfig",
    "ProtocolError",
    "ReleaseVersion",
    "Resume",
    "RolloutConfig",
    "SampleDone",
    "SetTimer",
    "Start",
    "Stop",
    "Timer",
    "Train",
    "TrainDone",
    "WeightsLoaded",
    "parse_request_id",
    "request_id",
]
