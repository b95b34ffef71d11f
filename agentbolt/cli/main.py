"""The ``agentbolt`` command line. Problems are reported as one plain message, never a traceback."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from agentbolt.cli.common import DEFAULT_SERVER, ServerOpt, TokenOpt, console, err_console, fail, load_tasks
from agentbolt.cli.demo import demo_command
from agentbolt.cli.export import export_app
from agentbolt.cli.judge import judge_command
from agentbolt.cli.model import model_app
from agentbolt.cli.review import review_command
from agentbolt.cli.runner import runner_command
from agentbolt.cli.server_guard import exposure_problem, is_loopback, token_from_file
from agentbolt.cli.train import train_app
from agentbolt.errors import AgentboltError, MissingExtra
from agentbolt.extras import needs_extra
from agentbolt.schemas import Mode, RolloutStatus

app = typer.Typer(help="Train any AI agent from its real runs.", no_args_is_help=True, add_completion=False)
rollouts_app = typer.Typer(help="Inspect rollouts stored on a server.", no_args_is_help=True)
app.add_typer(rollouts_app, name="rollouts")
workers_app = typer.Typer(help="List and revoke the runners registered with a server.", no_args_is_help=True)
app.add_typer(workers_app, name="workers")
app.add_typer(model_app, name="model")
app.add_typer(export_app, name="export")
app.command("demo")(demo_command)
app.command("review")(review_command)
app.command("judge")(judge_command)
app.command("runner")(runner_command)
app.add_typer(train_app, name="train")


def _without_password(url: str) -> str:
    """A store URL fit to print: ``user:secret@`` and ``password=secret`` become ``***``."""
    url = re.sub(r"://([^:@/]*):[^@/]*@", r"://\1:***@", url)
    return re.sub(r"(?i)(password=)[^&\s]*", r"\1***", url)


@app.command()
@needs_extra("agentbolt server", "server")
def server(
    db: Annotated[str, typer.Option(help="SQLite file, ':memory:' or postgresql:// URL.")] = "agentbolt.db",
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8765,
    token: Annotated[str | None, typer.Option(envvar="AGENTBOLT_TOKEN", help="Admin bearer token.")] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(help="Without --token: the admin token kept in this file, made (random) if missing."),
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Serve a non-loopback --host without any token.")
    ] = False,
    runner_token: Annotated[
        str | None, typer.Option(envvar="AGENTBOLT_RUNNER_TOKEN", help="Runner token.")
    ] = None,
    reader_token: Annotated[
        str | None, typer.Option(envvar="AGENTBOLT_READER_TOKEN", help="Read-only token.")
    ] = None,
    reviewer_token: Annotated[
        list[str] | None,
        typer.Option(
            envvar="AGENTBOLT_REVIEWER_TOKENS",
            help="A person who scores rollouts: NAME=TOKEN (repeatable; env: alice=tok1,bob=tok2).",
        ),
    ] = None,
    evaluator_token: Annotated[
        str | None, typer.Option(envvar="AGENTBOLT_EVALUATOR_TOKEN", help="Token of LLM judges and scorers.")
    ] = None,
    upstream_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="AGENTBOLT_UPSTREAM_KEYS",
            help="API key the server holds for a model server: BASE_URL=KEY (repeatable; '*' for any URL).",
        ),
    ] = None,
    lease_seconds: Annotated[float, typer.Option(help="Attempt lease without heartbeat.")] = 30.0,
    worker_token_ttl: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a worker token stays valid after its runner was last seen "
            "(its runner then registers again); 0: never expires.",
        ),
    ] = 24 * 3600.0,
    registered_runners_only: Annotated[
        bool,
        typer.Option(
            help="The runner token may only read and register: every runner write carries the "
            "worker token the runner was issued (agentbolt runners register by themselves).",
        ),
    ] = False,
    quota_events: Annotated[
        int,
        typer.Option(
            min=0, help="Events an attempt's agent may post to its events URL (then 429); 0: no limit."
        ),
    ] = 10_000,
    quota_event_bytes: Annotated[
        int, typer.Option(min=0, help="Bytes of events an attempt's agent may post (then 413); 0: no limit.")
    ] = 64 * 1024 * 1024,
    quota_calls: Annotated[
        int,
        typer.Option(
            min=0, help="Model calls per attempt through the gateway, per replica (then 429); 0: no limit."
        ),
    ] = 1_000,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run the server: store API, gateway, OTLP ingest and dashboard."""
    from agentbolt.server import Role, ServerConfig, serve

    if token is None and token_file is not None:
        token = _token_file(token_file)
    named = _pairs(reviewer_token, "--reviewer-token", "NAME=TOKEN")  # name -> token
    configured = [(token, Role.ADMIN), (runner_token, Role.RUNNER), (reader_token, Role.READER)]
    configured += [(evaluator_token, Role.EVALUATOR), *((t, Role.REVIEWER) for t in named.values())]
    tokens = {t: r for t, r in configured if t}
    if len(tokens) < sum(1 for t, _ in configured if t):
        raise fail("the same token is given twice (to two roles or two reviewers): each needs its own")
    problem = exposure_problem(host, bool(tokens), insecure)
    if problem is not None:
        raise fail(problem)
    if insecure and not tokens and not is_loopback(host):
        err_console.print(f"[yellow]warning:[/] serving {escape(host)} without a token: anyone can write")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServerConfig(
        db=db,
        host=host,
        port=port,
        tokens=tokens,
        token_names={t: name for name, t in named.items()},
        upstream_api_keys=_pairs(upstream_key, "--upstream-key", "BASE_URL=KEY", last=True),
        lease_seconds=lease_seconds,
        worker_token_ttl=worker_token_ttl or None,
        registered_runners_only=registered_runners_only,
        quota_events=quota_events,
        quota_event_bytes=quota_event_bytes,
        quota_calls=quota_calls,
    )
    banner = f"agentbolt server on http://{host}:{port}  (store: {_without_password(db)})"
    serve(config, log_level, on_ready=lambda: console.print(banner))


