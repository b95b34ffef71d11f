"""Dashboard fixtures: a real server over a SQLite file with a reader token, populated through
the API, and headless Chromium driven by Playwright's Python package.

Chromium is the system one (``/usr/bin/chromium``, or ``AGENTBOLT_CHROMIUM``), never a browser
Playwright downloads. Where it (or Playwright) is missing the browser tests skip, except under
``CI=true``, where they fail: CI must not go green without having run them.
Screenshots of every page land in ``artifacts/dashboard/`` (gitignored).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbolt.server import Role, ServerConfig, ServerThread

sys.path.insert(0, str(Path(__file__).parent))
from dashboard_data import Populated, populate  # noqa: E402

CHROMIUM = os.environ.get("AGENTBOLT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKENS = {"admintok": Role.ADMIN, "readtok": Role.READER}
VIEWPORT = {"width": 1280, "height": 800}


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: the dashboard tests must run)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Module scope, not session: Playwright's sync API keeps an event loop running in the main
    # thread while started, which would break every later test that calls asyncio.run().
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"no Chromium at {CHROMIUM} (run .ci/install-chromium.sh or set AGENTBOLT_CHROMIUM)")
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
    except Exception as exc:
        playwright.stop()
        _unavailable(f"Chromium at {CHROMIUM} failed to start: {exc}")
    yield browser
    browser.close()
    playwright.stop()


@pytest.fixture(scope="session")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Populated]]:
    """One server for the read-only tests; a lease of an hour keeps the running rollout running."""
    db = tmp_path_factory.mktemp("dashboard") / "store.db"
    config = ServerConfig(tokens=TOKENS, db=str(db), lease_seconds=3600)
    server = ServerThread(config).start()
    try:
        yield server, populate(server.url, "admintok", server.app.state.store)
    finally:
        server.stop()
        server.app.state.store.close()


@pytest.fixture(scope="session")
def dash_server(populated: tuple[ServerThread, Populated]) -> ServerThread:
    return populated[0]


@pytest.fixture(scope="session")
def dash_data(populated: tuple[ServerThread, Populated]) -> Populated:
    return populated[1]


@pytest.fixture
def empty_server(tmp_path: Path) -> Iterator[ServerThread]:
    """A fresh server of its own, for empty states and live updates (it gets written to)."""
    server = ServerThread(
        ServerConfig(tokens=TOKENS, db=str(tmp_path / "empty.db"), lease_seconds=3600)
    ).start()
    try:
        yield server
    finally:
        server.stop()
        server.app.state.store.close()


def new_page(browser: Any, token: str | None, color_scheme: str = "dark") -> tuple[Any, Any, list[str]]:
    context = browser.new_context(viewport=VIEWPORT, color_scheme=color_scheme, reduced_motion="reduce")
    if token is not None:
        context.add_init_script(f"localStorage.setItem('agentbolt.token', {json.dumps(token)})")
    page = context.new_page()
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return context, page, errors


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A 1280x800 page holding the reader token; fails the test on any uncaught script error."""
    context, page, errors = new_page(browser, "readtok")
    yield page
    context.close()
    assert not errors, f"script errors on the page: {errors}"


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[..., Any]]:
    """Pages with another token (or none) or colour scheme: ``open_page(token=..., color_scheme=...)``."""
    opened: list[tuple[Any, list[str]]] = []

    def make(token: str | None = None, color_scheme: str = "dark") -> Any:
        context, page, errors = new_page(browser, token, color_scheme)
        opened.append((context, errors))
        return page

    yield make
    for context, errors in opened:
        context.close()
        assert not errors, f"script errors on the page: {errors}"
