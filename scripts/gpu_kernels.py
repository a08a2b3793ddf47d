"""GPU checks and timings of the engine's GPU kernels, against their peers in the same run.

On a Qwen2-0.5B-shaped model (bf16, random weights): decode attention of a whole step (64
rows, context 256, 24 layers) on the Triton kernel, the engine's current path and dense
SDPA, against the bandwidth floor; long-context split decode; prefill chunks (fresh and at
15.5k cached) against SDPA; the device sampler on a 152k vocabulary (time, independence
of companions, agreement with the CPU sampler); a whole decode step eager, as a CUDA
graph, on the engine's current attention, and Hugging Face's plain forward; moving a 16k
request's KV against re-prefilling it. Each kernel result is compared with a reference at
that size. Prints a table and writes `kernels.json` to --out.

    python scripts/gpu_kernels.py --out DIR            # on the GPU machine (~2 min)
    TRITON_INTERPRET=1 python scripts/gpu_kernels.py --out DIR --smoke   # tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from dorarl.engine.attention import PagedAttention, SeqRows, StepPlan, plan_decode
from dorarl.engine.config import SamplingParams
from dorarl.engine.decode_graphs import DecodeGraphs
from dorarl.engine.device_sampler import fetch, sample_on_device, sampling_batch
from dorarl.engine.kv_cache import KVCache, KVShape
from dorarl.engine.model import Transformer
from dorarl.engine.model_spec import rope_tables, spec_from_hf
from dorarl.engine.sampler import SampleRow, sample
from dorarl.engine.triton_attention import (
    TritonPagedAttention,
    paged_prefill,
    plan_paged_step,
)
from dorarl.engine.weights import pack

BLOCK = 16
MODELS = {
    "qwen2-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "smoke": dict(
        hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
}  # fmt: skip
SIZES = {
    "qwen2-0.5b": dict(batch=64, ctx=256, long_batch=4, long_ctx=16384, chunk=512, iters=30),
    "smoke": dict(batch=4, ctx=40, long_batch=2, long_ctx=200, chunk=32, iters=1),
}


class Run:
    """The device, the sizes and the figures gathered so far."""

    def __init__(self, smoke: bool) -> None:
        name = "smoke" if smoke else "qwen2-0.5b"
        self.device = torch.device("cpu" if smoke else "cuda")
        self.config = Qwen2Config(**MODELS[name])
        self.spec = spec_from_hf(self.config)
        self.sizes = SIZES[name]
        self.dtype = torch.bfloat16
        self.rows: list[dict] = []
        self.bandwidth = 4.3e12 if smoke else copy_bandwidth(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        """Median wall milliseconds of a call, synchronised after each (a step's latency)."""
        fn()
        laps = []
        for _ in range(self.sizes["iters"]):
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            laps.append((time.perf_counter() - start) * 1e3)
        return statistics.median(laps)

    def peer(self, section: str, name: str, fn: Callable[[], object]) -> None:
        """Time a peer; one that fails here (the engine's CPU-first path on cuda, say) is a
        row saying so, not the end of the run."""
        try:
            self.add(section, name, self.time(fn))
        except Exception as e:  # any failure of a peer is reported, whatever it is
            self.add(section, name, None, f"failed: {type(e).__name__}: {str(e)[:80]}")

    def add(self, section: str, name: str, ms: float | None, figure: str = "", ok=None) -> None:
        self.rows.append(dict(section=section, name=name, ms=ms, figure=figure, ok=ok))
        mark = "" if ok is None else (" ok" if ok else " FAILED")
        shown = "-" if ms is None else f"{ms:.3f} ms"
        print(f"[{section}] {name}: {shown} {figure}{mark}", flush=True)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write), the decode floor's rate."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (time.perf_counter() - start)


# --- pools and rows -----------------------------------------------------------------------
def random_cache(run: Run, blocks: int) -> KVCache:
    s = run.spec
    cache = KVCache(
        KVShape(s.num_layers, s.num_kv_heads, s.head_dim, BLOCK), blocks, 0, run.device, run.dtype
    )
    gen = torch.Generator(device=run.device).manual_seed(0)
    cache.pool.normal_(generator=gen)
    return cache


