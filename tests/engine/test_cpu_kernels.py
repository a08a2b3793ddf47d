"""The fused CPU kernels: decode attention against a dense reference over ragged contexts,
block sizes, GQA ratios and head sizes, and a row's output bit for bit whatever its batch and
blocks; RoPE bit for bit, RMSNorm within two ulps; the fallback when they cannot be built; the
`engine.attention=cpp` key."""

import logging
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dorarl.config import ConfigError
from dorarl.engine import EngineConfig, cpu_kernels
from dorarl.engine.attention import PagedAttention, SeqRows, StepPlan, plan_decode
from dorarl.engine.backends import fit_to_model, resolve_backends
from dorarl.engine.kv_cache import KVCache, KVShape
from dorarl.engine.model import rms_norm, rotate, signed_sin

KERNELS = cpu_kernels.load_kernels()
KERNEL = KERNELS.decode if KERNELS else None
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="the kernels did not build here")


def _pool(kv_heads, dim, block_size, num_blocks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, num_blocks, kv_heads, block_size, dim, generator=gen) * 2
    return pool[0], pool[1]


def _dense(keys, values, table, length, q):
    """Softmax attention of q `[heads, dim]` over the first `length` keys of a block table."""
    bs = keys.shape[2]
    k = torch.cat([keys[b] for b in table], dim=1)[:, :length]  # [kv_heads, length, dim]
    v = torch.cat([values[b] for b in table], dim=1)[:, :length]
    repeat = q.shape[0] // k.shape[0]
    assert length <= len(table) * bs
    k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
    out = F.scaled_dot_product_attention(q[:, None].double(), k.double(), v.double())
    return out.reshape(-1).float()


def _tables(lengths, block_size, num_blocks, rng):
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, out of order, foreign blocks between a row's own
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    return tables, padded


def _fused(q, keys, values, padded, lengths):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return KERNEL(q, keys, values, padded, torch.tensor(lengths), scale)


@needs_kernel
@pytest.mark.parametrize(
    "block_size,heads,kv_heads,dim",
    [
        (4, 4, 2, 16),
        (16, 9, 3, 64),
        (32, 9, 3, 64),
        (8, 14, 2, 128),
        (16, 8, 8, 32),
        (4, 6, 1, 256),
    ],
)
def test_fused_decode_equals_dense_attention(block_size, heads, kv_heads, dim):
    rng = random.Random(block_size * heads + dim)
    lengths = [1, block_size, block_size + 1, 2 * block_size - 1] + [
        rng.randrange(1, 90) for _ in range(6)
    ]
    keys, values = _pool(kv_heads, dim, block_size, 120)
    tables, padded = _tables(lengths, block_size, 120, rng)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(1)) * 2
    got = _fused(q, keys, values, padded, lengths)
    for row, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        want = _dense(keys, values, table, n, q[row])  # in float64
        # float32 SDPA itself is up to 6e-6 off the float64 result on these rows
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (32, 9, 3)])
def test_a_rows_output_is_bit_identical_alone_or_beside_longer_rows(block_size, heads, kv_heads):
    """Batch invariance and block-layout invariance: the same logical K/V and query give the
    same bits alone, first or last in a batch of longer rows, in other physical blocks."""
    dim, num_blocks, n = 64, 200, 37
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(4)
    row_k = torch.randn(kv_heads, n, dim, generator=gen)
    row_v = torch.randn(kv_heads, n, dim, generator=gen)
    row_q = torch.randn(heads, dim, generator=gen) * 3

    def run(lengths, at):
        keys, values = _pool(kv_heads, dim, block_size, num_blocks, seed=rng.randrange(99))
        tables, padded = _tables(lengths, block_size, num_blocks, rng)
        for j, block in enumerate(tables[at]):  # the row's logical K/V into its blocks
            keys[block, :, : min(block_size, n - j * block_size)] = row_k[
                :, j * block_size : (j + 1) * block_size
            ]
            values[block, :, : min(block_size, n - j * block_size)] = row_v[
                :, j * block_size : (j + 1) * block_size
            ]
        q = torch.randn(len(lengths), heads, dim)
        q[at] = row_q
        return _fused(q, keys, values, padded, lengths)[at]

    alone = run([n], 0)
    assert torch.equal(alone, run([n, 300, 150, 9], 0))
    assert torch.equal(alone, run([170, 2, 400, n], 3))
    torch.set_num_threads(2)  # the work split over threads must not matter either
    try:
        assert torch.equal(alone, run([250, n, 90, 310, 64], 1))
    finally:
        torch.set_num_threads(1)


