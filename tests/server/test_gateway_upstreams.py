"""Several model servers behind one LLM resource: two real embedded engines (a tiny random Llama)
on 127.0.0.1 behind the real gateway. Attempts spread over both and stick to one; a killed
engine loses no call and leaves the rotation until a probe finds it again; only a call that sent
nothing moves to the other server (a raw socket that reads a call and hangs up is reported, not
retried); weight sync publishes only the servers that took the new weights."""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import ValidationError
from rich.console import Console

from agentbolt.algorithms.policy import EnginePolicy, RemotePolicy, publish, serve_policy, server_urls
from agentbolt.client import Client
from agentbolt.engine import EngineServer, ModelEngine, tiny_model_dir
from agentbolt.errors import ConfigError
from agentbolt.schemas import LLM, Claim, Event, RolloutCreate, Task
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.server.gateway_upstreams import public_url, rank_servers
from agentbolt.server.run import free_port

sys.path.insert(0, str(Path(__file__).parent))
from upstream_double import UpstreamDouble  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GREEDY = {"max_tokens": 3, "temperature": 0.0}
MESSAGES = [{"role": "user", "content": "Say something."}]


class Served:
    """An embedded engine behind its HTTP server, which can be stopped (killed: it no longer
    accepts connections) and started again on the same port."""

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        self.server = EngineServer(engine).start()
        self.port = self.server.port
        self.url = self.server.base_url
        self.up = True

    def stop(self) -> None:
        if self.up:
            self.server.stop()
            self.up = False

    def start(self) -> None:
        if not self.up:
            self.server = EngineServer(self.engine, port=self.port).start()
            self.up = True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engines(tiny: Path) -> Iterator[list[Served]]:
    served = [
        Served(ModelEngine.from_pretrained(tiny, device="cpu", dtype="float32", name="tiny", max_batch=8))
        for _ in range(2)
    ]
    yield served
    for s in served:
        s.stop()
        s.engine.close()


@pytest.fixture
def pair(engines: list[Served]) -> list[Served]:
    for s in engines:
        s.start()  # a test before may have left one stopped
    return engines


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(db=str(tmp_path / "store.db"), upstream_timeout=30.0)) as srv:
        srv.app.state.gateway.upstreams.probe_interval = 0.3
        # a stopped server refuses the probe at once; a busy one under the suite's load once took
        # over the 2 s default to answer it and was marked down (its attempts moved early)
        srv.app.state.gateway.upstreams.probe_timeout = 15.0
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def _claims(client: Client, llm: LLM, n: int) -> list[Claim]:
    client.publish_resources({"llm": llm})
    client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(n)])
    claims = [client.dequeue("w", lease_seconds=600) for _ in range(n)]
    assert all(c is not None for c in claims)
    return claims  # type: ignore[return-value]


def _agent(claim: Claim, retries: int = 0) -> openai.OpenAI:
    llm = claim.resources.resources["llm"]  # type: ignore[union-attr]
    assert isinstance(llm, LLM)
    return openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=retries, timeout=60)


def _calls(client: Client, claim: Claim) -> list[Event]:
    return [e for e in client.all_events(claim.rollout.id) if e.type == "llm_call"]


# Tests that pick a claim whose attempt ranks a given server first (of two) take 24 claims:
# that none does is 2**-24 likely (with 8, 1 in 256: it happened).
def _first(claim: Claim, urls: list[str]) -> str:
    return rank_servers(claim.attempt.id, urls)[0]


# ------------------------------------------------------------------ the resource


def test_the_resource_names_several_servers_and_refuses_a_server_named_twice(server, client):
    llm = LLM(base_url="http://10.0.0.1:8000/v1", upstreams=["http://10.0.0.2:8000/v1"], model="m")
    assert llm.servers == ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    assert LLM(base_url="http://10.0.0.1/v1", model="m").servers == ["http://10.0.0.1/v1"]  # as before
    with pytest.raises(ValidationError, match="named twice"):
        LLM(base_url="http://10.0.0.1/v1", upstreams=["http://10.0.0.1/v1/"], model="m")
    with pytest.raises(ValidationError, match="pattern"):
        LLM(base_url="http://10.0.0.1/v1", upstreams=["ftp://10.0.0.2"], model="m")
    body = {
        "resources": {
            "llm": {
                "type": "llm",
                "base_url": "http://10.0.0.1/v1",
                "upstreams": ["http://10.0.0.2/v1", "http://10.0.0.2/v1"],
                "model": "m",
            }
        }
    }
    answer = httpx.post(f"{server.url}/api/resources", json=body)
    assert answer.status_code == 422 and "named twice" in answer.text
    assert client.latest_resources() is None  # nothing stored


