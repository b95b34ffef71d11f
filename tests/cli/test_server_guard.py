"""``agentbolt server`` refuses to serve other machines without a token, unless told
``--insecure``; ``--token-file`` keeps (or makes) the admin token of a container."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbolt.cli.main import app
from agentbolt.cli.server_guard import exposure_problem, is_loopback, token_from_file
from agentbolt.errors import ConfigError


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_are_served_without_a_token(host: str) -> None:
    assert is_loopback(host)
    assert exposure_problem(host, has_token=False, insecure=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_other_hosts_need_a_token_or_insecure(host: str) -> None:
    problem = exposure_problem(host, has_token=False, insecure=False)
    assert problem is not None and host in problem and "--insecure" in problem
    assert exposure_problem(host, has_token=True, insecure=False) is None
    assert exposure_problem(host, has_token=False, insecure=True) is None


def test_the_server_command_refuses_before_binding(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (
        "AGENTBOLT_TOKEN",
        "AGENTBOLT_RUNNER_TOKEN",
        "AGENTBOLT_READER_TOKEN",
        "AGENTBOLT_EVALUATOR_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AGENTBOLT_REVIEWER_TOKENS", raising=False)
    served: list[tuple] = []
    monkeypatch.setattr("agentbolt.server.serve", lambda *a, **kw: served.append(a))
    db = str(tmp_path / "s.db")
    refused = CliRunner().invoke(app, ["server", "--host", "0.0.0.0", "--db", db])
    assert refused.exit_code != 0 and not served
    assert "refusing to serve 0.0.0.0 without a token" in refused.output
    assert "Traceback" not in refused.output
    allowed = CliRunner().invoke(app, ["server", "--host", "0.0.0.0", "--db", db, "--insecure"])
    assert allowed.exit_code == 0, allowed.output
    token_file = tmp_path / "tok" / "token"
    with_file = CliRunner().invoke(
        app, ["server", "--host", "0.0.0.0", "--db", db, "--token-file", str(token_file)]
    )
    assert with_file.exit_code == 0, with_file.output
    assert len(served) == 2 and token_file.read_text().strip()
    config = served[1][0]
    assert list(config.tokens) == [token_file.read_text().strip()]


def test_a_token_file_is_made_once_for_its_owner_and_then_read(tmp_path: Path) -> None:
    path = tmp_path / "state" / "token"
    token, made = token_from_file(path)
    assert made and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token_from_file(path) == (token, False)
    assert token_from_file(tmp_path / "other")[0] != token
    path.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        token_from_file(path)
