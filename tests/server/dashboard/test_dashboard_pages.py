"""End to end: the dashboard in headless Chromium against a real, populated server, holding
only the read-only (reader) token. Each test saves screenshots under artifacts/dashboard/."""

from __future__ import annotations

import re
from typing import Any

import httpx
from dashboard_browser import assert_contrast, expect, shoot
from dashboard_data import Populated

from agentbolt.client import Client
from agentbolt.schemas import Mode, RolloutCreate, Task
from agentbolt.server import ServerThread

READER = {"authorization": "Bearer readtok"}


def goto(page: Any, server: ServerThread, route: str) -> None:
    page.goto(f"{server.url}/#{route}")
    page.wait_for_selector("#content .page, #content .empty", state="visible")


def api(server: ServerThread, path: str, **params: Any) -> Any:
    return httpx.get(f"{server.url}/api{path}", params=params, headers=READER).json()


# ------------------------------------------------------------------ pages


def test_overview_shows_counts_runners_and_throughput(
    page: Any, dash_server: ServerThread, dash_data: Populated
) -> None:
    goto(page, dash_server, "/")
    counts = api(dash_server, "/stats")["rollouts"]
    for name in ("queued", "running", "succeeded", "failed"):
        assert page.get_by_test_id(f"stat-{name}").locator(".stat-value").inner_text() == str(counts[name])
    runners = page.locator("#runners tbody tr")
    assert runners.count() == 4
    assert "Gone" in runners.filter(has_text="runner-old").inner_text()
    assert "Revoked" in runners.filter(has_text="runner-cut").inner_text()  # seen recently, but cut off
    assert "Busy" in runners.filter(has_text="runner-a").inner_text()  # holds the running rollout
    assert page.locator("#throughput-card rect.bar").count() > 5
    assert page.locator("#recent tbody tr").count() == 8
    assert page.locator(".live").get_attribute("data-state") == "live"
    assert page.locator("[data-nav=overview]").get_attribute("aria-current") == "page"
    assert_contrast(page)
    shoot(page, "overview")


def test_rollouts_filter_by_status_mode_and_version_and_page(
    page: Any, dash_server: ServerThread, dash_data: Populated
) -> None:
    goto(page, dash_server, "/rollouts")
    rows = page.locator(".rollouts-table tbody tr")
    assert rows.count() == 25
    shoot(page, "rollouts")

    page.get_by_role("button", name=re.compile(r"^Failed")).click()
    expect(rows).to_have_count(len(dash_data.failed))
    assert set(rows.locator(".badge").all_inner_texts()) == {"Failed"}
    assert "status=failed" in page.url
    assert_contrast(page)
    shoot(page, "rollouts-failed")

    page.get_by_role("button", name=re.compile(r"^All")).click()
    page.get_by_label("Mode").select_option("val")
    expect(rows).to_have_count(12)
    assert set(rows.locator(".tag").all_inner_texts()) == {"Validation"}

    page.get_by_label("Resources version").select_option("2")
    expect(rows).to_have_count(4)
    assert set(rows.locator("td:nth-child(4)").all_inner_texts()) == {"v2"}

    page.get_by_role("link", name="Clear filters").first.click()
    expect(rows).to_have_count(25)
    first_page = rows.locator("td:first-child").all_inner_texts()
    page.get_by_role("button", name="Older →").click()
    expect(page.get_by_test_id("page-info")).to_contain_text("Page 2")
    total = sum(api(dash_server, "/stats")["rollouts"].values())
    assert rows.count() == total - 25
    assert not set(rows.locator("td:first-child").all_inner_texts()) & set(first_page)
    page.get_by_role("button", name="← Newer").click()
    expect(page.get_by_test_id("page-info")).to_contain_text("Page 1")
    assert rows.locator("td:first-child").all_inner_texts() == first_page


