"""The dashboard's server side, without a browser: what is open, what needs a token, the
dashboard routes, and that the page ships whole inside the package."""

from __future__ import annotations

import re
from importlib.resources import files

import httpx
import pytest

from agentbolt.server import ServerThread
from agentbolt.server.routes.dashboard import STATIC_DIR, throughput

READER = {"authorization": "Bearer readtok"}


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_page_is_served_without_a_token_with_a_strict_policy(dash_server: ServerThread, path: str) -> None:
    r = httpx.get(dash_server.url + path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/js/app.js">' in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp


def test_static_files_are_open_and_the_api_is_not(dash_server: ServerThread) -> None:
    js = httpx.get(dash_server.url + "/static/js/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert js.headers["cache-control"] == "no-cache"
    assert httpx.get(dash_server.url + "/api/stats").status_code == 401
    assert httpx.get(dash_server.url + "/api/dashboard/info").status_code == 401
    assert (
        httpx.get(dash_server.url + "/api/stats", headers={"authorization": "Bearer nope"}).status_code == 401
    )


def test_info_tells_the_page_who_it_is(dash_server: ServerThread) -> None:
    info = httpx.get(dash_server.url + "/api/dashboard/info", headers=READER).json()
    assert info["role"] == "reader" and info["auth"] is True and info["backend"] == "sqlite"
    assert info["lease_seconds"] == 3600


def test_throughput_counts_every_finished_rollout(dash_server: ServerThread, dash_data) -> None:
    body = httpx.get(
        dash_server.url + "/api/dashboard/throughput", params={"window": 3600, "bucket": 60}, headers=READER
    ).json()
    assert body["bucket_seconds"] == 60 and len(body["buckets"]) == 60
    finished = sum(b["succeeded"] + b["failed"] + b["cancelled"] for b in body["buckets"])
    assert finished == len(dash_data.finished)
    assert sum(b["failed"] for b in body["buckets"]) == len(dash_data.failed)
    starts = [b["start"] for b in body["buckets"]]
    assert starts == sorted(starts) and starts[-1] <= body["now"] < starts[-1] + 60


def test_throughput_widens_buckets_beyond_2000(dash_server: ServerThread) -> None:
    r = httpx.get(
        dash_server.url + "/api/dashboard/throughput", params={"window": 86400, "bucket": 1}, headers=READER
    )
    assert r.status_code == 200  # valid per the schema, so not refused: the bucket is widened
    body = r.json()
    assert body["bucket_seconds"] == 86400 / 2000 and len(body["buckets"]) == 2000


def test_throughput_buckets_edges() -> None:
    rows = [
        (1000.0, "succeeded"),
        (1059.9, "failed"),
        (1060.0, "succeeded"),
        (1179.0, "cancelled"),
        (900.0, "succeeded"),
        (1150.0, "running"),
    ]
    out = throughput(rows, end=1190.0, window=180, bucket=60)
    assert [b["start"] for b in out["buckets"]] == [1020.0, 1080.0, 1140.0]  # last one: partial
    assert [(b["succeeded"], b["failed"], b["cancelled"]) for b in out["buckets"]] == [
        (1, 1, 0),
        (0, 0, 0),
        (0, 0, 1),
    ]
    assert "running" not in out["buckets"][0]


def test_the_page_ships_in_the_package_and_fetches_nothing_from_outside() -> None:
    root = files("agentbolt.server") / "static"
    assert (root / "index.html").is_file() and (root / "js" / "app.js").is_file()
    index = (STATIC_DIR / "index.html").read_text()
    for ref in re.findall(r'(?:src|href)="(/static/[^"]+)"', index):
        assert (STATIC_DIR / ref.removeprefix("/static/")).is_file(), ref
    for path in STATIC_DIR.rglob("*"):
        if path.suffix in {".js", ".css", ".html", ".svg"}:
            text = path.read_text()
            external = re.findall(r"https?://(?!www\.w3\.org/2000/svg)[^\s\"'`)]+", text)
            assert not external, f"{path.name} refers to {external}"
            for imported in re.findall(r'from "(\.[^"]+)"', text):  # every module import resolves
                assert (path.parent / imported).resolve().is_file(), f"{path.name}: {imported}"
