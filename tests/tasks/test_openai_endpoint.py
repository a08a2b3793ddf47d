"""The agents' OpenAI endpoint over loopback HTTP: bodies it refuses in OpenAI's error shape,
IPv6 hosts in its URLs, and the bearer token it requires off loopback."""

import asyncio
import json

import aiohttp
import openai
import pytest

from dorarl.tasks.openai_endpoint import MAX_BODY_DEPTH, Endpoint, is_loopback, url_host

TIMEOUT = aiohttp.ClientTimeout(total=10)
MESSAGES = [{"role": "user", "content": "hi"}]


class _Echo:
    """A live episode that answers every call with its body's message count."""

    model = "echo"

    async def receive(self, body):
        if body.get("fail"):
            raise KeyError("a bug of dorarl's")
        return {"object": "chat.completion", "messages": len(body["messages"])}


@pytest.fixture()
def endpoint(request):
    served = Endpoint(getattr(request, "param", "127.0.0.1"))
    served.register("e", _Echo())
    yield served
    served.close()


def _post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    async def post():
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(url, data=data, headers=headers or {}) as answer,
        ):
            return answer.status, await answer.json()

    return asyncio.run(post())


def _shaped(answer: dict) -> dict:
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}  # fmt: skip
    return answer["error"]


@pytest.mark.parametrize("depth", [MAX_BODY_DEPTH + 1, 500, 100_000])
def test_a_deeply_nested_body_is_a_400_in_openais_shape(endpoint, depth):
    body = b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"
    status, answer = _post(f"{endpoint.base_url('e')}/chat/completions", body)
    error = _shaped(answer)
    assert status == 400 and error["code"] == "bad_json" and "nests deeper than 64" in error["message"]  # fmt: skip
    ok = b'{"messages": [{"role": "user", "content": ' + b"[" * 50 + b"]" * 50 + b"}]}"
    assert _post(f"{endpoint.base_url('e')}/chat/completions", ok) == (200, {"object": "chat.completion", "messages": 1})  # fmt: skip


def test_a_failure_of_dorarls_own_is_a_500_in_openais_shape(endpoint):
    body = json.dumps({"messages": MESSAGES, "fail": True}).encode()
    status, answer = _post(f"{endpoint.base_url('e')}/chat/completions", body)
    assert status == 500 and _shaped(answer)["code"] == "internal"


@pytest.mark.parametrize("endpoint", ["::1", "[::1]"], indirect=True)
def test_an_ipv6_host_is_bracketed_in_urls_and_served(endpoint):
    assert endpoint.host == "::1" and not endpoint.needs_key
    assert endpoint.base_url("e") == f"http://[::1]:{endpoint.port}/episodes/e/v1"
    body = json.dumps({"messages": MESSAGES}).encode()
    assert _post(f"{endpoint.base_url('e')}/chat/completions", body)[0] == 200
    assert url_host("10.0.0.1") == "10.0.0.1" and url_host("fe80::1") == "[fe80::1]"


def test_loopback_hosts_are_told_from_others():
    assert all(is_loopback(h) for h in ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "::", "10.1.2.3", "gpu-node-3"])


@pytest.mark.parametrize("endpoint", ["0.0.0.0"], indirect=True)
def test_off_loopback_every_call_needs_the_runs_bearer_token(endpoint):
    assert endpoint.needs_key and len(endpoint.api_key) >= 32
    url = f"http://127.0.0.1:{endpoint.port}/episodes/e/v1"
    body = json.dumps({"messages": MESSAGES}).encode()
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": endpoint.api_key}]:
        status, answer = _post(f"{url}/chat/completions", body, headers)
        assert status == 401 and _shaped(answer)["code"] == "invalid_api_key"
    good = {"Authorization": f"Bearer {endpoint.api_key}"}
    assert _post(f"{url}/chat/completions", body, good)[0] == 200

    async def with_clients():
        keyed = openai.AsyncOpenAI(base_url=url, api_key=endpoint.api_key, max_retries=0)
        models = [m.id for m in (await keyed.models.list()).data]
        other = openai.AsyncOpenAI(base_url=url, api_key="guessed", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await other.models.list()
        return models

    assert asyncio.run(with_clients()) == ["echo"]


def test_on_loopback_calls_need_no_token(endpoint):
    body = json.dumps({"messages": MESSAGES}).encode()
    assert not endpoint.needs_key
    assert _post(f"{endpoint.base_url('e')}/chat/completions", body)[0] == 200
