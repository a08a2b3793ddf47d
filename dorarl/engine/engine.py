"""The rollout engine: continuous batching over a paged KV pool, one full-weight version (and
up to `engine.max_versions - 1` LoRA adapter versions over it, lora.py) at a time.

A step reads as schedule, move KV, run, postprocess. Between steps the engine accepts new
requests, continues multi-turn requests with an environment's observation (on the KV they
kept: the history is not prefilled again) or opens a new segment of one (a fresh prompt,
its KV computed anew, the request's output keeping every segment), exports and imports
requests with their KV (same version only), resumes requests from tokens (any version),
offloads KV to host memory, and swaps weights. With
`engine.prefix_cache=on` requests of the hosted version read the KV blocks of prompt tokens
another request computed (block_manager.py, prefix_cache.py); a weight load frees every
cached block of the old weights first. Invariants: every
sampled token is tagged with the version of the weights that sampled it; a bad request or
a bad weight update raises `UserInputError` and leaves every other request and the current
weights untouched. At start the engine checks its fast paths on its device (preflight.py;
`auto` falls back to torch attention or eager decode, recorded in `setup()`) and, on cuda,
sizes its KV pool from its share of the device's memory (memory.py).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from dorarl.config import ConfigError
from dorarl.data.routes import route_bytes, unrecorded
from dorarl.data.samples import SegmentStart
from dorarl.engine import cpu_kernels
from dorarl.engine.backends import fit_to_model, resolve_backends
from dorarl.engine.block_manager import BlockManager
from dorarl.engine.capabilities import Capabilities
from dorarl.engine.config import EngineConfig, SamplingParams
from dorarl.engine.device_runner import DeviceRunner, build_graphs
from dorarl.engine.host_memory import host_memory
from dorarl.engine.kv_cache import KVCache, KVShape
from dorarl.engine.linear import choose_kernel
from dorarl.engine.lora import BASE_SLOT, ResidentAdapters, parse_adapter
from dorarl.engine.memory import DEFAULT_SHARE, HOST_SHARE, KVPlan, plan_kv
from dorarl.engine.model import Transformer, rms_norm, rotate
from dorarl.engine.model_runner import ModelRunner
from dorarl.engine.model_spec import ModelSpec, read_hf_config, rope_tables, spec_from_hf
from dorarl.engine.outputs import (
    EarlierSegments,
    EngineSetup,
    EngineStats,
    FastPathFallback,
    RequestOutput,
    RequestSnapshot,
    StepWork,
    with_earlier,
)
from dorarl.engine.preflight import check_triton_attention
from dorarl.engine.scheduler import Batch, Restore, Scheduler
from dorarl.engine.sequence import KVPlace, Sequence, next_segment_seed
from dorarl.engine.stop_strings import Decode, FolderDecoder, StopText
from dorarl.engine.token_ids import (
    check_prompt,
    check_snapshot,
    check_vocabulary,
    checked_token_ids,
)
from dorarl.engine.weights import (
    check_named,
    from_checkpoint,
    load_folder,
    load_in_place,
    pack,
    random_named,
    unpack,
)
from dorarl.errors import UserInputError

if TYPE_CHECKING:
    from dorarl.engine.decode_graphs import DecodeGraphs  # needs triton

logger = logging.getLogger(__name__)
_COUNTERS = (
    "tokens",
    "steps",
    "offloads",
    "restores",
    "preemptions",
    "migrations_in",
    "migrations_out",
    "prefill_tokens",
    "prefill_saved_tokens",
    "multi_version_steps",
)


class Engine:
    # KV travels with a migrated request, moves to host memory, adapters share a step,
    # MoE routes are recorded, the weights are served to peers, log-probs are the trainer's
    capabilities = Capabilities(
        kv_export=True, offload=True, adapters=True, route_recording=True,
        serves_weights=True, exact_logprobs=True,
    )  # fmt: skip

    def __init__(
        self,
        hf_config: PretrainedConfig,
        config: EngineConfig,
        named_weights: dict[str, torch.Tensor],
        version: int = 0,
        where: str = "hf_config",
        decode: Decode | None = None,
    ) -> None:
        self.config = config
        self.decode = decode  # token ids -> text, for requests with stop strings
        self.hf_config = hf_config
        self.spec: ModelSpec = spec_from_hf(hf_config, where)
        self.device = torch.device(config.device)
        queries_per_kv = self.spec.num_heads // self.spec.num_kv_heads
        self.backends = fit_to_model(
            resolve_backends(config), config, self.spec.head_dim, queries_per_kv, where,
            experts=self.spec.moe is not None,
        )  # fmt: skip
        if config.max_versions > 1:  # the captured step has no per-row adapters (config.py)
            self.backends = dataclasses.replace(self.backends, cuda_graphs=False)
        self.dtype: torch.dtype = self.backends.dtype
        self.version = version
        self.fallbacks: list[FastPathFallback] = []
        self.kernel = choose_kernel(config.linear_kernel, self.device, self.dtype)
        self.model = self._build_model(named_weights, where)
        # None with one version: the layers stay plain Linears, with nothing added per step
        self.adapters = self._adapters()
        if self.backends.attention == "triton":
            self._check_triton(queries_per_kv)
        self._make_kv_pool()
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.prefill_chunk_size,
            config.offload_threshold, config.prefix_cache == "on", version,
        )  # fmt: skip
        fused = self._cpu_kernels()
        self.record_routes = self._records_routes(where)
        self.runner = ModelRunner(
            self.model, self.kv, fused.decode if fused else None, self.record_routes
        )
        self.graphs = self._graphs() if self.backends.cuda_graphs else None
        if self.backends.fast:  # the GPU fast paths; the CPU default keeps ModelRunner alone
            self.runner = DeviceRunner(self.model, self.runner, self.backends, self.graphs)
        self._seqs: dict[str, Sequence] = {}
        self._detached: dict[str, torch.Tensor] = {}  # imported KV waiting for device blocks
        self._seed_rng = random.Random(config.seed)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self.last_step = StepWork()  # what the latest `step` computed

    def _make_kv_pool(self) -> None:
        """The KV pool (on cuda: what its memory share holds) and its block manager."""
        config = self.config
        self.kv_plan = self._plan_pool()
        self.kv_blocks = config.kv_blocks if self.kv_plan is None else self.kv_plan.blocks
        shape = KVShape(
            self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, config.block_size
        )
        # With graphs, one more block than the block manager hands out: padding rows' scratch.
        pool_blocks = self.kv_blocks + int(self.backends.cuda_graphs)
        self.kv = KVCache(shape, pool_blocks, config.host_blocks, self.device, self.dtype)
        self.blocks = BlockManager(self.kv_blocks, config.host_blocks, config.block_size)

    def _records_routes(self, where: str) -> bool:
        if self.config.record_routes and self.spec.moe is None:
            logger.warning(
                "engine.record_routes: %s has no expert layers; nothing to record", where
            )
        return self.config.record_routes and self.spec.moe is not None

    # --- fast paths and memory, at start ------------------------------------------------
    def _check_triton(self, queries_per_kv: int) -> None:
        """Triton attention against the torch path on a tiny pool of this model's shape."""
        s = self.spec
        try:
            check_triton_attention(
                s.num_kv_heads, s.head_dim, queries_per_kv, self.config.block_size,
                self.device, self.dtype,
            )  # fmt: skip
        except Exception as exc:  # any failure there: a compile error, a launch, wrong values
            self._fall_back("attention", "torch", exc)
            if self.config.cuda_graphs == "on":
                raise ConfigError(
                    "engine.cuda_graphs: on captures the Triton decode step, which failed its "
                    f"start-up check on {self.device}: {_one_line(exc)}"
                ) from exc
            self.backends = dataclasses.replace(self.backends, attention="torch", cuda_graphs=False)

    def _graphs(self) -> DecodeGraphs | None:
        """The decode graphs, captured and checked; None (eager decode) where that fails."""
        try:
            return build_graphs(self.model, self.kv, self.config, self.kv_blocks)
        except Exception as exc:
            self._fall_back("cuda_graphs", "off", exc)
            self.backends = dataclasses.replace(self.backends, cuda_graphs=False)
            return None

    def _fall_back(self, key: str, instead: str, exc: Exception) -> None:
        """`auto` chose a path that failed here: warn and record it. An explicit choice fails
        in one line: the user asked for that path."""
        error = _one_line(exc)
        asked = getattr(self.config, key)
        if asked != "auto":
            raise ConfigError(
                f"engine.{key}: {asked} failed its start-up check on {self.device}: {error}"
            ) from exc
        logger.warning(
            "engine.%s=auto: its fast path failed its start-up check on %s, running %s "
            "instead: %s", key, self.device, instead, error,
        )  # fmt: skip
        self.fallbacks.append(FastPathFallback(key, instead, error))

    def _plan_pool(self) -> KVPlan | None:
        """The pool its memory share holds (an explicit engine.num_blocks wins): on cuda its
        GPU share, on the CPU `HOST_SHARE` of the host memory the process may use; refused in
        one line when not even one max_model_len sequence fits."""
        memory = device_memory(self.device)
        if memory is None:
            return None
        free, total = memory
        default = DEFAULT_SHARE if self.device.type == "cuda" else HOST_SHARE
        share = self.config.gpu_memory_share or default
        elem = torch.empty((), dtype=self.dtype).element_size()
        plan = plan_kv(self.spec, self.config, elem, self.backends.cuda_graphs, total, share, free)
        if not plan.explicit and not plan.fits:
            raise ConfigError(self._shortfall(plan))
        logger.info("engine on %s: %s", self.device, plan.describe())
        return plan

    def _shortfall(self, plan: KVPlan) -> str:
        """Why the default pool cannot run here, naming the key that sizes it."""
        if self.device.type == "cuda" or self.config.gpu_memory_share is not None:
            return (
                f"engine.gpu_memory_share: {plan.shortfall()} on {self.device} (a larger "
                "share, ray.engine_gpus, a smaller engine.max_model_len or a smaller model)"
            )
        return (
            f"engine.num_blocks: unset, and on the CPU {plan.shortfall()} (set "
            "engine.num_blocks, a smaller engine.max_model_len or a smaller model)"
        )

    def setup(self) -> EngineSetup:
        """What this engine runs and how its pool was sized (reported at start)."""
        b = self.backends
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return EngineSetup(
            attention=b.attention,
            sampler=b.sampler,
            cuda_graphs=b.cuda_graphs,
            dtype=str(b.dtype).removeprefix("torch."),
            kv_blocks=self.kv_blocks,
            block_size=self.config.block_size,
            kv_budget=None if self.kv_plan is None else self.kv_plan.describe(),
            peak_bytes=peak,
            fast_path_fallbacks=list(self.fallbacks),
        )

    def _build_model(self, named_weights: dict[str, torch.Tensor], where: str) -> Transformer:
        check_named(self.spec, named_weights, f"{where}: weights")
        weights = pack(self.spec, named_weights, self.device, self.dtype, self.kernel)
        cos, sin = rope_tables(self.hf_config, self.spec, self.config.max_model_len)
        fused = self._cpu_kernels()
        return Transformer(
            self.spec,
            weights,
            cos.to(self.device, self.dtype),
            sin.to(self.device, self.dtype),
            norm=fused.rms_norm if fused else rms_norm,
            rope=fused.rope if fused else rotate,
        )

    def _adapters(self) -> ResidentAdapters | None:
        c = self.config
        if c.max_versions == 1:
            return None
        return ResidentAdapters(self.spec, self.model.weights, c.max_versions - 1, c.max_lora_rank)

    def _cpu_kernels(self) -> cpu_kernels.CpuKernels | None:
        """engine.attention=cpp: decode attention, RMSNorm and RoPE on the fused C++ kernels."""
        return cpu_kernels.load_kernels() if self.backends.attention == "cpp" else None

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, folder: str | Path, config: EngineConfig, version: int = 0) -> Engine:
        """Load a local Hugging Face folder (config.json + *.safetensors)."""
        hf_config = read_hf_config(folder)
        where = str(Path(folder) / "config.json")
        named = from_checkpoint(spec_from_hf(hf_config, where), load_folder(folder))
        return cls(hf_config, config, named, version, where, FolderDecoder(str(folder)))

    @classmethod
    def from_hf_config(
        cls,
        hf_config: PretrainedConfig,
        config: EngineConfig,
        state_dict: dict[str, torch.Tensor] | None = None,
        version: int = 0,
        seed: int = 0,
        decode: Decode | None = None,
    ) -> Engine:
        """Build from a transformers config, with its state dict or a seeded random init;
        `decode` (token ids -> text) serves requests with stop strings."""
        if state_dict is None:
            std = getattr(hf_config, "initializer_range", 0.02)
            state_dict = random_named(spec_from_hf(hf_config), seed, std)
        return cls(hf_config, config, state_dict, version, decode=decode)

    # --- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        version: int | None = None,
    ) -> None:
        """Queue a request; it runs under `version` from its first token to its last: a
        resident adapter's (`load_adapter`), or None (or the hosted version) the full weights'."""
        params = params or SamplingParams()
        prompt = checked_token_ids(request_id, prompt_ids)
        self._check_new(request_id, prompt, params)
        adapter = self._adapter_version(request_id, version)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(request_id, prompt, params, seed, self._stop_ids(params))
        seq.lora_version = adapter
        seq.stop_text = self._stop_text(params, prompt, [])
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _adapter_version(self, request_id: str, version: int | None) -> int | None:
        """The adapter version a request asks for (None: the full weights), checked resident."""
        if version is None or version == self.version:
            return None
        if self.adapters is None or self.adapters.slot_of(version) is None:
            raise UserInputError(
                f"request {request_id!r}: version {version} is not resident in this engine "
                f"(resident: {self.resident_versions()})"
            )
        return version

    def _version_of(self, seq: Sequence) -> int:
        return self.version if seq.lora_version is None else seq.lora_version

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = self.spec.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        return frozenset(operator.index(t) for t in ids)  # checked by params.validate

    def _stop_text(
        self, params: SamplingParams, before: list[int], turn: list[int]
    ) -> StopText | None:
        if not params.stop_strings or params.target_len is not None:
            return None
        assert self.decode is not None, "checked by _check_new"
        return StopText.open(params.stop_strings, self.decode, before, turn)

    def _check_new(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise UserInputError(
                f"request {request_id!r}: a request with this id is already in the engine"
            )
        params.validate(request_id)
        if params.stop_strings and self.decode is None:
            raise UserInputError(
                f"request {request_id!r}: sampling.stop_strings needs the model's tokenizer "
                "(an engine from a model folder, or Engine(..., decode=...))"
            )
        limit = self.config.max_model_len
        check_prompt(request_id, prompt_ids, limit, self.spec.vocab_size)
        if params.target_len is not None and len(prompt_ids) + params.target_len > limit:
            raise UserInputError(
                f"request {request_id!r}: prompt {len(prompt_ids)} + target_len {params.target_len} tokens "
                f"exceeds max_model_len {limit} (engine.max_model_len)"
            )

    def _check_vocabulary(self, request_id: str, token_ids: list[int], what: str) -> None:
        """Refuse token ids outside the model's vocabulary (`what` names the tokens)."""
        check_vocabulary(request_id, token_ids, self.spec.vocab_size, what)

    def has_unfinished(self) -> bool:
        """Any request in the engine, multi-turn ones waiting for their environment included."""
        return bool(self._seqs)

    def has_runnable(self) -> bool:
        """Any request a step can advance (not waiting for its environment)."""
        return self.scheduler.num_unfinished > 0

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    def progress(self, request_id: str) -> int:
        """Output tokens the request has so far."""
        return self._get(request_id).num_output

    def block_table(self, request_id: str) -> list[int]:
        """The device blocks the request reads now, in order (a copy; empty off the device)."""
        return list(self._get(request_id).block_table)

    # --- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule, move KV, forward + sample, postprocess. Returns finished
        requests; `last_step` then says what it computed."""
        batch = self.scheduler.schedule()
        assert not (batch.empty and self.scheduler.num_unfinished), (
            "scheduler stalled with unfinished requests"
        )
        self._move_kv(batch)
        versions = self._begin_adapters(batch) if self.adapters is not None else 1
        sampled = self.runner.run(batch) if batch.decode or batch.prefill else []
        self._counters["steps"] += 1
        finished = self._postprocess(batch, sampled)
        prefill = sum(n for _, n in batch.prefill)
        self._counters["prefill_tokens"] += prefill
        self._counters["prefill_saved_tokens"] += batch.saved_tokens
        self.last_step = StepWork(
            rows=len(batch.decode) + len(batch.prefill),
            decode_tokens=len(batch.decode),
            prefill_tokens=prefill,
            resident_tokens=sum(seq.num_computed for seq in self.scheduler.running),
            saved_tokens=batch.saved_tokens,
            versions=versions,
        )
        return finished

    def _begin_adapters(self, batch: Batch) -> int:
        """Each row's adapter slot for the step's products, from the sequences it runs;
        returns how many versions the step runs."""
        assert self.adapters is not None
        items = batch.items
        slots = [self._slot_of(seq) for seq, _ in items]
        self.adapters.begin_step(slots, [n for _, n in items])
        if len(set(slots)) > 1:
            self._counters["multi_version_steps"] += 1
        return max(1, len(set(slots)))

    def _slot_of(self, seq: Sequence) -> int:
        if seq.lora_version is None:
            return BASE_SLOT
        assert self.adapters is not None
        slot = self.adapters.slot_of(seq.lora_version)
        assert slot is not None, "unload_version refuses versions with requests"
        return slot

    def _move_kv(self, batch: Batch) -> None:
        # Offloads first: a restore or a copy may reuse device blocks an offload just vacated.
        for off in batch.offloads:
            self.kv.offload(off.device_blocks, off.host_blocks)
        for res in batch.restores:
            self._restore(res)
        if batch.copies:
            self.kv.copy_blocks([c.src for c in batch.copies], [c.dst for c in batch.copies])
            self.scheduler.copied(batch)
        self._counters["offloads"] += len(batch.offloads)
        self._counters["restores"] += sum(r.source is KVPlace.HOST for r in batch.restores)
        self._counters["preemptions"] += len(batch.preempted)

    def _restore(self, res: Restore) -> None:
        """A sequence's KV back into the pool, but for its first `skip` blocks, which it
        reads from the prefix cache instead."""
        kv = self._detached.pop(res.seq.request_id, None)
        if not res.device_blocks:
            return
        if res.source is KVPlace.HOST:
            self.kv.restore(res.host_blocks[res.skip :], res.device_blocks)
        else:
            assert kv is not None, f"request {res.seq.request_id!r}: no imported KV to restore"
            self.kv.load(kv[:, :, :, res.skip * self.config.block_size :], res.device_blocks)

    def _postprocess(
        self, batch: Batch, sampled: list[tuple[Sequence, int, float]]
    ) -> list[RequestOutput]:
        self.scheduler.computed(batch)
        finished = []
        routes = self.runner.last_routes if self.record_routes else None
        for row, (seq, token, logprob) in enumerate(sampled):
            seq.append(token, logprob, self._version_of(seq), self.config.max_model_len)
            if routes is not None:
                seq.routes += routes[row].numpy().tobytes()
            if seq.finished and seq.params.multi_turn:
                self.scheduler.park(seq)  # a turn ended: the caller continues or ends it
                finished.append(_output(seq))
            elif seq.finished:
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
                finished.append(_output(seq))
        self._counters["tokens"] += len(sampled)
        return finished

    # --- multi-turn ---------------------------------------------------------------------
    def continue_request(self, request_id: str, observation_ids: list[int]) -> bool:
        """Append an environment's observation to a request waiting for it and open its next
        turn on the KV it kept. False (nothing changed) when the observation would leave no
        room for a sampled token under max_model_len: the caller ends the episode."""
        seq = self._waiting(request_id)
        obs = checked_token_ids(request_id, observation_ids, "observation_ids")
        self._check_vocabulary(request_id, obs, "observation ")
        room = self.config.max_model_len - seq.num_tokens - len(obs)
        if room < (seq.params.target_len or 1):
            return False
        seq.observe(obs, self._version_of(seq))
        if self.record_routes:
            seq.routes += self._no_routes(len(obs))
        self.scheduler.unpark(seq)
        return True

    def start_segment(self, request_id: str, prompt_ids: list[int]) -> bool:
        """Open a new segment of a request waiting for its environment: `prompt_ids` is a
        fresh context (an agent's call that does not extend its conversation), its KV
        computed from scratch (or the prefix cache) under the request's version; the
        request's KV so far is freed and its tokens stay in its output, the new prompt
        observed there. False (nothing changed) when the prompt leaves no room for a
        sampled token under max_model_len: the caller ends the episode."""
        seq = self._waiting(request_id)
        prompt = checked_token_ids(request_id, prompt_ids, "prompt_ids")
        if not prompt:
            raise UserInputError(f"request {request_id!r}: a new segment with an empty prompt")
        self._check_vocabulary(request_id, prompt, "segment prompt ")
        if self.config.max_model_len - len(prompt) < (seq.params.target_len or 1):
            return False
        fresh = Sequence(
            request_id, prompt, seq.params, next_segment_seed(seq.seed), seq.stop_ids,
            migrations=seq.migrations, offloads=seq.offloads,
            reprefill_tokens=seq.reprefill_tokens,
            earlier=self._earlier(seq, prompt),
        )  # fmt: skip
        fresh.lora_version = seq.lora_version
        fresh.stop_text = self._stop_text(seq.params, prompt, [])
        self._drop(seq)
        self._seqs[request_id] = fresh
        self.scheduler.add(fresh)
        return True

    def _earlier(self, seq: Sequence, prompt: list[int]) -> EarlierSegments:
        """`seq`'s segments, its own included, with `prompt` opening the next one."""
        e = seq.earlier or EarlierSegments(list(seq.prompt_ids), [], [], [], [], b"", [])
        routes = self._no_routes(len(prompt)) if self.record_routes else b""
        return EarlierSegments(
            e.prompt_ids,
            e.output_ids + seq.output_ids + prompt,
            e.logprobs + seq.logprobs + [0.0] * len(prompt),
            e.versions + seq.versions + [self._version_of(seq)] * len(prompt),
            e.observed + seq.observed + [True] * len(prompt),
            e.routes + bytes(seq.routes) + routes,
            [*e.starts, SegmentStart(len(e.output_ids) + seq.num_output, len(prompt))],
        )

    def _no_routes(self, tokens: int) -> bytes:
        assert self.spec.moe is not None
        return unrecorded(tokens, self.spec.moe.route_width, self.spec.moe.num_experts)

    def end_request(self, request_id: str) -> RequestOutput:
        """End a request waiting for its environment (the episode is done): its output,
        every turn and observation in it, and its blocks back to the pools."""
        seq = self._waiting(request_id)
        self._drop(seq)
        return _output(seq)

    def _waiting(self, request_id: str) -> Sequence:
        seq = self._get(request_id)
        if not seq.waits_env:
            raise UserInputError(f"request {request_id!r} is not waiting for an observation")
        return seq

    # --- leaving and joining ------------------------------------------------------------
    def export_request(self, request_id: str, to_host: bool = True) -> RequestSnapshot:
        """Remove a request and return its full state with its KV (no re-prefill needed):
        on the CPU, or with `to_host=False` KV in the device pool stays on the device."""
        seq = self._get(request_id)
        kv = self._export_kv(seq, to_host)
        snap = _snapshot(seq, self._version_of(seq), kv)
        self._drop(seq)
        self._counters["migrations_out"] += 1
        return snap

    def _export_kv(self, seq: Sequence, to_host: bool) -> torch.Tensor | None:
        if seq.num_computed == 0:
            return None
        if seq.kv_place is KVPlace.DEVICE:
            return self.kv.export(seq.block_table, seq.num_computed, to_host)
        if seq.kv_place is KVPlace.HOST:
            return self.kv.export_host(seq.host_table, seq.num_computed)
        detached = self._detached[seq.request_id]  # on the device if it came device to device
        return self.kv.host_copy(detached) if to_host else detached

    def import_request(self, snap: RequestSnapshot) -> None:
        """Continue a request exported by an engine of the same version (its full weights or
        a resident adapter), reusing its KV."""
        resident = self.adapters is not None and self.adapters.slot_of(snap.version) is not None
        if snap.version != self.version and not resident:
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot of version {snap.version} cannot be imported into an "
                f"engine of version {self.version} (its KV belongs to other weights; use resume_request)"
            )
        self._check_snapshot_kv(snap)
        seq = self._sequence_from(snap)
        seq.lora_version = None if snap.version == self.version else snap.version
        seq.migrations += 1
        snap.migrations = seq.migrations
        if snap.kv is not None and snap.num_computed > 0:
            seq.num_computed = snap.num_computed
            seq.kv_place = KVPlace.DETACHED
            seq.kv_version = None if snap.kv_mixed else snap.version
            self._detached[seq.request_id] = snap.kv
        self._enqueue(seq)
        self._counters["migrations_in"] += 1

    def resume_request(self, snap: RequestSnapshot, version: int | None = None) -> None:
        """Continue a request from its tokens by re-prefill, under this engine's version or
        the resident adapter `version`.

        Earlier tokens keep their versions and logprobs (partial rollout); new ones get
        the version it continues under."""
        adapter = self._adapter_version(snap.request_id, version)
        seq = self._sequence_from(snap)
        seq.lora_version = adapter
        seq.reprefill_tokens += max(0, seq.num_tokens - 1)
        self._enqueue(seq)

    def abort(self, request_id: str) -> RequestSnapshot:
        """Interrupt a request; returns its tokens-only snapshot (KV dropped)."""
        seq = self._get(request_id)
        snap = _snapshot(seq, self._version_of(seq), None)
        self._drop(seq)
        return snap

    def _sequence_from(self, snap: RequestSnapshot) -> Sequence:
        prompt_ids = checked_token_ids(snap.request_id, snap.prompt_ids)
        output_ids = checked_token_ids(snap.request_id, snap.output_ids, "output_ids")
        self._check_new(snap.request_id, prompt_ids, snap.params)
        check_snapshot(snap, self.config.max_model_len)
        seq = Sequence(
            snap.request_id, prompt_ids, snap.params, snap.seed, frozenset(snap.stop_token_ids),
            token_ids=prompt_ids + output_ids, logprobs=list(snap.logprobs),
            versions=list(snap.versions), migrations=snap.migrations, offloads=snap.offloads,
            reprefill_tokens=snap.reprefill_tokens,
            observed=list(snap.observed) or [False] * len(output_ids),
            turn_start=snap.turn_start, waits_env=snap.waits_env,
            routes=bytearray(self._snapshot_routes(snap)), earlier=snap.earlier,
        )  # fmt: skip
        if seq.waits_env:
            seq.finish_reason, seq.stop_string = snap.turn_reason, snap.turn_stop_string
        opened = seq.num_prompt + seq.turn_start
        seq.stop_text = self._stop_text(snap.params, seq.token_ids[:opened], seq.token_ids[opened:])
        return seq

    def _snapshot_routes(self, snap: RequestSnapshot) -> bytes:
        """The snapshot's routes, one per output token, or none where this engine records
        none; tokens sampled by an engine that did not record get 'no route'."""
        if not self.record_routes:
            return b""
        assert self.spec.moe is not None
        tokens, m = len(snap.output_ids), self.spec.moe
        if not snap.routes:
            return self._no_routes(tokens)
        if len(snap.routes) != route_bytes(tokens, m.route_width, m.num_experts):
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot routes hold {len(snap.routes)} bytes, "
                f"{tokens} output tokens of this model take "
                f"{route_bytes(tokens, m.route_width, m.num_experts)}"
            )
        return snap.routes

    def _check_snapshot_kv(self, snap: RequestSnapshot) -> None:
        if snap.kv is None:
            return
        s = self.spec
        expected = (2, s.num_layers, s.num_kv_heads, snap.num_computed, s.head_dim)
        if tuple(snap.kv.shape) != expected:
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot KV has shape {tuple(snap.kv.shape)}, "
                f"this engine expects {expected}"
            )
        if snap.num_computed >= snap.num_tokens:
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot KV covers more tokens than it holds"
            )

    def _enqueue(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        if seq.waits_env:
            self.scheduler.park(seq)
        else:
            self.scheduler.add(seq)

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._detached.pop(seq.request_id, None)
        del self._seqs[seq.request_id]

    def _get(self, request_id: str) -> Sequence:
        if request_id not in self._seqs:
            raise UserInputError(f"request {request_id!r} is not in this engine")
        return self._seqs[request_id]

    # --- memory ---------------------------------------------------------------------------
    def offload(self, request_id: str) -> bool:
        """Move a running (or waiting-for-env) request's KV to the host pool now; False if
        its KV is not on the device or the host pool lacks room. It is restored when the scheduler readmits it."""
        seq = self._get(request_id)
        batch = Batch()
        if not self.scheduler.offload(seq, batch):
            return False
        self._move_kv(batch)
        return True

    def stats(self) -> EngineStats:
        waiting = self.scheduler.waiting()
        offloaded = sum(seq.kv_place is KVPlace.HOST for seq in waiting)
        c = self._counters
        return EngineStats(
            version=self.version,
            running=len(self.scheduler.running),
            waiting=len(waiting) - offloaded,
            offloaded=offloaded,
            env_waiting=len(self.scheduler.parked),
            kv_blocks_used=self.blocks.device.num_used,
            kv_blocks_free=self.blocks.device.num_free,
            kv_blocks_total=self.blocks.device.num_total,
            kv_blocks_cached=self.blocks.device.num_cached,
            host_blocks_used=self.blocks.host.num_used,
            host_blocks_total=self.blocks.host.num_total,
            max_num_seqs=self.config.max_num_seqs,
            tokens_generated=c["tokens"],
            steps=c["steps"],
            offloads=c["offloads"],
            restores=c["restores"],
            preemptions=c["preemptions"],
            migrations_in=c["migrations_in"],
            migrations_out=c["migrations_out"],
            prefill_tokens=c["prefill_tokens"],
            prefill_saved_tokens=c["prefill_saved_tokens"],
            multi_version_steps=c["multi_version_steps"],
        )

    # --- weights ------------------------------------------------------------------------
    def load_weights(
        self,
        named_tensors: dict[str, torch.Tensor],
        version: int,
        check: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        """Swap in another version's weights between steps (all tensors checked first, by
        `check` too when given: a refused load leaves the old weights whole).

        Every cached prefix block of the old weights is freed first. Requests still in the
        engine continue on their existing KV under the new weights and their new tokens
        carry the new version (their KV is shared with no request of the new version);
        callers that need one version per trajectory migrate or abort them first. Resident
        LoRA adapters stay in their slots, over the new weights."""
        check_named(self.spec, named_tensors, f"load_weights(version={version})")
        if check is not None:
            check(named_tensors)
        if version in self.resident_versions()[1:]:
            raise UserInputError(
                f"load_weights(version={version}): an adapter of this version is resident "
                "(unload_version it first)"
            )
        # KV of the old weights is never read by a request that starts from now on.
        self.scheduler.new_version(version)
        # tensor by tensor into the live storage: no transient second weight set, and the
        # captured graphs, which read these addresses, stay valid
        load_in_place(self.spec, self.model.weights, named_tensors)
        if self._seqs:
            logger.warning(
                "version %d -> %d with %d requests in flight",
                self.version,
                version,
                len(self._seqs),
            )
        self.version = version

    # --- adapters ------------------------------------------------------------------------
    def load_adapter(
        self, version: int, tensors: dict[str, torch.Tensor], alpha: float, rank: int
    ) -> None:
        """Hold a LoRA adapter over the full weights as `version` in a free slot, for
        requests added with that version. `tensors` are peft's lora_A / lora_B by name
        (`get_peft_model_state_dict`); the delta is B @ A * alpha / rank. All checked
        first: a refused adapter leaves every resident one as it was."""
        where = f"load_adapter(version={version})"
        adapters = self._adapter_room(version, rank, where)
        slot = adapters.free_slot()
        assert slot is not None, "checked by _adapter_room"
        adapter = parse_adapter(tensors, alpha, rank, adapters.layers, where)
        adapters.load(version, adapter, slot)

    def _adapter_room(self, version: int, rank: int, where: str) -> ResidentAdapters:
        c = self.config
        if self.adapters is None or self.adapters.free_slot() is None:
            raise UserInputError(
                f"{where}: engine.max_versions={c.max_versions} and versions "
                f"{self.resident_versions()} are resident (unload_version one, or a larger "
                "engine.max_versions)"
            )
        if not 0 < rank <= c.max_lora_rank:
            raise UserInputError(
                f"{where}: rank {rank} is outside 1..engine.max_lora_rank={c.max_lora_rank}"
            )
        if version in self.resident_versions():
            raise UserInputError(f"{where}: version {version} is resident already")
        return self.adapters

    def unload_version(self, version: int) -> None:
        """Free the slot of a resident adapter; refused while requests of it are in the
        engine (a request keeps one version from first token to last)."""
        slot = None if self.adapters is None else self.adapters.slot_of(version)
        if slot is None:
            raise UserInputError(
                f"unload_version({version}): no adapter of this version is resident "
                f"(resident: {self.resident_versions()})"
            )
        users = [s.request_id for s in self._seqs.values() if s.lora_version == version]
        if users:
            raise UserInputError(
                f"unload_version({version}): {len(users)} request(s) still run under it, "
                f"e.g. {users[0]!r} (finish, abort or export them first)"
            )
        assert self.adapters is not None
        self.adapters.unload(slot)

    def adapter_tensors(self, version: int) -> tuple[dict[str, torch.Tensor], float, int]:
        """A resident adapter as loaded: its A and B by the names they came by (read-only
        views of its slot, copy what you keep), its alpha and rank."""
        slot = None if self.adapters is None else self.adapters.slot_of(version)
        if slot is None:
            raise UserInputError(
                f"adapter_tensors({version}): no adapter of this version is resident "
                f"(resident: {self.resident_versions()})"
            )
        assert self.adapters is not None
        held = self.adapters.held[slot]
        return self.adapters.tensors(slot), held.alpha, held.rank

    def versions_in_use(self) -> set[int]:
        """The versions the engine's requests run under (a resident adapter stays while one
        of its requests is here)."""
        return {self._version_of(seq) for seq in self._seqs.values()}

    def resident_versions(self) -> list[int]:
        """The versions this engine serves now: its full weights' first, then its adapters' in order."""
        return [self.version] + (self.adapters.resident() if self.adapters else [])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights by Hugging Face name (read-only views; with CUDA graphs a
        later `load_weights` copies into the same storage, so copy what you keep)."""
        return unpack(self.spec, self.model.weights)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes the engine may use: a cuda device's now, the host memory this
    process may use on the CPU; None elsewhere (a pool of max_num_seqs sequences)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    return host_memory() if device.type == "cpu" else None


def _one_line(exc: Exception) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _output(seq: Sequence) -> RequestOutput:
    out = RequestOutput(
        request_id=seq.request_id,
        prompt_ids=list(seq.prompt_ids),
        output_ids=seq.output_ids,
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        finish_reason=seq.finish_reason or "length",
        migrations=seq.migrations,
        offloads=seq.offloads,
        reprefill_tokens=seq.reprefill_tokens,
        observed=list(seq.observed),
        turn_start=seq.turn_start,
        waits_env=seq.waits_env,
        stop_string=seq.stop_string,
        routes=bytes(seq.routes),
    )
    return out if seq.earlier is None else with_earlier(out, seq.earlier)


def _snapshot(seq: Sequence, version: int, kv: torch.Tensor | None) -> RequestSnapshot:
    return RequestSnapshot(
        request_id=seq.request_id,
        prompt_ids=list(seq.prompt_ids),
        output_ids=seq.output_ids,
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        params=seq.params,
        seed=seq.seed,
        version=version,
        num_computed=seq.num_computed if kv is not None else 0,
        kv=kv,
        migrations=seq.migrations,
        offloads=seq.offloads,
        reprefill_tokens=seq.reprefill_tokens,
        stop_token_ids=sorted(seq.stop_ids),
        observed=list(seq.observed),
        turn_start=seq.turn_start,
        waits_env=seq.waits_env,
        turn_reason=seq.finish_reason if seq.waits_env else None,
        kv_mixed=kv is not None and seq.kv_version is None,  # None once a weight load came
        turn_stop_string=seq.stop_string if seq.waits_env else None,
        routes=bytes(seq.routes),
        earlier=seq.earlier,
    )