@needs_kernel
def test_fused_path_of_paged_attention_equals_its_tensor_path():
    torch.manual_seed(5)
    kv_heads, heads, dim, block_size, num_blocks = 3, 9, 64, 16, 64
    cache = KVCache(
        KVShape(2, kv_heads, dim, block_size), num_blocks, 0, torch.device("cpu"), torch.float32
    )
    cache.pool.normal_()
    rng = random.Random(6)
    lengths = [rng.randrange(1, 100) for _ in range(7)]
    tables, _ = _tables(lengths, block_size, num_blocks, rng)
    seqs = [SeqRows(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    write_rows = torch.cat(
        [(s.table[s.start // block_size] * kv_heads + torch.arange(kv_heads)) * block_size
         + s.start % block_size for s in seqs]
    )  # fmt: skip
    q, k, v = (
        torch.randn(7, heads, dim),
        torch.randn(7, kv_heads, dim),
        torch.randn(7, kv_heads, dim),
    )
    args = (kv_heads, heads // kv_heads, block_size, torch.device("cpu"))
    tensor_plan = StepPlan(write_rows, plan_decode(seqs, *args), [])
    fused_plan = StepPlan(write_rows, plan_decode(seqs, *args, block_range=False), [])
    assert fused_plan.decode.blocks is None
    want = PagedAttention(cache, tensor_plan)(1, q, k, v)
    got = PagedAttention(cache, fused_plan, KERNEL)(1, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_missing_tools", lambda: "no C++ compiler 'c++' on PATH")
    cpu_kernels.load_kernels.cache_clear()
    yield
    monkeypatch.undo()
    cpu_kernels.load_kernels.cache_clear()


def test_without_a_compiler_auto_runs_attention_py_after_one_log_line(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="dorarl.engine.cpu_kernels"):
        assert resolve_backends(EngineConfig()).attention == "torch"
        assert resolve_backends(EngineConfig()).attention == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "fused CPU kernels unavailable (no C++ compiler 'c++' on PATH): the engine runs torch ops"
    ]
    with pytest.raises(ConfigError, match="^engine.attention: cpp could not be built here"):
        resolve_backends(EngineConfig(attention="cpp"))


def test_a_failed_build_falls_back_with_its_first_line(monkeypatch, caplog):
    def broken(*_):
        raise RuntimeError("Error building extension 'x': c++ exited 1\nmore detail")

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    cpu_kernels.load_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dorarl.engine.cpu_kernels"):
            assert cpu_kernels.load_kernels() is None
    finally:
        monkeypatch.undo()
        cpu_kernels.load_kernels.cache_clear()
    assert "did not build (Error building extension 'x': c++ exited 1)" in caplog.text


@pytest.mark.parametrize(
    "settings", [dict(device="cuda"), dict(dtype="bfloat16"), dict(device="cuda:1")]
)
def test_cpp_off_the_cpu_or_float32_is_refused_naming_the_key(settings):
    with pytest.raises(ConfigError, match="^engine.attention: cpp runs on cpu in float32 only"):
        EngineConfig(attention="cpp", **settings)


@needs_kernel
def test_auto_takes_the_kernel_where_it_fits_the_model_and_torch_where_not():
    auto = resolve_backends(EngineConfig())
    assert auto.attention == "cpp"
    assert fit_to_model(auto, EngineConfig(), 64, 3).attention == "cpp"
    assert fit_to_model(auto, EngineConfig(), 8, 2).attention == "torch"  # head_dim 8
    assert fit_to_model(auto, EngineConfig(), 64, 40).attention == "torch"
    bf16 = resolve_backends(EngineConfig(dtype="bfloat16"))
    assert bf16.attention == "torch"
    explicit = EngineConfig(attention="cpp")
    with pytest.raises(ConfigError, match="^engine.attention: cpp takes head_dim in"):
        fit_to_model(resolve_backends(explicit), explicit, 80, 2)


@needs_kernel
@pytest.mark.parametrize("dim", [16, 32, 64, 128])
def test_fused_rope_is_bit_identical_to_model_rotate(dim):
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(37, 15, dim, generator=gen) * 5
    x = qkv[:, :12]  # q|k heads of a q|k|v product: strided rows, as in the model
    angles = torch.rand(37, dim, generator=gen) * 300
    cos, sin = angles.cos().unsqueeze(1), signed_sin(angles.sin()).unsqueeze(1)
    assert torch.equal(KERNELS.rope(x, cos, sin), rotate(x, cos, sin))


@needs_kernel
@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_fused_rms_norm_is_within_two_ulps_of_torch_and_row_independent(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(70, hidden, generator=gen) * torch.rand(70, 1, generator=gen) * 10
    weight = torch.randn(hidden, generator=gen)
    got = KERNELS.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(
        got, rms_norm(x, weight, 1e-5), atol=0, rtol=4.8e-7
    )  # 2 ulps: 1 / sqrt, then x * inv
    for row in (0, 33, 69):
        assert torch.equal(KERNELS.rms_norm(x[row : row + 1], weight, 1e-5), got[row : row + 1])
    torch.set_num_threads(2)  # 70 rows split over two threads: the same bits
    try:
        assert torch.equal(KERNELS.rms_norm(x, weight, 1e-5), got)
    finally:
        torch.set_num_threads(1)


def test_two_checkouts_build_from_one_source_path(monkeypatch, tmp_path):
    """torch's build file records the source path: a second clone or worktree must hand it
    the same path as the first, or each would rebuild the other's kernels."""
    import torch.utils.cpp_extension

    built = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda name, sources, **_: built.append(sources)
    )
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    for checkout in ("a", "b"):
        source = tmp_path / checkout / "cpu_kernels.cpp"
        source.parent.mkdir()
        source.write_bytes(cpu_kernels.SOURCE.read_bytes())
        cpu_kernels._build(source, "dorarl_cpu_kernels")
    assert built[0] == built[1] and len(built[0]) == 1
    used = Path(built[0][0])
    assert used.is_relative_to(tmp_path / "extensions")
    assert used.read_bytes() == cpu_kernels.SOURCE.read_bytes()