def test_rollout_detail_shows_llm_calls_with_messages_tokens_and_latency(
    page: Any, dash_server: ServerThread, dash_data: Populated
) -> None:
    goto(page, dash_server, "/rollouts?status=succeeded&mode=train&version=1")
    short = dash_data.llm_rollout.removeprefix("ro-")
    page.get_by_role("link", name=short, exact=True).click()
    page.wait_for_selector(".page-rollout")
    assert page.locator("h1").inner_text() == f"Rollout {short}"

    calls = page.locator("li.ev-llm_call")
    assert calls.count() == 2
    first = calls.nth(0)
    assert "What is 17 * 23?" in first.locator(".msg-user").inner_text()
    assert "careful assistant" in first.locator(".msg-system").inner_text()
    assert "calculator" in first.locator(".msg-output").inner_text()
    meta = first.get_by_test_id("llm-meta").inner_text()
    assert re.search(r"Prompt tokens\s*56", meta) and re.search(r"Completion tokens\s*12", meta)
    assert re.search(r"Latency\s*\d+ ms", meta) and "smollm2" in meta
    assert "<answer>391</answer>" in calls.nth(1).locator(".msg-output").inner_text()
    assert page.get_by_test_id("llm-totals").inner_text().split()[:3] == ["LLM", "calls", "2"]

    reward = api(dash_server, f"/rollouts/{dash_data.llm_rollout}")["reward"]
    assert page.get_by_test_id("rollout-reward").inner_text() == f"{reward:g}"
    assert page.locator("li.ev-reward").count() == 1
    assert page.locator("li.ev-tool_call .event-summary").inner_text().startswith("calculator(")
    assert page.locator(".timeline-svg .tl-hit").count() == 5
    assert page.locator("#attempts tbody tr").count() == 1
    assert page.locator(".live").get_attribute("data-state") == "idle"  # finished: no more polling
    assert_contrast(page)
    shoot(page, "rollout-detail")

    page.locator("#events").get_by_role("button", name=re.compile(r"^LLM call")).click()
    expect(page.locator("li.event")).to_have_count(2)
    assert page.locator("li.event:not(.ev-llm_call)").count() == 0


def test_failed_rollout_shows_its_exception_and_traceback(
    page: Any, dash_server: ServerThread, dash_data: Populated
) -> None:
    goto(page, dash_server, f"/rollouts/{dash_data.failed_rollout}")
    exc = page.locator("li.ev-exception")
    assert exc.count() == 1
    assert "ValueError" in exc.locator(".event-summary").inner_text()
    assert 'raise ValueError(f"no <answer> tag' in exc.locator(".traceback").inner_text()
    assert page.locator(".callout-error").first.is_visible()
    assert "Failed" in page.locator(".detail-id .badge").inner_text()
    assert_contrast(page)
    shoot(page, "rollout-failed")


def test_running_rollout_keeps_polling(page: Any, dash_server: ServerThread, dash_data: Populated) -> None:
    goto(page, dash_server, f"/rollouts/{dash_data.running[0]}")
    assert page.locator(".detail-id .badge").inner_text() == "Running"
    assert page.locator(".live").get_attribute("data-state") == "live"
    with page.expect_response(
        lambda r: f"/api/rollouts/{dash_data.running[0]}/events" in r.url, timeout=5000
    ):
        pass  # the next poll, about 2 s later


def test_unknown_rollout_says_not_found(page: Any, dash_server: ServerThread) -> None:
    goto(page, dash_server, "/rollouts/ro-doesnotexist")
    assert page.get_by_text("Rollout not found").is_visible()
    assert page.get_by_role("link", name="Back to rollouts").is_visible()


def test_training_charts_reward_validation_and_metrics(page: Any, dash_server: ServerThread) -> None:
    goto(page, dash_server, "/training")
    reward = page.locator("#reward-card")
    assert reward.locator("path.line.s1").count() == 1 and reward.locator("path.line.s2").count() == 1
    assert reward.locator("circle.dot").count() == 6  # 3 versions x (train, validation)
    assert reward.locator(".legend").inner_text().split("\n") == ["Train reward", "Validation score"]
    metrics = page.locator("#metrics .chart-title").all_inner_texts()
    assert metrics == ["kl", "loss", "val_score"]
    assert page.locator("#versions tbody tr").count() == 3
    assert_contrast(page)
    shoot(page, "training")

    reward.get_by_role("button", name="Training step").click()
    expect(reward.locator("circle.dot")).to_have_count(4)  # v1 has no step
    assert "x=step" in page.url
    # the tooltip: focus the plot, arrow keys read the values
    page.locator("#reward-card svg[data-chart]").focus()
    page.keyboard.press("ArrowRight")
    tip = page.locator("#chart-tooltip")
    assert tip.is_visible() and "Validation score" in tip.inner_text()