def _token_file(path: Path) -> str:
    """The admin token kept in ``path`` (made when missing, and where it is said)."""
    token, made = token_from_file(path)
    if made:
        err_console.print(f"agentbolt server: a new admin token is in {escape(str(path))}")
    return token


def _pairs(values: list[str] | None, option: str, form: str, last: bool = False) -> dict[str, str]:
    """``A=B`` values (each may hold several, comma-separated, as an environment variable
    does) as a dict; split at the last ``=`` with ``last`` (a URL may hold one, a key not)."""
    out: dict[str, str] = {}
    items = [part.strip() for value in values or () for part in value.split(",") if part.strip()]
    for i, item in enumerate(items, 1):
        left, sep, right = item.rpartition("=") if last else item.partition("=")
        if not (sep and left.strip() and right.strip()):  # the item holds a secret: not echoed
            raise fail(f"{option} takes {form}: item {i} is not of that form")
        if left.strip() in out:
            raise fail(f"{option}: {escape(left.strip())!r} is given twice")
        out[left.strip()] = right.strip()
    return out


@app.command("eval")
def eval_(
    agent: Annotated[str, typer.Option("--agent", "-a", help="module:object or file.py:object.")],
    val_file: Annotated[Path, typer.Option("--val", help="Tasks: a JSON list or JSON-lines file.")],
    server: Annotated[
        str | None, typer.Option("--server", "-s", help="Use this server instead of an embedded one.")
    ] = None,
    token: TokenOpt = None,
    runners: Annotated[int, typer.Option(min=0, help="Local runner processes to start.")] = 2,
    prompt: Annotated[str | None, typer.Option(help="Publish this system_prompt resource first.")] = None,
) -> None:
    """Evaluate an agent on a task file (embedded server and local runners unless --server)."""
    from agentbolt.algorithms import Evaluate
    from agentbolt.runner.worker import load_agent
    from agentbolt.schemas import PromptTemplate
    from agentbolt.trainer import Trainer

    with needs_extra("agentbolt eval", *(() if server else ("server",))):  # checked before any work
        pass  # with --server, only a client and runners: the light install runs it
    sys.path.insert(0, os.getcwd())
    loaded = load_agent(agent)
    resources: dict[str, Any] | None = {"system_prompt": PromptTemplate(template=prompt)} if prompt else None
    trainer = Trainer(Evaluate(), n_runners=runners, server_url=server, token=token, resources=resources)
    trainer.fit(loaded, val_tasks=load_tasks(val_file))