def test_the_agent_sees_the_gateway_only(server, client):
    llm = LLM(
        base_url="http://10.9.8.7:8000/v1",
        upstreams=["http://10.9.8.6:8000/v1"],
        model="m",
        api_key="sk-upstream-secret",
    )
    [claim] = _claims(client, llm, 1)
    seen = claim.resources.resources["llm"]  # type: ignore[union-attr]
    assert isinstance(seen, LLM) and seen.upstreams == [] and "/gateway/" in seen.base_url
    text = claim.model_dump_json()
    assert "10.9.8" not in text and "sk-upstream-secret" not in text
    # a recorded URL never carries user info or a query, where a key could hide
    assert public_url("http://user:pw@h.internal:8000/v1?key=k") == "http://h.internal:8000/v1"
    assert public_url("http://h.internal:8000/v1") == "http://h.internal:8000/v1"


# ------------------------------------------------------------------ spreading, stickiness


def test_attempts_spread_over_the_servers_and_stick_to_one(pair, server, client):
    a, b = pair
    urls = [a.url, b.url]
    claims = _claims(client, LLM(base_url=a.url, upstreams=[b.url], model="tiny"), 12)

    def agent(claim: Claim) -> None:
        agent = _agent(claim)
        for _ in range(2):
            assert agent.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY).choices
        stream = agent.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY)
        assert [chunk for chunk in stream]
        assert agent.completions.create(model="tiny", prompt="Once", **GREEDY).choices
        assert "tiny" in [m.id for m in agent.models.list()]  # its server's list

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(agent, claims))
    used = set()
    for claim in claims:
        calls = _calls(client, claim)
        assert len(calls) == 4
        servers = {c.data["upstream"] for c in calls}
        assert servers == {_first(claim, urls)}  # one server per attempt: its first by ranking
        assert all(c.data["error"] is None and c.data["model_version"] is not None for c in calls)
        used |= servers
    assert used == set(urls)  # both served (12 attempts all ranked alike: 1 in 2,048)


# ------------------------------------------------------------------ a server dies


def test_a_killed_server_loses_no_call_and_returns_after_a_probe(pair, server, client):
    a, b = pair
    urls = [a.url, b.url]
    gateway = server.app.state.gateway
    claims = _claims(client, LLM(base_url=a.url, upstreams=[b.url], model="tiny"), 10)
    on_b = [c for c in claims if _first(c, urls) == b.url]
    assert on_b and len(on_b) < len(claims)  # 1 in 512 that all rank alike
    calls_each, done = 6, [0]
    lock, half = threading.Lock(), threading.Event()
    stopped_at: list[float] = []

    def agent(claim: Claim) -> int:
        # OpenAI's client as agents use it (it retries a 502 itself): a call that reached the
        # dying server just as it closed its idle connections may need that
        agent = _agent(claim, retries=2)
        for _ in range(calls_each):
            answer = agent.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
            assert answer.choices[0].message.content is not None
            with lock:
                done[0] += 1
                if done[0] >= len(claims) * calls_each // 3:
                    half.set()
        return calls_each

    with ThreadPoolExecutor(len(claims)) as pool:
        futures = [pool.submit(agent, c) for c in claims]
        assert half.wait(60)
        stopping = time.time()
        b.stop()  # mid-run: calls in flight on it finish; it takes no new connection
        stopped_at.append(time.time())
        assert sum(f.result(timeout=90) for f in futures) == len(claims) * calls_each  # every call answered

    for claim in claims:
        calls = _calls(client, claim)
        assert len(calls) == calls_each  # one record per call: nothing lost, nothing doubled
        for call in calls:
            assert call.data["error"] is None and call.data["upstream_status"] == 200
            assert call.data["model_version"] is not None and call.data["upstream"] in urls
            if call.timestamp > stopped_at[0]:
                assert call.data["upstream"] == a.url  # nothing goes to the dead one
            elif claim.attempt.id not in {c.attempt.id for c in on_b}:
                assert call.data["upstream"] == a.url
    before = [c for claim in on_b for c in _calls(client, claim) if c.timestamp < stopping]
    assert before and {c.data["upstream"] for c in before} == {b.url}  # sticky until it died

    deadline = time.monotonic() + 10
    while b.url not in gateway.upstreams.down:  # a failed connection or a probe marked it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b.start()  # back on the same port
    while b.url in gateway.upstreams.down:  # a probe found it again
        assert time.monotonic() < deadline
        time.sleep(0.05)
    claim = on_b[0]
    _agent(claim).chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert _calls(client, claim)[-1].data["upstream"] == b.url  # its attempts are back on it


