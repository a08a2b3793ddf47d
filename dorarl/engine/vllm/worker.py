"""The worker extension vLLM mixes into its worker class (`worker_extension_cls`): weight
loads (weights.py) and MoE route capture (routing.py)."""

from __future__ import annotations

from dorarl.engine.vllm.routing import WorkerRoutes
from dorarl.engine.vllm.weights import WorkerWeights

EXTENSION = "dorarl.engine.vllm.worker.WorkerExtension"


class WorkerExtension(WorkerWeights, WorkerRoutes):
    """Every method dorarl calls in vLLM's worker (`collective_rpc`)."""
