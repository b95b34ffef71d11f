"""A bootstrap APO run's trials in the dashboard (headless Chromium): every scored candidate
shows its validation score in the version list, and its page shows the scores, the version its
rollouts ran with, its worked examples (example turns of its LLM resource) and its prompt. The agent's model is the test double of
``tests/algorithms/test_apo_bootstrap.py``."""

from __future__ import annotations

import io
from typing import Any

from playwright.sync_api import expect
from rich.console import Console

from agentbolt import LLM, PromptTemplate, Trainer
from agentbolt.algorithms.apo import APO
from agentbolt.algorithms.apo_bootstrap import HEADER
from agentbolt.server import ServerThread
from tests.algorithms.test_apo_bootstrap import SEED, TRAIN, VAL, ExampleModel, WordAgent
from tests.server.dashboard.dashboard_browser import assert_contrast, shoot


def test_apo_trials_show_their_scores_examples_and_prompts(page: Any, empty_server: ServerThread) -> None:
    with ExampleModel() as model:
        resources: dict[str, Any] = {
            "system_prompt": PromptTemplate(template=SEED),
            "llm": LLM(base_url=model.base_url, model="double"),
        }
        apo = APO(bootstrap_tasks=8, bootstrap_rounds=1, trials=2, batch_timeout=60.0)
        trainer = Trainer(
            apo,
            server_url=empty_server.url,
            token="admintok",
            resources=resources,
            n_runners=1,
            console=Console(file=io.StringIO()),
        )
        result = trainer.fit(WordAgent(), TRAIN, VAL)
    assert result.best_val == 1.0

    page.goto(f"{empty_server.url}/#/resources")
    page.wait_for_selector("#content .page", state="visible")
    scores = page.locator(".version-link .apo-score").all_inner_texts()
    # the seed's record, two trials' and the published best: each with its validation score
    assert sorted(scores) == sorted(["val 0.25", "val 1", "val 1", "val 1"]), scores
    expect(page.locator(".version-title")).to_have_text(f"Version {result.published_version}")
    chips = page.locator(".version-detail .chips").inner_text()
    assert "Validation score" in chips and "Worked examples" in chips and "train-" in chips
    assert f"v{result.best_version}" in chips  # the version its rollouts ran with
    # the worked examples are chat turns of the LLM resource, shown on its card
    llm = page.locator("#res-llm")
    assert f"{len(result.best_turns['llm'])}, put into every call by the gateway" in llm.inner_text()
    turns = llm.locator("pre").inner_text()
    assert "User: Say the word" in turns and "Assistant: ANSWER:" in turns
    assert HEADER not in page.locator("#res-system_prompt").inner_text()  # the prompt is the seed's
    assert_contrast(page)
    shoot(page, "resources-apo-trials")