class HangUp:
    """A raw socket server that answers GETs (a probe sees it up) and reads each POST whole,
    then closes the connection without a byte of answer."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.posts = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(data) < length:
                    data += conn.recv(65536)
                data = data[length:]
                if head.startswith(b"POST"):
                    self.posts += 1
                    return  # read whole, then hang up
                body = b'{"object":"list","data":[]}'
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    def close(self) -> None:
        self.sock.close()


def test_only_a_call_that_sent_nothing_moves_to_another_server(pair, server, client, caplog):
    a = pair[0]
    gateway = server.app.state.gateway
    caplog.set_level(logging.INFO, logger="agentbolt.gateway")
    # refused: nothing was sent, so the call is answered by the other server
    dead = f"http://127.0.0.1:{free_port()}/v1"
    claims = _claims(client, LLM(base_url=dead, upstreams=[a.url], model="tiny"), 24)
    claim = next(c for c in claims if _first(c, [dead, a.url]) == dead)
    agent = _agent(claim)
    answer = agent.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert answer.choices[0].message.content is not None
    [call] = _calls(client, claim)
    assert call.data["upstream"] == a.url and call.data["error"] is None
    assert dead in gateway.upstreams.down
    moved = [r for r in caplog.records if "sent nothing" in r.getMessage()]
    assert len(moved) == 1
    agent.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)  # straight to the live one
    assert len([r for r in caplog.records if "sent nothing" in r.getMessage()]) == 1
    assert _calls(client, claim)[-1].data["upstream"] == a.url

    # a stream moves alike (its request goes out through the streaming transport)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    claims = _claims(client, LLM(base_url=dead, upstreams=[a.url], model="tiny"), 24)
    claim = next(c for c in claims if _first(c, [dead, a.url]) == dead)
    stream = _agent(claim).chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    [call] = _calls(client, claim)
    assert call.data["upstream"] == a.url and call.data["error"] is None and call.data["stream"]

    # read whole, then no answer: the server may have acted on it, so it is reported
    hang = HangUp()
    try:
        claims = _claims(client, LLM(base_url=hang.url, upstreams=[a.url], model="tiny"), 24)
        claim = next(c for c in claims if _first(c, [hang.url, a.url]) == hang.url)
        with pytest.raises(openai.APIStatusError) as info:
            _agent(claim).chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
        assert info.value.status_code == 502
        assert hang.url.split("/v1")[0].split("//")[1] not in info.value.response.text  # names no server
        time.sleep(0.2)  # time for a second try to arrive, were one sent
        assert hang.posts == 1  # not sent again, there or anywhere
        [call] = _calls(client, claim)
        assert call.data["upstream"] == hang.url and call.data["upstream_status"] is None
        assert call.data["error"]["error"]["type"] == "upstream_unavailable"
        assert hang.url not in gateway.upstreams.down  # it answered a connection: not dead
    finally:
        hang.close()


def test_each_server_gets_its_own_key_and_no_key_is_recorded(tmp_path):
    with UpstreamDouble() as one, UpstreamDouble() as two:
        keys = {one.base_url: "sk-one-secret", two.base_url: "sk-two-secret"}
        config = ServerConfig(db=str(tmp_path / "k.db"), upstream_api_keys=keys)
        with ServerThread(config) as srv, Client(srv.url) as client:
            llm = LLM(base_url=one.base_url, upstreams=[two.base_url], model="double")
            claims = _claims(client, llm, 24)
            for claim in claims:
                _agent(claim).chat.completions.create(model="double", messages=MESSAGES)
            for double in (one, two):
                assert double.calls  # 8 attempts ranked alike: 1 in 128
                assert {c.headers["authorization"] for c in double.calls} == {
                    f"Bearer {keys[double.base_url]}"
                }
            recorded = json.dumps([e.data for claim in claims for e in _calls(client, claim)])
            assert "sk-one-secret" not in recorded and "sk-two-secret" not in recorded
            assert one.base_url in recorded and two.base_url in recorded


# ------------------------------------------------------------------ weight sync


def _tiny_model(tiny: Path):  # noqa: ANN202
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)


def test_engine_sync_publishes_only_the_servers_that_took_the_weights(pair, tiny, client):
    a, b = pair
    policy = EnginePolicy(a.engine, a.url, str(tiny), replicas=[(b.engine, b.url)])
    model = _tiny_model(tiny)
    publish(client, policy, {"step": 0})
    assert client.latest_resources().resources["llm"].servers == [a.url, b.url]  # type: ignore[union-attr]

    b.stop()  # dead during the sync
    policy.sync(model, 1)
    assert policy.serving == [a.url] and a.engine.version == 1
    publish(client, policy, {"step": 1})
    llm = client.latest_resources().resources["llm"]  # type: ignore[union-attr]
    assert llm.base_url == a.url and llm.upstreams == []  # the new version: only the synced one

    b.start()
    policy.sync(model, 2)  # the next sync reaches it again
    assert policy.serving == [a.url, b.url] and a.engine.version == 2 and b.engine.version == 2
    publish(client, policy, {"step": 2})
    assert client.latest_resources().resources["llm"].servers == [a.url, b.url]  # type: ignore[union-attr]

    a.stop()
    b.stop()
    with pytest.raises(ConfigError, match="no model server took the weights of version 3"):
        policy.sync(model, 3)


def test_remote_sync_loads_the_adapter_on_every_live_server(pair, tiny, tmp_path):
    from agentbolt.algorithms.train_state import TrainConfig, export_weights, make_train_state

    a, b = pair
    state = make_train_state(_tiny_model(tiny), TrainConfig(lora=True, lora_r=4))
    saved = tmp_path / "adapter"
    export_weights(state.model, saved)
    policy = RemotePolicy(f"{a.url}, {b.url}/", "tiny", str(tiny), tmp_path / "adapters")
    assert policy.servers == [a.url, b.url]

    b.stop()
    first = f"policy-{policy.tag}-step-1"
    assert policy.sync(state.model, 1, saved=saved) == first
    assert policy.serving == [a.url] and policy.base_url == a.url and policy.upstreams == []
    assert _served(a) == {"tiny", first}  # served beside the weights, as vLLM serves LoRA

    b.start()
    policy.sync(state.model, 2, saved=saved)
    assert policy.serving == [a.url, b.url] and policy.upstreams == [b.url]
    second = f"policy-{policy.tag}-step-2"
    assert second in _served(a) and _served(b) == {"tiny", second}
    # a policy made later (a resumed run, another run on the same servers) loads new names
    again = RemotePolicy(a.url, "tiny", str(tiny), tmp_path / "adapters")
    assert again.tag != policy.tag and again.sync(state.model, 2, saved=saved) == f"policy-{again.tag}-step-2"


def _served(server) -> set[str]:
    return {m["id"] for m in server.engine.models()["data"]}


def test_serve_url_takes_several_servers(tiny, tmp_path):
    console = Console(file=None, quiet=True)
    with serve_policy(str(tiny), tmp_path, console, serve_url="http://h1:8000/v1,http://h2:8000/v1") as p:
        assert isinstance(p, RemotePolicy) and p.servers == ["http://h1:8000/v1", "http://h2:8000/v1"]
    assert server_urls(["http://h1/v1/", "http://h2/v1"]) == ["http://h1/v1", "http://h2/v1"]
    with pytest.raises(ConfigError, match="named twice"):
        server_urls("http://h1/v1, http://h1/v1/")
    with pytest.raises(ConfigError, match="http"):
        server_urls("http://h1/v1,h2:8000")
    json.dumps(server_urls("http://h1/v1"))  # plain strings
