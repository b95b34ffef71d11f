"""The reward-claim probe: a program agent grades itself (posts reward 1 to its events URL and
writes 1 to its result file) while the user's scorer says 0. Training must read 0, the claim
must be kept beside it, and the run's metrics must count the disagreement."""

from __future__ import annotations

import asyncio
import sys

from agentbolt.adapters import latest_attempt, rollout_reward
from agentbolt.algorithms.base import BatchResult
from agentbolt.algorithms.claims import fetch_claim_counts
from agentbolt.algorithms.evaluate import EvalSummary, summary_table
from agentbolt.algorithms.rewards import resolve
from agentbolt.client import Client
from agentbolt.runner.program import Program
from agentbolt.runner.worker import Runner
from agentbolt.schemas import RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerThread

# Claims reward 1 both ways a program can: a posted reward event and its result file.
CHEAT = r"""
import json, os, urllib.request
request = urllib.request.Request(
    os.environ["AGENTBOLT_EVENTS_URL"],
    data=json.dumps({"type": "reward", "data": {"value": 1}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    method="POST",
)
print(urllib.request.urlopen(request, timeout=10).status)
open(os.environ["AGENTBOLT_RESULT_FILE"], "w").write(json.dumps({"reward": 1}))
"""


def _run_cheat(server: ServerThread, client: Client, **program: object) -> str:
    [ro] = client.enqueue([RolloutCreate(task=Task(data={"q": "2+2"}))])
    script = CHEAT.replace("{", "{{").replace("}", "}}")  # the argv is a template: braces doubled
    runner = Runner(
        Program([sys.executable, "-c", script], **program), server.url, max_rollouts=1, poll_wait=0.2
    )
    asyncio.run(asyncio.wait_for(runner.run(), 60))
    return ro.id


def test_a_program_cannot_grade_itself_when_a_scorer_is_given(server: ServerThread, client: Client) -> None:
    rollout_id = _run_cheat(server, client, scorer=lambda run: 0.0)
    rollout = client.get_rollout(rollout_id)
    assert rollout.status == RolloutStatus.SUCCEEDED and rollout.reward == 0.0, rollout.error

    events = latest_attempt(client.all_events(rollout_id))
    posted = [e for e in events if e.type == "message" and e.data.get("role") == "stdout"]
    assert posted and posted[0].data["content"].startswith("200")  # the claim did reach the server
    assert rollout_reward(events) == 0.0  # the adapters' rule reads the runner's final 0
    assert resolve(rollout).value == 0.0  # what every algorithm trains on by default
    claims = {e.data["name"]: e.data for e in events if e.type == "reward_claim"}
    assert set(claims) == {"program", "result_file"}
    assert all(c["value"] == 1.0 and c["reward"] == 0.0 and c["disputed"] for c in claims.values())

    batch = BatchResult([rollout], timed_out=0)
    assert batch.value(rollout) == 0.0
    counts = fetch_claim_counts(client, [rollout])
    assert counts == {"claims": 1, "claims_disputed": 1}
    summary = EvalSummary.of(batch, counts)
    assert (summary.mean_reward, summary.claims_disputed) == (0.0, 1)
    assert "claims disputed" in [c.header for c in summary_table({"val": summary}).columns]


def test_a_claim_that_agrees_is_not_counted_as_disputed(server: ServerThread, client: Client) -> None:
    rollout_id = _run_cheat(server, client, scorer=lambda run: 1.0)
    rollout = client.get_rollout(rollout_id)
    assert rollout.reward == 1.0
    assert fetch_claim_counts(client, [rollout]) == {"claims": 1, "claims_disputed": 0}


def test_without_a_scorer_the_program_is_trusted_and_nothing_is_a_claim(
    server: ServerThread, client: Client
) -> None:
    rollout_id = _run_cheat(server, client)
    rollout = client.get_rollout(rollout_id)
    assert rollout.reward == 1.0  # the posted reward comes first
    assert fetch_claim_counts(client, [rollout]) == {"claims": 0, "claims_disputed": 0}


def test_only_the_runners_claims_are_counted() -> None:
    """A ``reward_claim`` an agent stored (an agent key may no longer post one; an older store
    may hold one) or one of unknown source does not move the disagreement count."""
    from agentbolt.algorithms.claims import claim_counts
    from agentbolt.schemas import Event, EventSource, EventType

    def claim(rollout: str, source: EventSource | None, disputed: bool) -> Event:
        return Event(
            id=hash((rollout, source)) % 10_000,
            rollout_id=rollout,
            attempt_id=f"at-{rollout}",
            sequence=None,
            type=EventType.REWARD_CLAIM.value,
            timestamp=1.0,
            data={"name": "program", "value": 1.0, "reward": 0.0, "disputed": disputed},
            source=source,
        )

    events = {
        "a": [claim("a", EventSource.RUNNER, True)],
        "b": [claim("b", EventSource.AGENT, True)],
        "c": [claim("c", None, True)],
        "d": [claim("d", EventSource.RUNNER, False)],
    }
    assert claim_counts(events) == {"claims": 2, "claims_disputed": 1}
