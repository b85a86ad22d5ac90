"""The live dashboard (`GET /dashboard`, router/frontends/dashboard.py) in a real headless Chromium, driven by
Playwright: the key prompt, the figures moving under load, and a request cancelled from its row. It also takes
the screenshot docs/operations.md shows ("The dashboard"):
`CONVEYOR_DASHBOARD_SCREENSHOT=docs/dashboard.png make test ARGS=tests/e2e/test_dashboard.py` writes it there
(otherwise it goes to a temporary file, so that a test run leaves the tree as it was).

Chromium is the system's (Debian's `chromium`; .ci/run installs it): Playwright's own browser download needs the
internet, which the test machines do not have.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from conftest import Server, StreamWatcher, start_server

from conveyor.router.core.live_stats import RATE_WINDOW_S, LiveStats

OPS, ALICE = "ops-secret-1", "alice-secret-1"
KEYS = {"keys": [{"name": "ops", "key": OPS, "admin": True}, {"name": "alice", "key": ALICE}]}
# The longest streams the tiny model allows (1,024 positions): a pair takes seconds on 2 cores, so that ten of
# them, two at a time, outlast the test's checks; the test cancels what is left.
LONG = {"inputs": "def forever():", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
LOAD = 10  # streams: 2 run (--max-batch-size 2), the others wait
SCREENSHOT = os.environ.get("CONVEYOR_DASHBOARD_SCREENSHOT")
TIMEOUT_MS = 60_000
# A function, not an expression: the page's Content-Security-Policy forbids eval, which Playwright uses for those.
POSITIVE = "id => parseFloat(document.getElementById(id).textContent) > 0"


@pytest.fixture(scope="module")
def chromium() -> str:
    """The system Chromium; without it, a CI run fails (the browser test must run there) and a laptop skips,
    before a deployment is started for nothing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        found, missing = None, "the playwright package (pip install -e '.[test]')"
    else:
        missing = "Chromium (apt-get install chromium)"
    if found is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"the dashboard's browser test needs {missing}; CI must install it (.ci/run does)")
        pytest.skip(f"needs {missing}")
    return found


@pytest.fixture(scope="module")
def deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("dashboard") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    flags = ("--api-keys-file", str(keys), "--max-batch-size", "2", "--served-model-name", "tiny-llama")
    server = start_server(tiny_model, *flags)
    yield server
    assert server.stop() == 0


@pytest.fixture
def page(chromium: str, deployment: Server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            headless=True,
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run"],
        )
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
        finally:
            browser.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_live_stats_keep_the_last_minute() -> None:
    """Nearest-rank percentiles of the last 60 s of samples, and tokens/s over the last 5 s, on a clock the test
    moves itself."""
    now = [1000.0]
    live = LiveStats(clock=lambda: now[0])
    assert live.ttft() == {"p50": None, "p90": None, "p99": None} and live.tokens_per_s() == 0
    live.first_token(1000.0, 9.0)  # a minute later it is gone
    now[0] = 1061.0
    for i in range(100):
        live.first_token(now[0], (i + 1) / 100)
        live.next_token(now[0], 0.5)
    assert live.ttft() == {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    assert live.itl() == {"p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert live.tokens_per_s() == 200 / RATE_WINDOW_S
    now[0] += RATE_WINDOW_S + 1
    assert live.tokens_per_s() == 0 and live.ttft()["p99"] == 0.99


def test_the_page_is_open_and_its_figures_need_a_key(deployment: Server) -> None:
    page = httpx.get(f"{deployment.url}/dashboard")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["Content-Security-Policy"]  # nothing from elsewhere, ever
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)
    for headers in ({}, bearer("wrong-key-1")):
        refused = httpx.get(f"{deployment.url}/dashboard/state", headers=headers)
        assert refused.status_code == 401 and refused.json()["error_type"] == "unauthorized"
    state = httpx.get(f"{deployment.url}/dashboard/state", headers=bearer(ALICE)).json()
    assert state["caller"] == {"name": "alice", "admin": False}
    assert state["device"] == "cpu" and state["dtype"] == deployment.info()["model_dtype"]
    assert state["kv"]["dtype"] == deployment.info()["kv_cache_dtype"] == state["dtype"]  # no --kv-cache-dtype
    assert state["kv"]["disk_bytes"] == deployment.info()["kv_offload_max_bytes"] == 0  # no --kv-offload-dir
    check_schema(deployment, state)


def check_schema(server: Server, state: dict) -> None:
    document = httpx.get(f"{server.url}/openapi.json").json()
    schema = {"$ref": "#/components/schemas/DashboardState", "components": document["components"]}
    jsonschema.validate(state, schema)


def test_the_dashboard_follows_the_load_and_cancels_a_request(page, deployment: Server, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url))
    page.goto(f"{deployment.url}/dashboard")
    expect(page.locator("#key-prompt")).to_be_visible()  # /dashboard/state said 401
    page.locator("#key-input").fill(OPS)
    page.locator("#key-form button").click()
    expect(page.locator("#key-prompt")).to_be_hidden()
    expect(page.locator("#caller")).to_have_text("ops (admin)")
    expect(page.locator("#device")).to_have_text("cpu")
    expect(page.locator("#dtype")).to_have_text(deployment.info()["model_dtype"])
    expect(page.locator("#status")).to_have_text("serving")
    expect(page.locator("#batch-size")).to_have_text("0")

    # Long streams of alice's, each named by the id it sends as X-Request-Id.
    streams = {
        f"load-{i}": StreamWatcher(deployment, LONG, headers={**bearer(ALICE), "X-Request-Id": f"load-{i}"}).start()
        for i in range(LOAD)
    }
    try:
        under_load(page, deployment)
        cancel_from_the_page(page, deployment, streams)
        screenshot(page, Path(SCREENSHOT) if SCREENSHOT else tmp_path / "dashboard.png")
    finally:
        for request_id in streams:  # the rest: 200, or 404 once one ended
            httpx.delete(f"{deployment.url}/v1/requests/{request_id}", headers=bearer(OPS))
    ends = [stream.last(timeout=120) for stream in streams.values()]
    assert all(stream.headers["X-Request-Id"] == request_id for request_id, stream in streams.items())
    # The last event of each: cancelled (or, on a fast machine, finished before the test got to it).
    assert all(end.get("error_type") == "cancelled" or end.get("generated_text") is not None for end in ends)
    expect(page.locator("#requests tr")).to_have_count(0)
    expect(page.locator("#batch-size")).to_have_text("0")
    expect(page.locator("#queue-length")).to_have_text("0")
    assert fetched and all(url.startswith(deployment.url) for url in fetched), fetched