@rollouts_app.command("list")
def rollouts_list(
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
    status: Annotated[list[RolloutStatus] | None, typer.Option(help="Filter by status (repeatable).")] = None,
    mode: Annotated[Mode | None, typer.Option(help="Filter by mode.")] = None,
    version: Annotated[
        int | None, typer.Option("--version", "-v", help="Filter by resources version.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
) -> None:
    """List the newest rollouts."""
    from agentbolt.client import Client

    with Client(server, token) as client:
        page = client.list_rollouts(
            status=status, mode=mode, resources_version=version, limit=limit, newest_first=True
        )
    table = Table(title=f"rollouts ({len(page.items)} shown)")
    for column in ("id", "task", "mode", "status", "attempts", "reward", "version"):
        table.add_column(column)
    for r in page.items:
        reward = f"{r.reward:.3f}" if r.reward is not None else "-"
        version_text = str(r.resources_version or "-")
        table.add_row(r.id, r.task.id, r.mode.value, r.status.value, str(r.attempts), reward, version_text)
    console.print(table)


@rollouts_app.command("show")
def rollouts_show(
    rollout_id: Annotated[str, typer.Argument(help="Rollout id.")],
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
) -> None:
    """Show a rollout with its attempts and events (LLM calls, rewards, exceptions) as a tree."""
    from agentbolt.cli.render import render_rollout
    from agentbolt.client import Client

    with Client(server, token) as client:
        rollout = client.get_rollout(rollout_id)
        attempts = client.list_attempts(rollout_id)
        events = client.all_events(rollout_id)
    console.print(render_rollout(rollout, attempts, events))


@workers_app.command("list")
def workers_list(server: ServerOpt = DEFAULT_SERVER, token: TokenOpt = None) -> None:
    """List the registered runners (workers), most recently seen first."""
    from agentbolt.client import Client

    with Client(server, token) as client:
        workers = client.list_workers()
    table = Table(title=f"workers ({len(workers)} shown)")
    for column in ("id", "last seen", "running", "claims", "revoked"):
        table.add_column(column)
    for w in workers:
        revoked = _when(w.revoked_at) if w.revoked_at is not None else "-"
        table.add_row(w.id, _when(w.last_seen), str(w.running), str(w.claims), revoked)
    console.print(table)


@workers_app.command("revoke")
def workers_revoke(
    worker_id: Annotated[str, typer.Argument(help="Worker id (see `agentbolt workers list`).")],
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
) -> None:
    """Revoke a worker (admin token): its token stops working, no token may claim or renew work
    under its id, and its running attempts end now (their rollouts are requeued while attempts
    remain). Its runner stops."""
    from agentbolt.client import Client

    with Client(server, token) as client:
        worker = client.revoke_worker(worker_id)
    console.print(f"worker {escape(worker.id)} revoked at {_when(worker.revoked_at or 0.0)}")


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def main() -> None:
    from agentbolt.cli.token_flags import warn_token_flags

    try:
        warn_token_flags(app, sys.argv[1:])
        app()
    except MissingExtra as exc:
        # One line (never wrapped), and "agentbolt[server]" is not rich markup.
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise SystemExit(2) from None
    except AgentboltError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