def scattered_rows(contexts: list[int], q_lens: list[int], blocks: int) -> list[SeqRows]:
    """Rows whose sequences hold `context` tokens after the step, on shuffled blocks."""
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    rows, at = [], 0
    for c, n in zip(contexts, q_lens, strict=True):
        need = -(-c // BLOCK)
        rows.append(SeqRows(order[at : at + need], c - n, n))
        at += need
    assert at <= blocks
    return rows


def blocks_for(contexts: list[int]) -> int:
    return sum(-(-c // BLOCK) for c in contexts) + 1


def dense_kv(cache: KVCache, layer: int, row: SeqRows, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first n keys and values as `[1, kv_heads, n, dim]`."""
    pos = torch.arange(n, device=cache.device)
    blocks = torch.tensor(row.table, device=cache.device)[pos // BLOCK]
    k = cache.pool[0, layer, blocks, :, pos % BLOCK].transpose(0, 1)[None]
    v = cache.pool[1, layer, blocks, :, pos % BLOCK].transpose(0, 1)[None]
    return k, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """q `[1, heads, t, dim]` over k, v `[1, kv_heads, n, dim]` (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --- decode attention ---------------------------------------------------------------------
def decode_attention(run: Run) -> None:
    b, c = run.sizes["batch"], run.sizes["ctx"]
    ragged = [max(1, int(c * (0.25 + 1.5 * i / max(b - 1, 1)))) for i in range(b)]
    for label, contexts in (("uniform", [c] * b), ("ragged", ragged)):
        decode_step_attention(run, f"{b} rows, ctx {label} mean {sum(contexts) // b}", contexts)
    lb, lc = run.sizes["long_batch"], run.sizes["long_ctx"]
    decode_step_attention(run, f"{lb} rows, ctx {lc} (split)", [lc] * lb, peers=False)


def decode_step_attention(run: Run, label: str, contexts: list[int], peers: bool = True) -> None:
    s, blocks = run.spec, blocks_for(contexts)
    cache = random_cache(run, blocks)
    rows = scattered_rows(contexts, [1] * len(contexts), blocks)
    gen = torch.Generator(device=run.device).manual_seed(2)
    q = torch.randn(len(rows), s.num_heads, s.head_dim, device=run.device, generator=gen).to(
        run.dtype
    )
    k, v = (
        torch.randn(len(rows), s.num_kv_heads, s.head_dim, device=run.device, generator=gen).to(
            run.dtype
        )
        for _ in "kv"
    )
    group = s.num_heads // s.num_kv_heads
    args = (s.num_kv_heads, group, BLOCK, run.device)
    floor_ms = sum(contexts) * s.num_kv_heads * s.head_dim * 4 * s.num_layers / run.bandwidth * 1e3

    def triton_step():
        step = plan_paged_step(rows, len(rows), *args)
        attention = TritonPagedAttention(cache, step)
        return [attention(layer, q, k, v) for layer in range(s.num_layers)]

    ms = run.time(triton_step)
    run.add(
        "decode",
        f"triton, {label}, {s.num_layers} layers",
        ms,
        f"{floor_ms / ms:.0%} of floor {floor_ms:.3f} ms",
    )
    check_decode(run, label, cache, rows, q, triton_step()[-1])
    if not peers:
        return

    def engine_step():
        step = plan_paged_step(rows, len(rows), *args)
        plan = StepPlan(step.write_rows, plan_decode(rows, *args), [])
        attention = PagedAttention(cache, plan)
        return [attention(layer, q, k, v) for layer in range(s.num_layers)]

    run.peer("decode", f"engine path (attention.py), {label}", engine_step)
    if len(set(contexts)) == 1:
        dense_decode_peer(run, label, contexts[0], q)


def dense_decode_peer(run: Run, label: str, ctx: int, q: torch.Tensor) -> None:
    s = run.spec
    shape = (s.num_layers, q.shape[0], s.num_kv_heads, ctx, s.head_dim)
    keys = torch.randn(shape, device=run.device).to(run.dtype)
    values = torch.randn(shape, device=run.device).to(run.dtype)
    qd = q[:, :, None]

    def dense_step():
        return [
            F.scaled_dot_product_attention(qd, keys[i], values[i], enable_gqa=True)
            for i in range(s.num_layers)
        ]

    run.add("decode", f"dense SDPA (contiguous K/V), {label}", run.time(dense_step))


def check_decode(run: Run, label: str, cache, rows, q, out) -> None:
    """The last layer's output against float32 SDPA on the gathered K/V, a few rows."""
    layer, worst, scale = run.spec.num_layers - 1, 0.0, 0.0
    for i in sorted({0, len(rows) // 2, len(rows) - 1}):
        n = rows[i].start + 1
        k, v = dense_kv(cache, layer, rows[i], n)
        ref = sdpa(q[i][None, :, None].float(), k.float(), v.float())[0, :, 0]
        got = out[i].view(ref.shape).float()
        worst, scale = (
            max(worst, (got - ref).abs().max().item()),
            max(scale, ref.abs().max().item()),
        )
    tol = 2 * 2.0**-8 * (scale + 4.0)  # |v| <= ~4: a few bf16 roundings (tests justify)
    run.add(
        "decode",
        f"triton vs float32 reference, {label}",
        None,
        f"max error {worst:.2e} (tol {tol:.1e})",
        worst <= tol,
    )


# --- prefill ------------------------------------------------------------------------------
def prefill_attention(run: Run) -> None:
    chunk, long_ctx = run.sizes["chunk"], run.sizes["long_ctx"]
    for cached in (0, long_ctx - chunk):
        prefill_case(run, chunk, cached)


def prefill_case(run: Run, chunk: int, cached: int) -> None:
    s = run.spec
    total = cached + chunk
    cache = random_cache(run, blocks_for([total]))
    rows = scattered_rows([total], [chunk], cache.pool.shape[2])
    group = s.num_heads // s.num_kv_heads
    step = plan_paged_step(rows, 0, s.num_kv_heads, group, BLOCK, run.device)
    q = torch.randn(chunk, s.num_heads, s.head_dim, device=run.device).to(run.dtype)
    out = torch.empty_like(q)
    kc, vc = cache.pool[0, 0], cache.pool[1, 0]
    ms = run.time(lambda: paged_prefill(q, kc, vc, step.prefill, out))
    flops = 4 * s.num_heads * s.head_dim * (chunk * cached + chunk * (chunk + 1) / 2)
    label = f"chunk {chunk} at {cached} cached"
    run.add("prefill", f"triton, {label}, 1 layer", ms, f"{flops / ms / 1e9:.1f} TFLOP/s")
    k, v = dense_kv(cache, 0, rows[0], total)
    qd = q.transpose(0, 1)[None]
    mask = (
        torch.arange(total, device=run.device)[None, :]
        <= cached + torch.arange(chunk, device=run.device)[:, None]
    )
    peer_ms = run.time(
        lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True)
    )
    run.add(
        "prefill",
        f"SDPA (contiguous K/V, mask), {label}",
        peer_ms,
        f"{flops / peer_ms / 1e9:.1f} TFLOP/s",
    )
    ref = sdpa(qd.float(), k.float(), v.float(), mask)[0].transpose(0, 1)
    err = (out.float() - ref).abs().max().item()
    tol = 2 * 2.0**-8 * (ref.abs().max().item() + 4.0)
    run.add(
        "prefill",
        f"triton vs float32 reference, {label}",
        None,
        f"max error {err:.2e} (tol {tol:.1e})",
        err <= tol,
    )


# --- sampler ------------------------------------------------------------------------------
MIXED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=50),
]


def sampler_checks(run: Run) -> None:
    b, vocab = run.sizes["batch"], run.spec.vocab_size
    gen = torch.Generator(device=run.device).manual_seed(3)
    logits = torch.randn(b, vocab, device=run.device, generator=gen) * 4
    plain = [SampleRow(SamplingParams(), seed=i, counter=5) for i in range(b)]
    mixed = [SampleRow(MIXED[i % len(MIXED)], seed=i, counter=5) for i in range(b)]
    for label, rows in (("plain", plain), ("mixed (top-p / top-k rows)", mixed)):
        ms = run.time(
            lambda rows=rows: fetch(
                *sample_on_device(logits, sampling_batch(rows, vocab, run.device))
            )
        )
        run.add("sampler", f"device sampler, {b} rows x {vocab}, {label}", ms)
    ms = run.time(lambda: sample(logits, mixed))
    run.add("sampler", f"CPU sampler code on the device (sampler.py), {b} rows, mixed", ms)
    tokens, logprobs = fetch(*sample_on_device(logits, sampling_batch(mixed, vocab, run.device)))
    alone = [
        fetch(
            *sample_on_device(
                logits[i : i + 1], sampling_batch(mixed[i : i + 1], vocab, run.device)
            )
        )
        for i in range(b)
    ]
    moved = sum(
        a[0][0] != t or a[1][0] != lp for a, t, lp in zip(alone, tokens, logprobs, strict=True)
    )
    run.add(
        "sampler",
        "rows alone vs in the batch: draws that differ",
        None,
        f"{moved} of {b}",
        moved == 0,
    )
    cpu_tokens, cpu_logprobs = sample(logits.cpu(), mixed)
    differ = sum(a != c for a, c in zip(tokens, cpu_tokens, strict=True))
    dlp = max(abs(a - c) for a, c in zip(logprobs, cpu_logprobs, strict=True))
    run.add(
        "sampler",
        "device vs CPU sampler: tokens that differ",
        None,
        f"{differ} of {b}, logprob diff {dlp:.1e}",
        differ <= 1 and dlp < 1e-4,
    )


# --- whole decode steps -------------------------------------------------------------------
def random_model(run: Run) -> Transformer:
    gen = torch.Generator(device=run.device).manual_seed(4)
    named = {}
    for name, shape in run.spec.weight_shapes().items():
        if name.endswith("norm.weight"):
            named[name] = torch.ones(shape, device=run.device)
        elif name.endswith(".bias"):
            named[name] = torch.zeros(shape, device=run.device)
        else:
            named[name] = torch.randn(shape, device=run.device, generator=gen) * 0.02
    weights = pack(run.spec, named, run.device, run.dtype)
    cos, sin = rope_tables(run.config, run.spec, run.config.max_position_embeddings)
    return Transformer(
        run.spec, weights, cos.to(run.device, run.dtype), sin.to(run.device, run.dtype)
    )


def decode_steps(run: Run, model: Transformer) -> None:
    s, b, c = run.spec, run.sizes["batch"], run.sizes["ctx"]
    cache = random_cache(run, blocks_for([c] * b) + 1)
    scratch = cache.pool.shape[2] - 1
    rows = scattered_rows([c] * b, [1] * b, scratch)
    ids = [i % s.vocab_size for i in range(b)]
    sampling = [SampleRow(SamplingParams(), seed=i, counter=c) for i in range(b)]
    group = s.num_heads // s.num_kv_heads
    ids_t = torch.tensor(ids, device=run.device)
    pos_t = torch.tensor([r.start for r in rows], device=run.device)

    def sampled(logits):
        return fetch(*sample_on_device(logits, sampling_batch(sampling, s.vocab_size, run.device)))

    def eager():
        step = plan_paged_step(rows, b, s.num_kv_heads, group, BLOCK, run.device)
        return sampled(model.forward(ids_t, pos_t, TritonPagedAttention(cache, step)))

    def engine_path():
        step = plan_paged_step(rows, b, s.num_kv_heads, group, BLOCK, run.device)
        plan = StepPlan(
            step.write_rows, plan_decode(rows, s.num_kv_heads, group, BLOCK, run.device), []
        )
        return sample(model.forward(ids_t, pos_t, PagedAttention(cache, plan)), sampling)

    graphs = DecodeGraphs(
        lambda i, p, a: model.forward(i, p, a),
        cache,
        b,
        -(-(c + 1) // BLOCK) + 1,
        scratch,
        buckets=[b],
    )
    start = time.perf_counter()
    graphs.capture()
    run.add("step", f"capture decode graph (bucket {b})", (time.perf_counter() - start) * 1e3)
    tag = f"{b} rows, ctx {c}, forward + sample + fetch"
    run.peer("step", f"engine path (attention.py + sampler.py), {tag}", engine_path)
    run.add("step", f"triton eager, {tag}", run.time(eager))
    graph_ms = run.time(lambda: sampled(graphs.run(ids, rows)))
    hf_ms = hf_forward(run)
    met = graph_ms <= min(4.0, 1.2 * hf_ms)
    figure = f"{graph_ms / hf_ms:.2f}x HF: {_bar(met)} (<= 4 ms and <= 1.2x HF)"
    run.add("step", f"triton + CUDA graph, {tag}", graph_ms, figure)
    same = torch.allclose(
        graphs.run(ids, rows),
        model.forward(
            ids_t,
            pos_t,
            TritonPagedAttention(
                cache, plan_paged_step(rows, b, s.num_kv_heads, group, BLOCK, run.device)
            ),
        ),
        atol=5e-2,
        rtol=5e-2,
    )
    run.add("step", "graph replay vs eager logits", None, "allclose 5e-2", same)
    migration(run, model)


def hf_forward(run: Run) -> float:
    """Hugging Face's plain decode forward over a DynamicCache of the same batch and context."""
    b, c = run.sizes["batch"], run.sizes["ctx"]
    with torch.device(run.device):
        hf = Qwen2ForCausalLM(run.config).to(run.dtype).eval()
    prompt = torch.randint(0, run.spec.vocab_size, (b, c), device=run.device)
    with torch.inference_mode():
        cache = hf(input_ids=prompt, use_cache=True, logits_to_keep=1).past_key_values
        token = prompt[:, -1:]
        ms = run.time(
            lambda: hf(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        )
    run.add(
        "step",
        f"HF plain forward (DynamicCache, sdpa), {b} rows, ctx ~{c}",
        ms,
        "the peer of the bar",
    )
    return ms


def migration(run: Run, model: Transformer) -> None:
    """A long request's KV moved (export + import) against re-prefilling it in chunks."""
    s, n, chunk = run.spec, run.sizes["long_ctx"], run.sizes["chunk"]
    cache = random_cache(run, blocks_for([n]) * 2)
    table = list(range(-(-n // BLOCK)))
    target = [b + len(table) for b in table]
    group = s.num_heads // s.num_kv_heads

    def reprefill():
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            step = plan_paged_step(
                [SeqRows(table, start, size)], 0, s.num_kv_heads, group, BLOCK, run.device
            )
            ids = torch.zeros(size, dtype=torch.long, device=run.device)
            pos = torch.arange(start, start + size, device=run.device)
            last = torch.tensor([size - 1], device=run.device)
            model.forward(ids, pos, TritonPagedAttention(cache, step), last)

    prefill_ms = run.time(reprefill)
    run.add("migrate", f"re-prefill {n} tokens (chunks of {chunk}, triton)", prefill_ms)
    moves = {
        "export to host + import (kv_cache.py today)": lambda: cache.load(
            cache.export(table, n), target
        ),
        "device-to-device block copy (same GPU)": lambda: cache.pool.index_copy_(
            2,
            torch.tensor(target, device=run.device),
            cache.pool.index_select(2, torch.tensor(table, device=run.device)),
        ),
    }
    for name, fn in moves.items():
        ms = run.time(fn)
        run.add(
            "migrate",
            f"{name}, {n} tokens",
            ms,
            f"{prefill_ms / ms:.0f}x cheaper than re-prefill: {_bar(prefill_ms / ms >= 20)} 20x",
        )


def _bar(met: bool) -> str:
    """Bars are the GPU targets, reported; checks (ok column) gate the exit."""
    return "meets bar" if met else "misses bar"


# --- report -------------------------------------------------------------------------------
def report(run: Run, out: Path) -> None:
    table = Table(
        title=f"GPU kernel checks ({run.device}, bf16, copy {run.bandwidth / 1e12:.2f} TB/s)"
    )
    for col in ("section", "what", "ms", "figure", "ok"):
        table.add_column(col)
    for r in run.rows:
        ok = "" if r["ok"] is None else ("ok" if r["ok"] else "FAILED")
        table.add_row(
            r["section"], r["name"], "-" if r["ms"] is None else f"{r['ms']:.3f}", r["figure"], ok
        )
    Console(width=200).print(table)
    meta = dict(
        device=str(run.device), torch=torch.__version__, bandwidth=run.bandwidth, sizes=run.sizes
    )
    if run.device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=run.rows), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on CPU (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    run = Run(args.smoke)
    torch.manual_seed(0)
    with torch.inference_mode():
        for part in (decode_attention, prefill_attention, sampler_checks):
            part(run)
        decode_steps(run, random_model(run))
    report(run, args.out)
    failed = [r["name"] for r in run.rows if r["ok"] is False]
    print(f"{len(failed)} check(s) failed: {failed}" if failed else "all checks passed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
