"""The driver: what every runtime shares around the controller (sans-IO, like the controller).

`Driver` owns the controller and the recorder, delivers events, routes commands to an
`Executor` and keeps the request table and the group assembly; a runtime supplies the
executor (how to dispatch, load weights, migrate, interrupt and resume, offload and train
on its machinery: made with the driver, which it answers to) and the event source that
feeds results back. No torch, Ray, threads or
clocks here: time comes from the runtime's clock.
"""

from dorarl.driver.driver import Driver, Observer, request_seed
from dorarl.driver.executor import Executor, Rollout
from dorarl.driver.groups import GroupAssembly
from dorarl.driver.requests import RequestSpec, RequestTable

__all__ = [
    "Driver",
    "Executor",
    "GroupAssembly",
    "Observer",
    "RequestSpec",
    "RequestTable",
    "Rollout",
    "request_seed",
]
