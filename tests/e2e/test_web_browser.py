"""`gpuflex web` in a real headless browser (Debian's chromium, driven by Selenium through
Debian's chromium-driver, which matches its version; nothing is downloaded): the pages
render with the data of a real run, a small in-place elastic job of the example that was
scaled from 1 to 2 workers, and its job page shows that resize on its world-size plot
and in its event table. A screenshot of each page is saved for review, in
$GPUFLEX_SCREENSHOTS or a temporary directory the test prints.

Skipped, with the reason, where chromium or its driver is absent (`make test` installs
them as root: the Makefile's `chromium` target).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.test_elastic_jobs import ej, example_argv, scale, step_of  # noqa: F401 (ej: the fixture)
from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # a job, the console script's server, a browser

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
GUARD_S = 120   # against a server that never answers: never a timing


@pytest.fixture(scope="session")
def browser():
    """One headless chromium for the session."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(DRIVER, os.X_OK)):
        pytest.skip(f"{CHROMIUM} or {DRIVER} not installed (Debian's chromium and chromium-driver; "
                    "`make chromium` installs them as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(ej, home):   # noqa: F811 (ej: the imported fixture)
    """`gpuflex web` on a free loopback port, as a user starts it; its base URL."""
    port = free_port()
    proc = subprocess.Popen([ej.script, "web", "--bind", f"127.0.0.1:{port}"], env=ej.env(), cwd=home,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + GUARD_S
    while True:
        try:
            urllib.request.urlopen(base + "/queue", timeout=10).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > end:
                proc.kill()
                pytest.fail(f"gpuflex web did not answer: {proc.communicate()[0]}")
            time.sleep(0.3)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("GPUFLEX_SCREENSHOTS") or tmp_path_factory.mktemp("web-screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the dashboard's pages in {out}")
    return out


def visit(browser, url: str, shots: Path, name: str) -> str:
    from selenium.webdriver.common.by import By

    browser.get(url)
    assert browser.find_element(By.TAG_NAME, "h1").text   # a page, not an error's plain text
    browser.save_screenshot(str(shots / f"{name}.png"))
    return browser.page_source


def test_the_pages_render_a_scaled_job_in_a_browser(ej, server, browser, shots, home):  # noqa: F811
    from selenium.webdriver.common.by import By

    report, hold = home / "r.json", home / "hold"
    hold.touch()   # the job steps slowly while the file exists: it runs on through its resize
    job = ej.submit(example_argv(report, epochs=4, sleep=0.3, hold=hold), "--workers", "1:2", "--name", "grow")
    scale(ej, job["id"], 1)
    wait_for(ej, job["id"], lambda j: step_of(j) >= 3, "some steps at world size 1")
    scale(ej, job["id"], 2)

    page = visit(browser, f"{server}/jobs/{job['id']}", shots, "job-running")
    marks = browser.find_elements(By.CSS_SELECTOR, "svg line.mark.scale")
    assert marks, "the world-size plot marks no scale event"
    assert browser.find_elements(By.CSS_SELECTOR, "svg path.world")
    events = browser.find_element(By.CSS_SELECTOR, "table.events").text
    assert "scale" in events, events
    assert "grow" in page

    hold.unlink()
    done = ej.wait_final(job["id"])
    assert done["state"] == "succeeded", done

    page = visit(browser, f"{server}/jobs/{job['id']}", shots, "job")
    assert browser.find_elements(By.CSS_SELECTOR, "svg line.mark.scale")
    assert "<td>2</td>" in page or "2 (1:2)" in page
    queue = visit(browser, f"{server}/queue", shots, "queue")
    assert "grow" in queue and "succeeded" in queue
    visit(browser, f"{server}/?range=1d", shots, "pool")
    assert browser.find_elements(By.CSS_SELECTOR, "svg rect.busy"), "the pool's timeline shows no busy slot"
    assert "local" in browser.find_element(By.CSS_SELECTOR, "table.hosts").text
    visit(browser, f"{server}/acct?range=1d", shots, "acct")
    assert done["user"] in browser.find_element(By.CSS_SELECTOR, "table.by-user").text
    assert browser.find_elements(By.CSS_SELECTOR, "svg rect.bar")
    assert sorted(p.name for p in shots.glob("*.png")) == ["acct.png", "job-running.png", "job.png", "pool.png",
                                                         "queue.png"]
