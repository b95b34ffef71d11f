"""The injectors themselves: each fault really happens on the wire, after (or, for ``delay``,
instead of) the server's commit. Plain httpx and raw sockets, no idempotency key and no
rollout id, so the server sees exactly what the fault makes of one request."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest
from fault_injection import DropTransport, FaultProxy, Plan, endpoint_of

from agentbolt.client import Client
from agentbolt.server import ServerThread

BODY = orjson.dumps({"rollouts": [{"task": {"data": {"item": "x"}}}]})


def _stored(client: Client) -> int:
    return len(client.list_rollouts(limit=1000).items)


def test_endpoints_are_told_apart() -> None:
    assert endpoint_of("POST", "/api/rollouts") == "enqueue"
    assert endpoint_of("POST", "/api/rollouts/ro-1/cancel") == "cancel"
    assert endpoint_of("POST", "/api/attempts/at-1/finish?x=1") == "finish"
    assert endpoint_of("POST", "/gateway/ro-1/at-1/v1/chat/completions") == "gateway"
    assert endpoint_of("GET", "/api/rollouts") is None
    assert endpoint_of("POST", "/api/rollouts/wait") is None


def test_a_plan_faults_the_first_delivery_of_each_call_only() -> None:
    plan = Plan("enqueue", "drop")
    assert plan.fault_for("POST", "/api/rollouts", None, b"a") == "drop"
    assert plan.fault_for("POST", "/api/rollouts", None, b"a") is None  # the retry
    assert plan.fault_for("POST", "/api/rollouts", "k1", b"a") == "drop"  # a new key: a new call
    assert plan.fault_for("POST", "/api/rollouts", "k1", b"a") is None
    assert plan.fault_for("POST", "/api/dequeue", None, b"a") is None  # not the endpoint under test
    assert (plan.injected, plan.deliveries) == (2, {"enqueue": 4, "dequeue": 1})


def test_drop_transport_loses_the_answer_after_the_commit(server: ServerThread, client: Client) -> None:
    plan = Plan("enqueue", "drop")
    with httpx.Client(base_url=server.url, transport=DropTransport(plan)) as http:
        with pytest.raises(httpx.ReadError):
            http.post("/api/rollouts", content=BODY, headers={"content-type": "application/json"})
        assert _stored(client) == 1
        assert http.post(
            "/api/rollouts", content=BODY, headers={"content-type": "application/json"}
        ).is_success
    assert _stored(client) == 2 and plan.injected == 1


def _raw_post(port: int, body: bytes) -> tuple[bytes, BaseException | None]:
    """Send one POST on a raw socket; what came back before the connection ended, and how it ended."""
    head = f"POST /api/rollouts HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except OSError as exc:
            return received, exc
    return received, None


@pytest.mark.parametrize("kind", ["drop", "reset"])
def test_proxy_resets_after_the_commit(kind: str, server: ServerThread, client: Client) -> None:
    with FaultProxy(server.config.port, Plan("enqueue", kind)) as proxy:
        received, ended = _raw_post(proxy.port, BODY)
    assert isinstance(ended, ConnectionResetError), ended
    assert _stored(client) == 1
    if kind == "drop":
        assert received == b""
    else:
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 201") and len(body) == 1, received


def test_proxy_delivers_a_duplicate_at_once(server: ServerThread, client: Client) -> None:
    with FaultProxy(server.config.port, Plan("enqueue", "duplicate")) as proxy:
        r = httpx.post(
            f"{proxy.url}/api/rollouts", content=BODY, headers={"content-type": "application/json"}
        )
        proxy.settle()
    assert r.status_code == 201 and proxy.extra == [201]
    assert _stored(client) == 2  # no key, no id: the server cannot know it is the same request


def test_proxy_delays_a_request_past_the_client_timeout(server: ServerThread, client: Client) -> None:
    with FaultProxy(server.config.port, Plan("enqueue", "delay"), delay=1.0) as proxy:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{proxy.url}/api/rollouts",
                content=BODY,
                headers={"content-type": "application/json"},
                timeout=0.3,
            )
        assert _stored(client) == 0  # held
        proxy.settle()
        assert time.monotonic() - start >= 1.0
    assert proxy.extra == [201] and _stored(client) == 1


def test_proxy_passes_everything_else_through_on_one_connection(server: ServerThread) -> None:
    plan = Plan("dequeue", "reset")
    with FaultProxy(server.config.port, plan) as proxy, httpx.Client(base_url=proxy.url) as http:
        for _ in range(3):
            assert http.post(
                "/api/rollouts", content=BODY, headers={"content-type": "application/json"}
            ).is_success
        assert http.get("/api/rollouts").json()["items"][0]["task"]["data"] == {"item": "x"}
    assert plan.injected == 0 and plan.deliveries == {"enqueue": 3} and proxy.connections == 1
