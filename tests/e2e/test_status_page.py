"""``GET /status`` in a real browser: Debian's chromium, headless, driven by Selenium through
Debian's chromedriver, against a real server on a loopback port, in both modes.

The page must show the worker(s), then update after a request: the jobs done count and the
model's norm histogram. Keys are on, so the page's key handling is exercised too: ``?key=``
in the address (then dropped from it) and the form it shows when the server answers 401.

With ``PSGRAD_STATUS_SCREENSHOT=path.png`` the Redis-mode test saves the page after its traffic
(docs/status.png was made so).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from service.api import create_app
from tests.support.api import serving, settings
from tests.support.cluster import env_of, settings_for
from tests.support.redis import SHARED_URL, fresh_prefix, worker_process
from tests.support.status import norms_request

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="the browser test needs Debian's chromium and chromedriver "
    "(apt-get install chromium chromium-driver; .ci/run installs them)",
)
KEY = "status-page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# the columns of the workers table (service/api/status.html)
STATE, ID, HOST, DEVICE, JOBS_DONE, FAILED, SAMPLES_DONE, RATE, BATCH = range(9)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = CHROMIUM or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,1140", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER or ""), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver: WebDriver, found: Callable[[WebDriver], Any], what: str,
          timeout: float = 60.0) -> Any:
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1,
                             ignored_exceptions=[StaleElementReferenceException]).until(found)
    except TimeoutException:
        page = driver.find_element(By.TAG_NAME, "body").text
        raise AssertionError(f"the page did not show {what} within {timeout} s:\n{page}") from None


# The page redraws every second: read what it shows in one script call, never through elements
# kept across a redraw.
ROWS = "return Array.from(document.querySelectorAll(arguments[0]), " \
       "r => Array.from(r.cells, c => c.textContent));"
FIGURE = """const f = document.querySelector(`#norms figure[data-model^="${arguments[0]}@"]`);
const bars = f ? Array.from(f.querySelectorAll("rect.b")) : [];
return f && {caption: f.querySelector("figcaption").textContent,
             bars: bars.filter(b => +b.getAttribute("height") > 0).length};"""


def rows(driver: WebDriver, selector: str) -> list[list[str]]:
    return driver.execute_script(ROWS, selector)  # type: ignore[no-any-return]


def worker_rows(driver: WebDriver) -> list[list[str]]:
    return rows(driver, "#workers tr[data-worker]")


def jobs_done(driver: WebDriver) -> int:
    return sum(int(row[JOBS_DONE]) for row in worker_rows(driver))


def shows_workers(n: int) -> Callable[[WebDriver], bool]:
    def check(driver: WebDriver) -> bool:
        found = worker_rows(driver)
        return len(found) == n and all(r[STATE] == "alive" for r in found)
    return check


def histogram(driver: WebDriver, model_id: str) -> dict[str, Any] | None:
    return driver.execute_script(FIGURE, model_id)  # type: ignore[no-any-return]


def check_updates(driver: WebDriver, url: str, samples: int) -> None:
    """A norms request on the zoo mlp: the jobs done count and the mlp histogram follow."""
    before = jobs_done(driver)
    assert histogram(driver, "mlp") is None
    r = httpx.post(f"{url}/per-sample-grads", json=norms_request(samples), headers=AUTH,
                   timeout=120)
    assert r.status_code == 200, r.text
    until(driver, lambda d: jobs_done(d) == before + 1, "the job done")
    figure = until(driver, lambda d: histogram(d, "mlp"), "the mlp norm histogram")
    assert figure["caption"].endswith(f"{samples} samples") and figure["bars"] > 0, figure
    assert sum(int(row[SAMPLES_DONE]) for row in worker_rows(driver)) >= samples
    [model] = rows(driver, '#models tr[data-model="mlp"]')
    assert model[:3] == ["mlp", "1", "0"], model
    assert driver.find_element(By.ID, "conn").text == "live"


def test_embedded_page_asks_for_the_key_then_follows_a_request(browser: WebDriver) -> None:
    with serving(create_app(settings(api_keys=KEY, workers=1))) as url:
        browser.get(f"{url}/status")
        form = until(browser, lambda d: d.find_element(By.ID, "keyform").is_displayed()
                     and d.find_element(By.ID, "keyform"), "the key form")
        assert browser.find_element(By.ID, "conn").text == "key needed"
        field = browser.find_element(By.ID, "key")
        field.send_keys("wrong")
        form.submit()
        until(browser, lambda d: d.find_element(By.ID, "conn").text == "key refused",
              "a refused key")
        field.clear()
        field.send_keys(KEY)
        form.submit()
        until(browser, shows_workers(1), "the worker")
        row = worker_rows(browser)[0]
        assert (row[ID], row[DEVICE], row[JOBS_DONE]) == ("psgrad-worker-0", "cpu", "0")
        assert browser.find_element(By.ID, "mode").text == "embedded mode"
        # a bare key is a tenant of its own; the page says whose requests it shows
        tenant = "key-" + hashlib.sha256(KEY.encode()).hexdigest()[:12]
        assert browser.find_element(By.ID, "tenant").text == f"tenant {tenant}'s requests"
        check_updates(browser, url, samples=5)


prefix = pytest.fixture(fresh_prefix)


def test_redis_page_aggregates_the_workers_and_follows_requests(browser: WebDriver,
                                                                prefix: str) -> None:
    config = settings_for(SHARED_URL, prefix, api_keys=KEY)
    workers = [worker_process(env_of(config), stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        with serving(create_app(config)) as url:
            ready_within(url, 90.0, workers)
            browser.get(f"{url}/status?key={KEY}")
            until(browser, shows_workers(2), "both workers")
            assert "key=" not in browser.current_url  # dropped from the address bar
            assert browser.find_element(By.ID, "mode").text == "Redis mode"
            ids = [row[ID] for row in worker_rows(browser)]  # host-pid-device-random
            assert all(any(f"-{w.pid}-cpu-" in i for i in ids) for w in workers), ids
            check_updates(browser, url, samples=6)
            traffic(url)
            until(browser, lambda d: rows(d, '#errors tr[data-code="shape_mismatch"]'),
                  "the error")
            until(browser, lambda d: histogram(d, "value-mlp"), "the second histogram")
            shot = os.environ.get("PSGRAD_STATUS_SCREENSHOT")
            if shot:
                screenshot(browser, url, shot)
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(30)


def ready_within(url: str, timeout: float, workers: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
        assert all(w.poll() is None for w in workers), "a worker exited"
        assert time.monotonic() < deadline, "no worker became ready"
        time.sleep(0.2)


def traffic(url: str) -> None:
    """A few more models, norms spread over decades (inputs scaled), and two errors."""
    rng = np.random.default_rng(1)
    scale = np.logspace(-2, 1, 48, dtype=np.float32)[:, None]
    mlp = {**norms_request(48, seed=3), "outputs": ["norms", "losses"]}
    mlp["inputs"] = (np.asarray(mlp["inputs"], dtype=np.float32) * scale).round(4).tolist()
    value = {"model": "value-mlp", "loss": "mse", "targets": rng.standard_normal(48).tolist(),
             "inputs": (rng.standard_normal((48, 8)) * scale).round(4).tolist()}
    bodies = [
        mlp,
        {**value, "outputs": ["clipped_mean"], "clip_norm": 1.0},
        {**value, "outputs": ["norms", "mean"]},
        {**norms_request(2), "inputs": [[0.0] * 5] * 2},  # shape_mismatch
        {**norms_request(2), "model": "resnet-0"},  # unknown_model
    ]
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        for body in bodies:
            c.post("/per-sample-grads", json=body)


def screenshot(driver: WebDriver, url: str, path: str) -> None:
    """The page with a long batch in hand (simple-cnn's per-sample gradients), as docs show it."""
    rng = np.random.default_rng(2)
    heavy = {"model": "simple-cnn", "inputs": rng.standard_normal((512, 1, 28, 28)).round(2)
             .tolist(), "targets": rng.integers(0, 10, 512).tolist(), "outputs": ["norms"]}
    post = threading.Thread(target=httpx.post, args=(f"{url}/per-sample-grads",),
                            kwargs={"json": heavy, "headers": AUTH, "timeout": 300})
    post.start()
    with contextlib.suppress(AssertionError):  # a fast machine may finish before a poll
        until(driver, lambda d: any(r[BATCH] != "idle" for r in worker_rows(d)),
              "a batch in hand", timeout=20)
    driver.save_screenshot(path)
    post.join(300)