def test_resources_show_prompt_diffs_and_weights(
    page: Any, dash_server: ServerThread, dash_data: Populated
) -> None:
    goto(page, dash_server, "/resources")
    assert page.locator(".version-title").inner_text() == f"Version {dash_data.versions[-1]}"
    assert page.locator(".version-link").count() == 3
    assert page.locator("#weights tbody tr").count() == 2  # v2 and v3 published new weights
    assert "Unchanged since v2" in page.locator("#res-prompt").inner_text()

    page.locator(".version-link", has_text="v2").click()
    expect(page.locator(".version-title")).to_have_text("Version 2")
    diff = page.locator("#res-prompt .diff")
    assert diff.locator("tr.diff-del").all_inner_texts()[0].endswith("Think step by step.")
    assert diff.locator("tr.diff-add").count() == 2 and diff.locator("tr.diff-del").count() == 2
    assert "+2" in page.locator("#res-prompt .card-sub").inner_text()
    assert_contrast(page)
    shoot(page, "resources-diff")

    page.locator("#res-prompt").get_by_role("button", name="Full text").click()
    page.wait_for_selector("#res-prompt pre.prompt-text")
    assert "inside <answer></answer> tags" in page.locator("#res-prompt pre").inner_text()


# ------------------------------------------------------------------ tokens, errors, states


def test_bad_token_asks_for_another_and_a_good_one_gets_in(open_page: Any, dash_server: ServerThread) -> None:
    page = open_page(token="not-the-token")
    page.goto(dash_server.url + "/")
    dialog = page.locator("#token-dialog")
    dialog.wait_for(state="visible")
    assert "rejected" in page.locator("#token-error").inner_text()
    assert page.get_by_text("Your access token was rejected").is_visible()
    assert page.locator(".live").get_attribute("data-state") == "locked"
    shoot(page, "bad-token")

    page.get_by_label("Access token").fill("still-wrong")
    page.get_by_role("button", name="Connect").click()
    expect(page.locator("#token-error")).to_contain_text("rejected this token")

    page.get_by_label("Access token").fill("readtok")
    page.get_by_role("button", name="Connect").click()
    page.wait_for_selector(".page-overview")
    assert not dialog.is_visible()
    assert page.evaluate("localStorage.getItem('agentbolt.token')") == "readtok"
    assert "read-only" in page.locator("#server-info").inner_text()


def test_no_token_asks_without_blaming(open_page: Any, dash_server: ServerThread) -> None:
    page = open_page(token=None)
    page.goto(dash_server.url + "/dashboard#/rollouts")
    page.locator("#token-dialog").wait_for(state="visible")
    assert not page.locator("#token-error").is_visible()
    page.keyboard.press("Escape")
    assert page.get_by_role("button", name="Enter access token").is_visible()


def test_server_down_shows_an_error_and_recovers(page: Any, dash_server: ServerThread) -> None:
    page.route("**/api/**", lambda route: route.abort("connectionrefused"))
    page.goto(dash_server.url + "/#/rollouts")
    page.get_by_text("Can’t reach the agentbolt server").wait_for()
    assert page.locator(".live").get_attribute("data-state") == "offline"
    shoot(page, "server-down")
    page.unroute("**/api/**")
    page.get_by_role("button", name="Retry now").click()
    page.wait_for_selector(".page-rollouts")

    # connection lost while showing data: the data stays, a banner says so
    page.route("**/api/**", lambda route: route.abort("connectionrefused"))
    page.locator("#banner").wait_for(state="visible", timeout=6000)
    assert "Connection to the server lost" in page.locator("#banner").inner_text()
    assert page.locator(".rollouts-table").is_visible()
    page.unroute("**/api/**")
    page.locator("#banner").wait_for(state="hidden", timeout=6000)