def under_load(page, deployment: Server) -> None:
    """The figures move: a full batch, a queue, tokens/s, KV in use, the rows of alice's requests, latencies."""
    from playwright.sync_api import expect

    expect(page.locator("#batch-size")).to_have_text("2")
    expect(page.locator("#queue-length")).to_have_text(re.compile(r"^[1-9]\d*$"))
    expect(page.locator("#queue-by-priority")).to_contain_text("priority 0:")
    expect(page.locator("#requests tr[data-state=running]")).to_have_count(2)
    expect(page.locator("#requests tr[data-state=queued]").first).to_be_visible()
    expect(page.locator("#requests tr").first).to_contain_text("alice")
    for figure in ("tokens-per-s", "kv-used"):
        page.wait_for_function(POSITIVE, arg=figure, timeout=TIMEOUT_MS)
    for figure in ("#ttft-p50", "#ttft-p99", "#itl-p50", "#itl-p99"):
        expect(page.locator(figure)).to_have_text(re.compile(r"\d (ms|s)$"))
    ids = page.locator("#requests tr").evaluate_all("rows => rows.map(row => row.dataset.id)")
    assert set(ids) <= {f"load-{i}" for i in range(LOAD)} and len(ids) >= 3
    state = httpx.get(f"{deployment.url}/dashboard/state", headers=bearer(OPS)).json()
    check_schema(deployment, state)


def cancel_from_the_page(page, deployment: Server, streams: dict[str, StreamWatcher]) -> None:
    """Clicks Cancel on a running request, with the shard paused so that none finishes on its own meanwhile: its
    stream ends with a `cancelled` error and its row goes; once the shard goes on, a queued request takes its
    place."""
    from playwright.sync_api import expect

    with deployment.shards_paused():
        rows = httpx.get(f"{deployment.url}/v1/requests", headers=bearer(OPS)).json()["data"]
        request_id = next(row["id"] for row in rows if row["state"] == "running")  # the server's word, not a poll's
        page.locator(f'#requests tr[data-id="{request_id}"] button.cancel').click()
        last = streams[request_id].last(timeout=TIMEOUT_MS / 1000)
        assert last["error_type"] == "cancelled", last
        expect(page.locator(f'#requests tr[data-id="{request_id}"]')).to_have_count(0)
        expect(page.locator("#notice")).to_have_text("")
    expect(page.locator("#batch-size")).to_have_text("2")


def screenshot(page, path: Path) -> None:
    """The picture in docs/operations.md, taken under load once the charts have five seconds of history."""
    from playwright.sync_api import expect

    page.wait_for_function(
        "() => (document.querySelector('#itl-chart polyline')?.getAttribute('points') || '').split(' ').length >= 10",
        timeout=TIMEOUT_MS,
    )
    expect(page.locator("#batch-size")).to_have_text("2")
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0
