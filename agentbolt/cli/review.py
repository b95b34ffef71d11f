"""``agentbolt review``: score rollouts by hand from a terminal.

It walks the review queue (finished rollouts whose reviewer reward is still pending, oldest
first). For each it shows the task, the transcript and the final answer, then asks for a score
on the reward's scale — checked here first, then by the server — and an optional comment;
``s`` skips, ``q`` quits. ``--rescore ROLLOUT_ID`` changes an earlier score after showing its
history; every score is kept as a revision.

Each score says which revision it replaces, so a score someone gave meanwhile is never
overwritten: the server answers 409 naming them and this command shows it and moves on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agentbolt.cli.common import DEFAULT_SERVER, ServerOpt, TokenOpt, console, err_console, fail
from agentbolt.cli.render import render_rollout
from agentbolt.client import Client, RequestError
from agentbolt.errors import Conflict, Forbidden, InvalidInput, NotFound
from agentbolt.evaluators.record import record_of
from agentbolt.schemas import (
    RewardCreate,
    RewardScale,
    RewardScore,
    RewardSlot,
    RewardSource,
    Rollout,
)

__all__ = ["review_command"]

PAGE = 100


class _Quit(Exception):
    """The reviewer typed ``q`` (or stdin ended)."""


def review_command(
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
    name: Annotated[str, typer.Option("--name", help="The reviewer reward to score.")] = "human",
    limit: Annotated[int | None, typer.Option(min=1, help="Stop after scoring this many rollouts.")] = None,
    rescore: Annotated[
        str | None,
        typer.Option(
            "--rescore", metavar="ROLLOUT_ID", help="Change the score of this rollout (history first)."
        ),
    ] = None,
) -> None:
    """Walk the review queue: score each finished rollout awaiting a person's score
    (s skips, q quits), or --rescore one scored before."""
    with Client(server, token) as client:
        try:
            if rescore is not None:
                _rescore(client, rescore, name)
                return
            scored, skipped = _walk(client, name, limit)
        except _Quit:
            console.print("stopped")
            return
        except (Forbidden, RequestError) as exc:
            if isinstance(exc, RequestError) and exc.status_code != 403:
                raise fail(str(exc)) from None
            raise fail(f"{exc} (scoring needs a reviewer token: --token or AGENTBOLT_TOKEN)") from None
        except NotFound as exc:
            raise fail(str(exc)) from None
    console.print(f"scored {scored}, skipped {skipped}")


def _walk(client: Client, name: str, limit: int | None) -> tuple[int, int]:
    """Score the queue's rollouts one by one; (scored, skipped)."""
    scored = 0
    passed: set[str] = set()  # skipped, or scored by someone else meanwhile
    while limit is None or scored < limit:
        rollout = next(_queue(client, name, passed), None)
        if rollout is None:
            if not scored and not passed:
                console.print(f"no rollout awaits a score for '{escape(name)}'")
            break
        slot = rollout.rewards[name]
        _show(client, rollout)
        if _score(client, rollout, slot):
            scored += 1
        else:
            passed.add(rollout.id)
    return scored, len(passed)


def _queue(client: Client, name: str, passed: set[str]) -> Iterator[Rollout]:
    """The queue's rollouts not passed over yet, oldest first, page by page."""
    cursor: str | None = None
    while True:
        page = client.pending_rewards(name=name, source=RewardSource.REVIEWER, limit=PAGE, cursor=cursor)
        yield from (r for r in page.items if r.id not in passed and name in r.rewards)
        cursor = page.next_cursor
        if not cursor:
            return


def _rescore(client: Client, rollout_id: str, name: str) -> None:
    rollout = client.get_rollout(rollout_id)
    slot = rollout.rewards.get(name)
    if slot is None:
        raise fail(
            f"rollout {rollout_id} has no reward '{name}' (it has: {', '.join(rollout.rewards) or 'none'})"
        )
    if slot.source != RewardSource.REVIEWER:
        raise fail(f"reward '{name}' of rollout {rollout_id} is given by {slot.source.value}s, not reviewers")
    _show(client, rollout)
    console.print(_history(client.reward_history(rollout_id, name), name))
    if not _score(client, rollout, slot):
        console.print("not changed")


# ---------------------------------------------------------------------------- showing


def _show(client: Client, rollout: Rollout) -> None:
    """The task, the transcript (the rollout's events as a tree) and the final answer."""
    events = client.all_events(rollout.id)
    attempts = client.list_attempts(rollout.id)
    console.rule(f"rollout {rollout.id}")
    task = json.dumps(rollout.task.data, indent=2, ensure_ascii=False, default=str)
    console.print(Panel(Text(task), title="task", title_align="left"))
    console.print(render_rollout(rollout, attempts, events))
    answer = record_of(rollout, events).output
    body = Text(answer) if answer is not None else Text("no model answer recorded", style="dim")
    console.print(Panel(body, title="final answer", title_align="left", border_style="green"))


def _history(revisions: list[RewardScore], name: str) -> Table:
    table = Table(title=f"history of '{escape(name)}' ({len(revisions)} revisions)")
    for column in ("rev", "state", "score", "by", "comment"):
        table.add_column(column)
    for r in revisions:
        score = "-" if r.score is None else f"{r.score:g}"
        table.add_row(
            str(r.revision), r.state.value, score, escape(r.author or "-"), escape(r.comment or r.error or "")
        )
    return table


# ---------------------------------------------------------------------------- asking and sending


def _scale_text(scale: RewardScale) -> str:
    steps = f" in steps of {scale.step:g}" if scale.step else ""
    return f"{scale.low:g} to {scale.high:g}{steps}"


def _ask(prompt: str) -> str:
    try:
        return console.input(prompt).strip()
    except EOFError:
        raise _Quit from None


def _ask_score(slot: RewardSlot) -> float | None:
    """A score on the slot's scale, asked again until valid; None: skip."""
    now = f", now {slot.score:g} by {slot.author or '?'}" if slot.score is not None else ""
    while True:
        answer = _ask(f"score '{escape(slot.name)}' ({_scale_text(slot.scale)}{now}; s skips, q quits): ")
        if answer.lower() == "q":
            raise _Quit
        if answer.lower() == "s":
            return None
        try:
            score = float(answer)
            slot.scale.check(score)
        except ValueError as exc:
            message = str(exc) if answer and _is_number(answer) else f"{answer!r} is not a number"
            err_console.print(f"[bold red]error:[/] {escape(message)}")
            continue
        return score


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _score(client: Client, rollout: Rollout, slot: RewardSlot) -> bool:
    """Ask for a score and send it; False when skipped or scored by someone else meanwhile."""
    while True:
        score = _ask_score(slot)
        if score is None:
            return False
        comment = _ask("comment (optional, Enter for none): ") or None
        create = RewardCreate(name=slot.name, score=score, comment=comment, replaces=slot.revision)
        try:
            saved = client.add_reward(rollout.id, create)
        except Conflict as exc:  # someone scored meanwhile: theirs stands, move on
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
            return False
        except (InvalidInput, RequestError) as exc:
            if isinstance(exc, RequestError) and exc.status_code != 422:
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}")  # off the scale: ask again
            continue
        console.print(f"scored {saved.score:g} for '{escape(saved.name)}' (revision {saved.revision})")
        return True
