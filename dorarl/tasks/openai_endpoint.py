"""An OpenAI-compatible chat endpoint for users' agent code: one aiohttp server per process.

`Endpoint` serves `/episodes/<id>/v1/chat/completions` and `/episodes/<id>/v1/models` on
its own daemon thread and event loop (the agents run on that loop too), bound to loopback
unless told otherwise (an IPv6 host bracketed in its URLs), on a free port. Off loopback,
every call must carry the endpoint's bearer token (`api_key`, made per endpoint with
`secrets`; dorarl's clients send it). A call goes to the live episode its URL names
(`EpisodeCalls.receive`), which answers it once the engine has sampled its turn. Every call
gets an answer with a JSON body in OpenAI's error shape when it fails: a missing or wrong
token (401), an unknown or finished episode (404), a body that is not a JSON object or
nests deeper than `MAX_BODY_DEPTH` (400), an unknown route (404), a failure of dorarl's
own (500); a client that disconnects has its handler cancelled and the episode keeps its turn.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0  # binding a loopback port takes milliseconds
CALL_TIMEOUT_S = 3600.0  # a call waits for its engine turn: queueing, then sampling
SHUTDOWN_TIMEOUT_S = 2.0  # at close, for cancelled agents and calls to unwind
MAX_BODY_DEPTH = 64  # JSON nesting of a call's body; deeper is refused before anything recurses


class CallError(Exception):
    """A call answered with an HTTP error; `body()` is OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


class EpisodeCalls(Protocol):
    """What the endpoint needs of a live episode."""

    model: str  # the model's name, as /v1/models lists it

    async def receive(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion that answers `body` (raises `CallError`)."""
        ...


class Endpoint:
    """The server and its loop; `register` an episode, hand its agent `base_url(id)`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host.removeprefix("[").removesuffix("]")  # "[::1]" binds as "::1"
        self.api_key = secrets.token_urlsafe(32)  # what the agents' clients send
        self.needs_key = not is_loopback(self.host)
        self.episodes: dict[str, EpisodeCalls] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="agents")
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.http_client: Any = None  # the agents' clients' connections (on this loop)
        self.port = self.run(self._start(), START_TIMEOUT_S)

    def run(self, coro: Awaitable[Any], timeout_s: float) -> Any:
        """Run `coro` on the endpoint's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    @property
    def root(self) -> str:
        """`http://host:port`, an IPv6 host in brackets."""
        return f"http://{url_host(self.host)}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        return f"{self.root}/episodes/{episode_id}/v1"

    def register(self, episode_id: str, episode: EpisodeCalls) -> None:
        self.episodes[episode_id] = episode

    def unregister(self, episode_id: str) -> None:
        self.episodes.pop(episode_id, None)

    def close(self) -> None:
        """Stop serving: the agents still running (episodes left in flight) are cancelled."""
        self.run(self._stop(), START_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(START_TIMEOUT_S)

    async def _stop(self) -> None:
        # Agents and the handlers of their calls go first: a handler waits for an engine turn
        # that will not come, and aiohttp's shutdown would wait for it (SHUTDOWN_TIMEOUT_S).
        self.episodes.clear()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=SHUTDOWN_TIMEOUT_S)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.http_client is not None:
            await self.http_client.aclose()

    # --- the server ----------------------------------------------------------------------
    async def _start(self) -> int:
        app = web.Application(middlewares=[_json_errors, self._authorized])
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._completions)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        # A client that disconnects cancels its handler, so nothing waits on a dead socket.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        return self._runner.addresses[0][1]

    @web.middleware
    async def _authorized(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Off loopback, a call without the endpoint's bearer token is refused (401)."""
        if self.needs_key:
            scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
            right = hmac.compare_digest(sent.strip().encode(), self.api_key.encode())
            if scheme.lower() != "bearer" or not right:
                raise CallError(401, "a missing or wrong API key (the run's bearer token)", "invalid_api_key")  # fmt: skip
        return await handler(request)

    async def _completions(self, request: web.Request) -> web.Response:
        episode_id = request.match_info["episode"]
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise CallError(404, f"episode {episode_id!r} is unknown or finished", "no_episode")
        body = await _json_object(request)
        answer = await asyncio.wait_for(episode.receive(body), CALL_TIMEOUT_S)
        return web.json_response(answer)

    async def _models(self, request: web.Request) -> web.Response:
        """The episode's model; without one, the live episodes' models."""
        named = request.match_info.get("episode")
        if named is not None and named not in self.episodes:
            raise CallError(404, f"episode {named!r} is unknown or finished", "no_episode")
        live = [self.episodes[named]] if named is not None else self.episodes.values()
        names = sorted({e.model for e in live}) or ["dorarl"]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "dorarl"} for n in names]
        return web.json_response({"object": "list", "data": data})


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: reachable from elsewhere
        return False


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


async def _json_object(request: web.Request) -> dict[str, Any]:
    too_deep = CallError(400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels", "bad_json")  # fmt: skip
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CallError(400, f"the request body is not JSON ({exc})", "bad_json") from None
    except RecursionError:  # JSON's decoder recurses per level
        raise too_deep from None
    if not isinstance(body, dict):
        raise CallError(400, "the request body must be a JSON object", "bad_json")
    if _depth(body) > MAX_BODY_DEPTH:  # what reads it later (templates, json.dumps) recurses
        raise too_deep
    return body


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None  # fmt: skip
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as OpenAI's error body: the endpoint's own, aiohttp's (404, 405)."""
    try:
        return await handler(request)
    except CallError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        error = CallError(exc.status, f"{request.method} {request.path}: {exc.reason}", "route")
        return web.json_response(error.body(), status=exc.status)
    except TimeoutError:
        error = CallError(504, f"no turn sampled in {CALL_TIMEOUT_S:g} s", "timeout")
        return web.json_response(error.body(), status=504)
    except Exception as exc:  # dorarl's own failure: still an answer the client can read
        log.exception("%s %s failed", request.method, request.path)
        error = CallError(500, f"the endpoint failed: {type(exc).__name__}", "internal")
        return web.json_response(error.body(), status=500)


_ENDPOINTS: dict[str, Endpoint] = {}
_LOCK = threading.Lock()


def endpoint_for(host: str) -> Endpoint:
    """The process's endpoint on `host`, started on first use; it lives with the process."""
    with _LOCK:
        if host not in _ENDPOINTS:
            _ENDPOINTS[host] = Endpoint(host)
            log.info("agents' OpenAI endpoint on %s", _ENDPOINTS[host].root)
        return _ENDPOINTS[host]


def close_endpoint(host: str) -> None:
    """Stop the process's endpoint on `host`, if one runs (the run is over)."""
    with _LOCK:
        endpoint = _ENDPOINTS.pop(host, None)
    if endpoint is not None:
        endpoint.close()
