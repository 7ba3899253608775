"""The web chat in a real browser: `dspark-run serve`'s page in headless Chromium (selenium) on the demo engine,
with an API key set. It streams a greedy reply equal to the engine's, marks accepted drafts, draws the target
steps and the figures, stops a reply mid-stream (the server cancels it), loads nothing from elsewhere, and saves
a screenshot (`DSPARK_SCREENSHOT=docs/web-chat.png` keeps it).

Needs Debian's `chromium` and `chromium-driver` and the `selenium` wheel; without them the tests skip, saying so,
except where `DSPARK_BROWSER_TESTS=required` (CI), where they fail."""

from __future__ import annotations

import os
import shutil
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from dspark_runtime import Engine, OrtBackend, SamplingParams  # noqa: E402
from dspark_runtime.cli import DEMO_PROMPT  # noqa: E402
from dspark_runtime.server import ServerOptions, create_app  # noqa: E402
from tests.test_server import running  # noqa: E402

KEY = "s3cret"
BROWSER, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


def _browser():
    missing = [name for name, found in (("chromium", BROWSER), ("chromium-driver", DRIVER)) if not found]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium (pip install selenium)")
    if missing:
        message = f"the browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("DSPARK_BROWSER_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=900,1000"):
        options.add_argument(argument)
    options.binary_location = BROWSER
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo engine (built into a fresh home) behind `dspark-run serve` with an API key, and a browser."""
    from dspark_export.cached_engines import demo_engine

    saved = os.environ.get("DSPARK_HOME")
    os.environ["DSPARK_HOME"] = str(tmp_path_factory.mktemp("home"))
    try:
        folder = demo_engine()
    finally:
        if saved is None:
            os.environ.pop("DSPARK_HOME")
        else:
            os.environ["DSPARK_HOME"] = saved
    driver = _browser()
    try:
        with Engine.load(folder, OrtBackend(threads=1)) as engine:
            for url in running(create_app(engine, ServerOptions("demo", api_key=KEY))):
                yield url, engine, driver
    finally:
        driver.quit()


def wait(driver, condition, seconds: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=0.05).until(condition)


def test_the_page_streams_a_greedy_reply_with_its_drafts_marked(served):
    from selenium.webdriver.common.by import By

    url, engine, driver = served
    driver.get(url + "/")
    wait(driver, lambda d: d.find_element(By.ID, "model").text == "demo")
    modes = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#mode option")]
    assert {"off", "async", f"fixed:{engine.gamma}"} <= set(modes)
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(DEMO_PROMPT + "\n")  # without the key first: the page asks for it
    wait(driver, lambda d: d.find_element(By.ID, "key-label").is_displayed())
    assert "API key" in driver.find_element(By.ID, "error").text
    driver.find_element(By.ID, "api-key").send_keys(KEY + "\t")
    driver.find_element(By.ID, "clear").click()
    prompt.send_keys(DEMO_PROMPT + "\n")
    stats = wait(driver, lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".assistant .stats")
                                    if "tokens/step" in e.text])[0]
    expected = engine.chat([{"role": "user", "content": DEMO_PROMPT}], SamplingParams(max_tokens=256, temperature=0))
    reply = driver.find_element(By.CSS_SELECTOR, ".assistant .reply")
    assert reply.text == expected.text.strip()  # the target's greedy reply, token for token
    drafted = driver.find_elements(By.CSS_SELECTOR, ".assistant .reply .draft")
    assert drafted and sum(len(e.text) for e in drafted) > len(reply.text) / 3  # most of it came from drafts
    assert float(stats.text.split(" tokens/step")[0].split("·")[-1]) > 2.0
    assert driver.find_elements(By.CSS_SELECTOR, ".rounds .cell.ok")  # the steps are drawn
    if os.environ.get("DSPARK_SCREENSHOT"):
        driver.save_screenshot(os.environ["DSPARK_SCREENSHOT"])
    loaded = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(name.startswith(url + "/") for name in loaded), loaded  # nothing from elsewhere
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE" and "401" not in entry["message"]]
    assert not errors, errors  # no script error, no Content-Security-Policy violation


def test_stop_cancels_the_reply_on_the_server(served):
    from selenium.webdriver.common.by import By

    url, engine, driver = served
    driver.get(url + "/")
    wait(driver, lambda d: d.find_element(By.ID, "model").text == "demo")
    driver.find_element(By.ID, "clear").click()
    driver.find_element(By.ID, "max-tokens").clear()
    driver.find_element(By.ID, "max-tokens").send_keys("4000")
    driver.find_element(By.ID, "mode").send_keys("off")  # one token a step: a long reply to stop
    before = engine.finish_reasons()["cancelled"]
    driver.find_element(By.ID, "prompt").send_keys("def binary_search(items, target):\n")
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".assistant .reply").text)
    driver.find_element(By.ID, "stop").click()
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".assistant .stats").text == "(stopped)")
    deadline = time.time() + 20
    while engine.finish_reasons()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.05)
    assert engine.finish_reasons()["cancelled"] == before + 1  # the server stopped it, not ran it to 4000 tokens
    assert driver.find_element(By.ID, "send").is_enabled() and not driver.find_element(By.ID, "stop").is_enabled()
