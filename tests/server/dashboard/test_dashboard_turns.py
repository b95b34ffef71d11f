"""A multi-turn rollout in the dashboard: its turns with the step rewards and states the agent
gave each model call, and the training page's per-turn step reward. The rollout is made the
real way: three calls through the gateway (the upstream double answers), rewards and states
posted to the events URL by call id, as a program agent does; the browser holds the reader
token only."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
from dashboard_browser import assert_contrast, shoot

from agentbolt.client import Client
from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, Task
from agentbolt.server import ServerThread

STEP_REWARDS = [0.25, -0.5, 1.0]
STATES = ["range 1-100", "range 51-100", "range 51-75"]


def _multi_turn_rollout(server: ServerThread, upstream: Any) -> tuple[str, list[int]]:
    with Client(server.url, token="admintok") as client:
        meta = {"step": 4, "metrics": {"loss": 0.5, "turn_reward_by_index": [0.2, -0.4, 0.8]}}
        client.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")}, meta)
        client.enqueue([RolloutCreate(task=Task(data={"secret": 60}))])
        claim = client.dequeue("runner-a")
        assert claim is not None
        llm = claim.resources.resources["llm"]
        model = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        events_url = f"{server.url}/agent/{claim.rollout.id}/{claim.attempt.id}/events"
        ids = []
        for turn, (reward, state) in enumerate(zip(STEP_REWARDS, STATES, strict=True)):
            answer = model.chat.completions.create(
                model="double", messages=[{"role": "user", "content": f"Guess {turn}: {state}"}]
            )
            call = answer.model_extra["agentbolt"]["call_id"]
            ids.append(call)
            posted = httpx.post(
                events_url,
                json=[
                    {"type": "state", "data": {"key": state, "llm_call_id": call}},
                    {"reward": reward, "name": "closer", "call": call},
                ],
                headers={"authorization": f"Bearer {claim.agent_key}"},
                timeout=10,
            )
            assert posted.status_code == 200, posted.text
        client.finish(
            claim.attempt.id, AttemptStatus.SUCCEEDED, reward=1.0, worker_id=claim.attempt.worker_id
        )
        return claim.rollout.id, ids


def test_a_multi_turn_rollout_shows_each_turns_step_reward_and_state(
    open_page: Any, empty_server: ServerThread, upstream: Any
) -> None:
    rollout_id, ids = _multi_turn_rollout(empty_server, upstream)
    page = open_page(token="readtok")
    page.goto(f"{empty_server.url}/#/rollouts/{rollout_id}")
    page.wait_for_selector(".page-rollout")

    rows = page.locator("#turns tbody tr")
    assert rows.count() == 3
    for i, (row, reward, state) in enumerate(zip(rows.all(), STEP_REWARDS, STATES, strict=True)):
        cells = row.locator("td").all_inner_texts()
        assert cells[0] == str(i + 1) and cells[1] == f"#{ids[i]}" and cells[2] == state
        assert cells[3] == (f"+{reward:g}" if reward > 0 else f"{reward:g}")
    assert page.locator("#turns .turn-bar-neg").count() == 1  # the one negative step reward
    assert "summing to +0.75" in page.locator("#turns .card-sub").inner_text()
    assert page.get_by_test_id("rollout-reward").inner_text() == "1"  # step rewards kept apart

    calls = page.locator("li.ev-llm_call")
    assert calls.locator("[data-testid=turn-tag]").all_inner_texts() == ["Turn 1", "Turn 2", "Turn 3"]
    summary = calls.nth(1).locator(".event-summary").inner_text()
    assert "step -0.5" in summary and "range 51-100" in summary
    meta = calls.nth(1).get_by_test_id("llm-meta").inner_text()
    assert re.search(r"Turn\s*2", meta) and re.search(r"State\s*range 51-100", meta)
    assert re.search(r"Reward · closer\s*-0.5", meta)
    states = page.locator("li.ev-state .event-summary").all_inner_texts()
    assert [s.split(" · ")[0] for s in states] == STATES
    assert f"for turn 3, LLM call #{ids[2]}" in states[2]
    assert_contrast(page)
    shoot(page, "rollout-turns")

    # the turn table's call number jumps to that call in the event list
    rows.nth(2).get_by_role("button", name=f"#{ids[2]}").click()
    assert page.evaluate("document.activeElement.id") == f"ev-{ids[2]}"

    page.goto(f"{empty_server.url}/#/training")
    page.wait_for_selector("#turn-rewards")
    card = page.locator("#turn-rewards")
    assert card.locator("thead th").all_inner_texts() == ["Version", "Step", "Turn 1", "Turn 2", "Turn 3"]
    [row] = card.locator("tbody tr").all()
    assert row.locator("td").all_inner_texts() == ["v1", "4", "0.2", "-0.4", "0.8"]
    assert card.locator(".turn-bar-neg").count() == 1
    # the list is not one of the numeric metric charts
    assert "turn_reward_by_index" not in page.locator("#metrics").inner_text()
    assert_contrast(page)
    shoot(page, "training-turns")
