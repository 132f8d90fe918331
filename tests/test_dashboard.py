"""The live dashboard (`serve --dashboard-listen`): its HTTP surface in-process, then a short
real run watched in headless Chromium.

The end-to-end test starts the real daemon process (`python -m bagel.coordinator serve`)
with simulated workers speaking real gRPC (tests/simworkers.py), opens the page in
Debian's Chromium driven by Playwright (the system browser: nothing is downloaded), and
checks that cells, workers and events appear and then change without a reload: a commit
raises a cell's round, a worker joining and one leaving show up in the table and the
event list, and a cell that falls back to its initial state (no live worker held its
committed state) says so on its card and in the events. It saves a screenshot to the test's tmp_path and a copy to
build/test-artifacts/dashboard.png, and reads the daemon's log for the story it told.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bagel.coordinator.daemon import start_coordinator
from bagel.coordinator.dashboard import MAX_CONNECTIONS
from bagel.protocol.runspec import parse_spec

from daemonproc import DaemonProcess, free_port
from simworkers import SimWorker, cluster_spec_text, sim_schema, start_workers, stop_workers, uniform_cells

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT_COPY = ROOT / "build" / "test-artifacts" / "dashboard.png"


def raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def http(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.mark.timeout(60)
async def test_dashboard_http_surface(tmp_path: Path) -> None:
    spec = parse_spec(cluster_spec_text("dashhttp"))
    h = await start_coordinator(
        spec,
        tmp_path / "d",
        cells=uniform_cells(spec.cell_ids),
        checkpoint_schema=sim_schema,
        dashboard_listen="127.0.0.1:0",
    )
    workers: list[SimWorker] = []
    try:
        url = h.dashboard.url
        assert url.startswith("http://127.0.0.1:")
        workers = await start_workers(f"127.0.0.1:{h.port}", "dashhttp", 1, cells=spec.cell_ids)
        status, headers, body = await asyncio.to_thread(http, url)
        assert status == 200 and b'<script src="/static/dashboard.js"' in body
        assert (
            "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
        )
        for path, ctype in (("static/dashboard.js", "text/javascript"), ("static/dashboard.css", "text/css")):
            status, headers, body = await asyncio.to_thread(http, url + path)
            assert status == 200 and headers["Content-Type"].startswith(ctype) and body
        for _ in range(100):
            status, headers, body = await asyncio.to_thread(http, url + "api/state")
            doc = json.loads(body)
            if doc["workers"]:
                break
            await asyncio.sleep(0.1)  # the document is rebuilt at most once a second
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert doc["run_id"] == "dashhttp" and [c["cell_id"] for c in doc["cells"]] == list(spec.cell_ids)
        assert doc["workers"][0]["name"] == "sim000" and doc["events"][0]["kind"] == "join"
        assert doc["health"]["active"] == 1 and len(doc["health"]["unstaffed"]) == len(spec.cell_ids) - 1
        # nothing else is served, and nothing is writable
        assert (await asyncio.to_thread(http, url + "static/../../daemon.py"))[0] == 404
        assert (await asyncio.to_thread(http, url + "etc/passwd"))[0] == 404
        assert (await asyncio.to_thread(http, url + "api/state", "POST"))[0] == 501
        status, _h, body = await asyncio.to_thread(http, url + "api/state", "HEAD")
        assert status == 200 and body == b""
        # a request that is not HTTP gets the library's 400 (as HTTP/0.9: no status line to speak)
        garbage = await asyncio.to_thread(raw, h.dashboard.port, b"\x16\x03\x01garbage\r\n\r\n")
        assert b"Error code: 400" in garbage
        # at most MAX_CONNECTIONS at once: idle connections hold every handler, the next is refused
        idle = [socket.create_connection(("127.0.0.1", h.dashboard.port), timeout=5) for _ in range(MAX_CONNECTIONS)]
        try:
            await asyncio.sleep(0.3)  # every one accepted and waiting for its request line
            assert (await asyncio.to_thread(raw, h.dashboard.port, b"GET / HTTP/1.0\r\n\r\n")).startswith(
                b"HTTP/1.0 503"
            )
        finally:
            for c in idle:
                c.close()
        for _ in range(50):  # the handlers see EOF and give their slots back
            if (await asyncio.to_thread(http, url))[0] == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the dashboard did not serve again after its idle clients went away")
    finally:
        await stop_workers(workers)
        await h.stop()
    with pytest.raises(OSError):  # stopped: the port is closed
        await asyncio.to_thread(http, url)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_dashboard_shows_a_live_run_in_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (`make test` installs Debian's chromium package)")
    playwright_api = pytest.importorskip("playwright.async_api", reason="playwright is a test dependency")

    spec_path = tmp_path / "dash.toml"
    text = cluster_spec_text("dashrun", lease_s=4.0, heartbeat_s=0.3, min_round_s=1.0)
    # a cell whose every holder is gone falls back at once when a newcomer needs it (below)
    spec_path.write_text(text.replace("quorum = 0.5", "quorum = 0.5\norphan_grace_s = 0", 1))
    cells = parse_spec(spec_path.read_text()).cell_ids  # the workers claim a speed on each
    target = f"127.0.0.1:{free_port()}"
    dash_port = free_port()
    daemon = DaemonProcess(
        spec_path,
        tmp_path / "data",
        *("--listen", target, "--no-dht", "--insecure", "--tick-ms", "50"),
        *("--dashboard-listen", f"127.0.0.1:{dash_port}", "--health-log-s", "1", "--log-level", "INFO"),
    )
    workers: list[SimWorker] = []
    extra: SimWorker | None = None
    newcomers: list[SimWorker] = []
    try:
        async with playwright_api.async_playwright() as pw:
            # the browser starts while the daemon does (leaving the `async with` stops both)
            launching = asyncio.ensure_future(pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"]))
            try:
                url = await asyncio.to_thread(daemon.wait_line, "dashboard:", 120)
            finally:
                browser = await launching
            try:
                assert url == f"http://127.0.0.1:{dash_port}/"
                # two workers on five cells: three cells get no member, and the story must say so
                workers = await start_workers(target, "dashrun", 2, cells=cells, samples_per_s=64.0)
                page = await browser.new_page(viewport={"width": 1400, "height": 1100})

                async def until(condition: str, what: str) -> None:
                    try:
                        await page.wait_for_function(condition, timeout=30_000)
                    except playwright_api.Error as e:
                        await page.screenshot(path=str(tmp_path / "failed.png"), full_page=True)
                        text = await page.inner_text("body")
                        raise AssertionError(
                            f"the page never showed {what} ({e.message[:200]}); it shows:\n{text}"
                        ) from None

                await page.goto(url)
                await page.evaluate("window.__sameDocument = true")  # gone if the page reloads
                await until(
                    """() => document.querySelectorAll('#cells .cell').length === 5
                        && document.querySelectorAll('#workers tbody tr').length === 2
                        && document.querySelectorAll('#events li[data-kind="join"]').length === 2
                        && document.querySelectorAll('#cells .cell.unstaffed').length === 3""",
                    "5 cells (3 without members), 2 workers and their joins",
                )
                first = await page.evaluate(
                    "Math.max(...[...document.querySelectorAll('#cells .cell')].map(c => +c.dataset.committedRound))"
                )
                updates = int(await page.evaluate("document.body.dataset.updates"))
                # rounds commit: a cell's round goes up and commit events arrive, in place
                await until(
                    f"""() => [...document.querySelectorAll('#cells .cell')]
                            .some(c => +c.dataset.committedRound > {first})
                        && document.querySelectorAll('#events li[data-kind="commit"]').length > 0
                        && document.querySelectorAll('#rate-chart polyline.goodput').length === 1
                        && +document.body.dataset.updates > {updates}""",
                    "a new commit, its event and the goodput line",
                )
                # a worker joins, another leaves: both show up without a reload
                extra = SimWorker(target, "dashrun", name="late-joiner", samples_per_s=64.0, cells=cells, seed=7)
                extra.start()
                await until(
                    f"""() => document.querySelector('#workers tr[data-worker-id="{extra.worker_id}"]') !== null
                        && [...document.querySelectorAll('#events li[data-kind="join"]')]
                            .some(li => li.textContent.includes('late-joiner'))""",
                    "the late joiner in the table and the events",
                )
                await workers[0].leave("the test sent it home")
                await until(
                    """() => [...document.querySelectorAll('#events li[data-kind="leave"]')]
                        .some(li => li.textContent.includes('the test sent it home'))""",
                    "the leave event with its reason",
                )
                # no live worker is left holding any committed state: the one sent home took its
                # cell's with it, and the others drop dead (their leases run out 4 s later). A
                # newcomer placed in a committed cell then makes it fall back at once
                # (orphan_grace_s = 0; no checkpoint: to its initial state), whichever of the two
                # ways its holder went. Five newcomers on five cells: the scheduler fills the
                # cells' missing replicas (a convex penalty) before it doubles any, so committed
                # cells get newcomers. Each cell that fell back says so on its card and in the
                # events, and a cell falls back only from rounds it had committed.
                trained = await page.evaluate(
                    """[...document.querySelectorAll('#cells .cell')]
                        .filter(c => +c.dataset.committedRound > 0).map(c => c.dataset.cellId)"""
                )
                assert trained, "no cell had committed a round"
                await asyncio.gather(workers[1].crash(), extra.crash())
                newcomers = [
                    SimWorker(target, "dashrun", name=f"newcomer{i}", samples_per_s=64.0, cells=cells, seed=10 + i)
                    for i in range(5)
                ]
                for w in newcomers:
                    w.start()
                await until(
                    """() => {
                        const note = (c) => c.querySelector('.note.rollbacks')?.textContent ?? '';
                        const fell = [...document.querySelectorAll('#cells .cell')]
                            .filter(c => note(c).includes('fell back to its checkpoint 1×'));
                        const told = [...document.querySelectorAll('#events li[data-kind="rollback"]')]
                            .map(li => li.textContent);
                        const says = (c) => `cell ${c.dataset.cellId} fell back to its initial state`;
                        return fell.length > 0 && fell.length === told.length
                            && fell.every(c => told.some(t => t.includes(says(c))));
                    }""",
                    "a fallback on a cell's card and in the events",
                )
                told = await page.evaluate(
                    """[...document.querySelectorAll('#events li[data-kind="rollback"]')].map(li => li.textContent)"""
                )
                # each fell back from rounds it had committed: a cell that never committed has nothing to lose
                assert told and all(re.search(r"; rounds 1\.\.\d+ are lost$", t) for t in told), told
                assert await page.evaluate("window.__sameDocument === true")
                health = await page.text_content("#health")
                assert health is not None and "workers healthy]" in health
                shot = tmp_path / "dashboard.png"
                await page.screenshot(path=str(shot), full_page=True)
            finally:
                await browser.close()
        assert shot.stat().st_size > 10_000
        SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT_COPY)
    finally:
        await stop_workers([*workers, *([extra] if extra else []), *newcomers])
        if daemon.proc.poll() is None:
            daemon.signal(signal.SIGTERM)
            daemon.wait(30)
        daemon.close()
    # the daemon's own log told the same story
    log = "\n".join(daemon.stderr)
    for name in ("sim000", "sim001", "late-joiner"):
        assert f"({name}) joined" in log, log[-3000:]
    assert "left: the test sent it home" in log
    assert re.search(r"cell \S+ fell back to its initial state: no live worker held its committed state", log)
    # the health line, with the cells that have no members named
    assert re.search(r"\[\d+/\d+ workers healthy\]; \d/5 cells with members; no members: ", log), log[-3000:]
