"""Security properties of the server: runners write only to attempts they hold, secrets stay
out of logs, events and every API answer, CORS is off unless configured, and SQL is built
from parameters, never from values."""

from __future__ import annotations

import ast
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentbolt.client import Client
from agentbolt.schemas import LLM, PromptTemplate, RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread

sys.path.insert(0, str(Path(__file__).parent))
from upstream_double import UpstreamDouble  # noqa: E402

ADMIN, RUNNER, READER = "adm-token-7f3a", "run-token-91bc", "read-token-4d20"
TOKENS = {ADMIN: Role.ADMIN, RUNNER: Role.RUNNER, READER: Role.READER}
RESOURCE_KEY = "sk-resource-key-0a1b2c3d4e5f"  # an LLM resource's own api_key
CONFIG_KEY = "sk-config-key-9z8y7x6w5v4u"  # the server's upstream_api_keys


def _h(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def secure(tmp_path) -> Iterator[ServerThread]:
    config = ServerConfig(db=str(tmp_path / "sec.db"), tokens=TOKENS)
    with ServerThread(config) as srv:
        yield srv


# ---------------------------------------------------------------------------- runner ownership


def _claim(url: str, worker: str) -> dict:
    with Client(url, ADMIN) as admin:
        admin.enqueue([RolloutCreate(task=Task(data={}))])
    claim = httpx.post(f"{url}/api/dequeue", json={"worker_id": worker}, headers=_h(RUNNER)).json()
    assert claim is not None
    return claim


@pytest.mark.parametrize(
    ("action", "body"),
    [("heartbeat", {}), ("events", {"events": [{"type": "message"}]}), ("finish", {"status": "succeeded"})],
)
def test_a_runner_token_must_name_the_worker_holding_the_attempt(secure, action, body):
    url = secure.url
    aid = _claim(url, "owner")["attempt"]["id"]
    post = f"{url}/api/attempts/{aid}/{action}"
    r = httpx.post(post, json=body, headers=_h(RUNNER))  # no worker_id
    assert r.status_code == 422 and "worker_id" in r.json()["error"]["message"]
    r = httpx.post(post, json={**body, "worker_id": "intruder"}, headers=_h(RUNNER))
    assert r.status_code == 409 and "another worker" in r.json()["error"]["message"]
    assert httpx.post(post, json={**body, "worker_id": "owner"}, headers=_h(RUNNER)).status_code == 200


def test_an_admin_may_write_to_an_attempt_without_naming_a_worker(secure):
    aid = _claim(secure.url, "owner")["attempt"]["id"]
    r = httpx.post(f"{secure.url}/api/attempts/{aid}/finish", json={"status": "failed"}, headers=_h(ADMIN))
    assert r.status_code == 200


def test_every_role_may_read_events_of_many_rollouts(secure):
    aid = _claim(secure.url, "owner")["attempt"]["id"]
    body = {"events": [{"sequence": 0, "type": "message", "data": {"x": 1}}], "worker_id": "owner"}
    assert (
        httpx.post(f"{secure.url}/api/attempts/{aid}/events", json=body, headers=_h(RUNNER)).status_code
        == 200
    )
    rid = httpx.get(f"{secure.url}/api/attempts/{aid}", headers=_h(READER)).json()["rollout_id"]
    for token in (ADMIN, RUNNER, READER):
        with Client(secure.url, token) as client:
            assert [e.data for e in client.events_of([rid, "ro-unknown"])[rid]] == [{"x": 1}]
            assert client.events_of(["ro-unknown"]) == {"ro-unknown": []}
    assert httpx.post(f"{secure.url}/api/events/query", json={"rollout_ids": [rid]}).status_code == 401


def test_readers_and_runners_cannot_do_admin_writes(secure):
    url = secure.url
    body = {"resources": {"p": {"type": "prompt_template", "template": "x"}}}
    for token in (RUNNER, READER):
        assert httpx.post(f"{url}/api/resources", json=body, headers=_h(token)).status_code == 403
        assert httpx.post(f"{url}/api/rollouts/x/cancel", headers=_h(token)).status_code == 403
    assert httpx.post(f"{url}/api/dequeue", json={"worker_id": "w"}, headers=_h(READER)).status_code == 403
    r = httpx.post(f"{url}/api/workers/register", json={"name": "r"}, headers=_h(READER))
    assert r.status_code == 403 and "reader" in r.json()["error"]["message"]  # readers cannot register


# ---------------------------------------------------------------------------- secrets


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(logging.Formatter("%(name)s %(levelname)s %(message)s").format(record))


@pytest.fixture
def all_logs() -> Iterator[_Collect]:
    """Every log record of the process at DEBUG (server, gateway, uvicorn, httpx, ...)."""
    handler, root = _Collect(), logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


def _get_every_api_route(srv: ServerThread, ids: dict[str, str]) -> list[str]:
    """The bodies of every GET route the app has (path parameters filled in from ``ids``)."""
    bodies = []
    for route in srv.app.routes:
        path = getattr(route, "path", "")
        if "GET" not in (getattr(route, "methods", None) or ()) or path.startswith("/static"):
            continue
        url = re.sub(r"\{(\w+)\}", lambda m: ids[m.group(1)], path)
        r = httpx.get(f"{srv.url}{url}", headers=_h(ADMIN), timeout=30)
        assert r.status_code < 500, (url, r.status_code)
        bodies.append(f"{url} {r.status_code} {r.text}")
    return bodies


def test_secrets_stay_out_of_logs_events_and_answers(tmp_path, all_logs):
    """Upstream keys from a resource and from the server config are sent to the model server,
    and appear nowhere else: not in any log record (DEBUG), event, or answer of any GET route,
    nor in the gateway's answers, even when the model server echoes the key in an error."""
    with UpstreamDouble() as upstream:
        config = ServerConfig(
            db=str(tmp_path / "keys.db"), tokens=TOKENS, upstream_api_keys={"*": CONFIG_KEY}
        )
        with ServerThread(config, log_level="debug") as srv, Client(srv.url, ADMIN) as admin:
            admin.publish_resources(
                {
                    "llm": LLM(base_url=upstream.base_url, model="double", api_key=RESOURCE_KEY),
                    "echoing": LLM(base_url=upstream.base_url + "/", model="error-500"),  # takes CONFIG_KEY
                    "prompt": PromptTemplate(template="hi"),
                }
            )
            [ro] = admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
            claim_r = httpx.post(f"{srv.url}/api/dequeue", json={"worker_id": "w"}, headers=_h(RUNNER))
            claim = claim_r.json()
            gateway = claim["resources"]["resources"]["llm"]["base_url"]
            answers = [claim_r.text]
            for model, stream in (("double", False), ("double", True), ("error-500", False)):
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
                r = httpx.post(f"{gateway}/chat/completions", json=body, headers=_h(RUNNER), timeout=30)
                answers.append(r.text)
            assert answers[-1] and "error" in answers[-1]  # the echoing model server failed the call
            sent = {c.headers.get("authorization") for c in upstream.calls}
            assert {f"Bearer {RESOURCE_KEY}", f"Bearer {CONFIG_KEY}"} <= sent  # the keys were used
            aid = claim["attempt"]["id"]
            httpx.post(
                f"{srv.url}/api/attempts/{aid}/finish",
                json={"status": "succeeded", "worker_id": "w"},
                headers=_h(RUNNER),
            )
            events = httpx.get(f"{srv.url}/api/rollouts/{ro.id}/events", headers=_h(ADMIN)).text
            assert '"llm_call"' in events
            ids = {"rollout_id": ro.id, "attempt_id": aid, "version": "1"}
            pages = _get_every_api_route(srv, ids)
    logs = "\n".join(all_logs.lines)
    assert "model server answered 500" in logs  # the error path was logged
    for secret in (RESOURCE_KEY, CONFIG_KEY, ADMIN):
        assert secret not in logs, f"secret in the server log: {secret}"
        assert secret not in events, f"secret in events: {secret}"
        for text in answers + pages:
            assert secret not in text, f"secret in an answer: {text[:200]}"
    assert RUNNER not in logs and RUNNER not in events


# ---------------------------------------------------------------------------- CORS


def test_cors_is_off_by_default(secure):
    for path in ("/api/rollouts", "/gateway/r/a/v1/chat/completions", "/api/dequeue"):
        r = httpx.options(
            f"{secure.url}{path}",
            headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
        )
        assert not any(h.startswith("access-control-") for h in r.headers), (path, r.headers)
        r = httpx.get(f"{secure.url}/api/rollouts", headers={**_h(READER), "origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_allows_only_the_configured_origins(tmp_path):
    config = ServerConfig(db=str(tmp_path / "cors.db"), tokens=TOKENS, cors_origins=("https://ui.example",))
    with ServerThread(config) as srv:
        good = httpx.get(f"{srv.url}/api/rollouts", headers={**_h(READER), "origin": "https://ui.example"})
        bad = httpx.get(f"{srv.url}/api/rollouts", headers={**_h(READER), "origin": "http://evil.example"})
    assert good.headers.get("access-control-allow-origin") == "https://ui.example"
    assert "access-control-allow-origin" not in bad.headers


# ---------------------------------------------------------------------------- SQL


PACKAGE = Path(__file__).parents[2] / "agentbolt"
_SQL = re.compile(
    r"\b(SELECT|INSERT|UPDATE|DELETE|WHERE|FROM|VALUES|ORDER BY|LIMIT|CREATE|DROP|ALTER)\b|= \?|\bIN \("
)
# What may be interpolated into SQL text: fixed column lists, placeholder lists ("?, ?, ?"),
# clauses assembled from fixed strings, the backend's row-lock clause. Reviewed by hand; a new
# entry needs the same review (docs/threat-model.md).
SQL_FRAGMENTS = {
    # constants
    "ROLLOUT_COLS",
    "ROLLOUT_FROM",
    "ATTEMPT_COLS",
    "RETURNED_ROLLOUT",
    "TASK_OF_ROW",
    "NEXT_QUEUED",
    "LATEST_VERSION",
    "CLAIMED_WITH",
    "SCORE_COLS",
    "SLOT_COLS",
    "SLOT_FROM",
    "_WORKER_COLS",
    # placeholders only
    "marks",
    "', '.join('?' * len(types))",
    # conditions built from fixed strings with ? placeholders
    "' AND '.join(where)",
    "where",
    "order",  # "ASC" or "DESC"
    "column",  # from a fixed tuple of column names
    "self.db.claim_lock",  # a backend constant: "FOR UPDATE SKIP LOCKED" or ""
    "unclaimed",  # "" or a fixed clause around CLAIMED_WITH
    "holder",  # "" or " AND worker_id = ?"
    "insert",  # statements.events_insert's INSERT: fixed text, placeholders and RUNNING
    # statuses and modes written as literals so the planner sees them: enum values, checked to be
    # lower-case words by sql_literal
    "QUEUED",
    "RUNNING",
    "PENDING",  # a reward state, the same way
    "statuses",
    "sql_literal(Mode(mode))",
}


def _sql_interpolations() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
                if _SQL.search(text):
                    for v in node.values:
                        if isinstance(v, ast.FormattedValue):
                            found.append(
                                (
                                    str(path.relative_to(PACKAGE)),
                                    node.lineno,
                                    ast.get_source_segment(src, v.value) or "",
                                )
                            )
            elif (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Mod)
                and isinstance(node.left, ast.Constant)
            ):
                if isinstance(node.left.value, str) and _SQL.search(node.left.value):
                    found.append((str(path.relative_to(PACKAGE)), node.lineno, "% formatting"))
    return found


def test_sql_text_interpolates_no_values():
    """Values always travel as parameters: f-strings that build SQL interpolate only the
    reviewed fragments above, and no SQL is built with ``%``."""
    found = _sql_interpolations()
    assert found, "the scan found no SQL f-strings at all: is it still looking in the right place?"
    unreviewed = [f for f in found if f[2] not in SQL_FRAGMENTS]
    assert unreviewed == [], unreviewed


# a string that starts like a statement (docstrings that merely mention SQL words do not)
_STATEMENT = re.compile(
    r"^\s*(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE (TABLE|INDEX|UNIQUE)|DROP|ALTER)\b"
)


def _statements_by_folder() -> dict[bool, list[str]]:
    """``{in agentbolt/store/: [where], elsewhere: [where]}`` for each SQL statement's text."""
    found: dict[bool, list[str]] = {True: [], False: []}
    for path in sorted(PACKAGE.rglob("*.py")):
        in_store = path.relative_to(PACKAGE).parts[0] == "store"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if _STATEMENT.search(text):
                found[in_store].append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_sql_statements_live_in_the_store():
    """Routes never touch storage: every statement is written in ``agentbolt/store/``."""
    found = _statements_by_folder()
    assert found[True], "the scan found no SQL in agentbolt/store/: is it still looking in the right place?"
    assert found[False] == []


def test_the_server_command_prints_store_urls_without_passwords():
    from agentbolt.cli.main import _without_password

    assert _without_password("postgresql://ab:s3cret@db:5432/ab?sslmode=require") == (
        "postgresql://ab:***@db:5432/ab?sslmode=require"
    )
    assert "s3cret" not in _without_password("postgresql://db/ab?user=ab&password=s3cret&sslmode=require")
    assert _without_password("runs/agentbolt.db") == "runs/agentbolt.db"