def test_keyboard_navigation_and_focus(page: Any, dash_server: ServerThread, dash_data: Populated) -> None:
    goto(page, dash_server, "/")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    page.keyboard.press("Tab")  # the brand link, then the nav
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.nav") == "overview"
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"  # a visible focus ring
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    page.wait_for_selector(".page-rollouts")
    assert page.locator("[data-nav=rollouts]").get_attribute("aria-current") == "page"

    # the status filter is a group of real buttons: Tab to it, Space toggles
    page.locator(".segmented .seg").first.focus()
    page.keyboard.press("Tab")  # "Queued"
    page.keyboard.press("Tab")  # "Running"
    page.keyboard.press("Space")
    expect(page).to_have_url(re.compile(r"status=running"))
    expect(page.locator(":focus")).to_have_attribute("aria-pressed", "true")  # same button, still focused
    assert page.evaluate("document.activeElement.dataset.value") == "running"
    expect(page.locator(".rollouts-table tbody tr")).to_have_count(1)

    # Enter on a row's link opens the rollout
    page.locator(".rollouts-table tbody a").first.focus()
    page.keyboard.press("Enter")
    page.wait_for_selector(".page-rollout")
    assert dash_data.running[0].removeprefix("ro-") in page.locator("h1").inner_text()


def test_light_theme_is_readable(open_page: Any, dash_server: ServerThread, dash_data: Populated) -> None:
    page = open_page(token="readtok", color_scheme="light")
    for name, route in [
        ("overview", "/"),
        ("rollouts", "/rollouts"),
        ("rollout-detail", f"/rollouts/{dash_data.llm_rollout}"),
        ("training", "/training"),
        ("resources", "/resources/2"),
    ]:
        goto(page, dash_server, route)
        assert_contrast(page)
        shoot(page, f"light-{name}")


def test_empty_server_then_live_updates_paused_while_hidden(
    open_page: Any, empty_server: ServerThread
) -> None:
    page = open_page(token="readtok")
    for route, text in [
        ("/rollouts", "No rollouts yet"),
        ("/training", "No training data yet"),
        ("/resources", "No resources published yet"),
    ]:
        goto(page, empty_server, route)
        assert page.get_by_text(text).is_visible()
    goto(page, empty_server, "/")
    assert page.get_by_text("No runners yet").is_visible()
    assert page.get_by_text("No rollouts finished in the last hour").is_visible()
    assert_contrast(page)
    shoot(page, "empty-overview")
    queued = page.get_by_test_id("stat-queued").locator(".stat-value")
    assert queued.inner_text() == "0"

    with Client(empty_server.url, token="admintok") as client:
        client.enqueue([RolloutCreate(task=Task(data={"q": 1}), mode=Mode.TRAIN)])
        expect(queued).to_have_text("1", timeout=6000)

        # a hidden tab stops polling; showing it again catches up at once
        page.evaluate("""() => {
            Object.defineProperty(document, 'hidden', { configurable: true, get: () => true });
            document.dispatchEvent(new Event('visibilitychange'));
        }""")
        page.locator(".live[data-state=paused]").wait_for()
        client.enqueue([RolloutCreate(task=Task(data={"q": 2}), mode=Mode.TRAIN)])
        page.wait_for_timeout(4500)  # two poll periods
        assert queued.inner_text() == "1"
        page.evaluate("""() => {
            Object.defineProperty(document, 'hidden', { configurable: true, get: () => false });
            document.dispatchEvent(new Event('visibilitychange'));
        }""")
        expect(queued).to_have_text("2", timeout=3000)


def test_navigating_away_mid_load_lands_on_the_last_page(page: Any, dash_server: ServerThread) -> None:
    goto(page, dash_server, "/")
    for route in ("/training", "/rollouts", "/resources"):  # each cancels the load before it
        page.evaluate("(route) => { location.hash = route; }", route)
    expect(page.locator(".page-resources")).to_be_visible()
    expect(page.locator("h1")).to_have_text("Resources")
    assert page.locator("[data-nav=resources]").get_attribute("aria-current") == "page"
