"""Where a piece of CPU work spends its time, by torch operator (torch.profiler): each op's own
time on the calling thread over one call (its intra-op threads work inside that time), the
largest first, and the share of matrix products, the part a step's floor
(dorarl.bench.matmul_floor) counts; the rest is what fusing elementwise work could cut."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

MATRIX_PRODUCTS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::addmm_", "aten::baddbmm"}
)


def profile_ops(work: Callable[[], Any], top: int = 15) -> dict[str, Any]:
    """Run `work` once under the profiler: the ops' total own time (ms), the matrix products'
    share of it, and the `top` ops by own time (ms, share, calls)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    products_us = sum(e.self_cpu_time_total for e in events if e.key in MATRIX_PRODUCTS)
    return {
        "self_ms": total_us / 1e3,
        "matrix_products_share": products_us / total_us if total_us else 0.0,
        "ops": [
            {
                "op": e.key,
                "self_ms": e.self_cpu_time_total / 1e3,
                "share": e.self_cpu_time_total / total_us,
                "calls": e.count,
            }
            for e in events[:top]
        ],
    }
