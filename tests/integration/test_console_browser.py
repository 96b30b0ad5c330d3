"""The console in a real browser (Debian's chromium through chromium-driver, headless): log in,
filter the runs waiting for a person, answer a question in its form and watch the run succeed
without a reload, read its transcript, cancel a running run, find an injected bad input among
the dead letters; an operator continues a paused run and gives the verdict on a tool call of
unknown outcome, and the timeline says who did it, while a session opened with the API token is
offered no operator action.

Screenshots of each page go to $AGENTRUNS_SCREENSHOTS (docs/img keeps the current ones), else to
the test's temporary directory."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from agentruns.processors.ids import run_id_for_key
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.topics import INBOX, topic_name
from tests.support.api import GUARDED, OPERATOR, OPERATOR_TOKEN, REPORT, TOKEN, Stack
from tests.support.pipeline import SEARCH

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    driver_path = shutil.which("chromedriver") or CHROMEDRIVER
    if not (Path(CHROMIUM).exists() and Path(driver_path).exists()):
        pytest.fail(
            "chromium is missing: run `make chromium`"
            " (apt-get install -y chromium chromium-driver)",
            pytrace=False,
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1100")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("AGENTRUNS_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def _text(driver: WebDriver, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def _wait(driver: WebDriver) -> WebDriverWait[WebDriver]:
    """A wait that tolerates the live part of a page being swapped by its poller (an element
    found a moment ago may be gone)."""
    return WebDriverWait(
        driver,
        60,
        poll_frequency=0.2,
        ignored_exceptions=(StaleElementReferenceException, NoSuchElementException),
    )


def _log_in(driver: WebDriver, stack: Stack, token: str) -> None:
    """A new console session opened with ``token`` (the API's or an operator's)."""
    driver.get(f"{stack.url}/ui/login")
    driver.delete_all_cookies()  # the session before, if any
    driver.get(f"{stack.url}/ui/runs")
    assert driver.current_url.endswith("/ui/login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    _wait(driver).until(lambda d: d.current_url.endswith("/ui/runs"))


def _post_form(driver: WebDriver, wait: WebDriverWait[WebDriver], button_id: str) -> None:
    """Clicks a form's submit button and returns once its post and redirect loaded a new page."""
    driver.execute_script("window.formPage = 'old';")  # a page load drops it; a poll does not
    driver.find_element(By.ID, button_id).click()
    wait.until(lambda d: d.execute_script("return window.formPage;") is None)
    wait.until(lambda d: d.find_elements(By.ID, "run-status"))


def test_a_person_answers_cancels_and_reads_dead_letters_in_the_console(
    stack: Stack, browser: WebDriver, shots: Path
) -> None:
    wait = _wait(browser)
    approval = stack.submit(
        f"console-approve-{uuid.uuid4().hex}",
        goal="update the pricing page once a person approves",
        tools=[GUARDED.model_dump()],
        policy={"approval_required": ["write"]},
    )
    long_key = f"console-long-{uuid.uuid4().hex}"
    stack.double.async_runs.add(run_id_for_key(long_key))
    running = stack.submit(
        long_key,
        goal="write the quarterly report",
        tools=[SEARCH.model_dump(), REPORT.model_dump()],
    )
    done = stack.submit(f"console-plain-{uuid.uuid4().hex}", goal="find three documents")
    stack.wait_status(approval, "WAITING_USER")
    stack.wait_status(running, "WAITING_TOOL")
    stack.wait_status(done, "SUCCEEDED")

    _log_in(browser, stack, TOKEN)
    assert done in browser.page_source
    browser.save_screenshot(str(shots / "console-runs.png"))

    Select(browser.find_element(By.ID, "f-waiting")).select_by_value("user")
    browser.find_element(By.ID, "f-apply").click()
    wait.until(lambda d: "waiting=user" in d.current_url)
    listed = wait.until(
        lambda d: {
            e.get_attribute("data-run") for e in d.find_elements(By.CSS_SELECTOR, "tr[data-run]")
        }
    )
    assert approval in listed and done not in listed and running not in listed
    browser.save_screenshot(str(shots / "console-waiting-for-user.png"))

    browser.find_element(By.LINK_TEXT, approval).click()
    wait.until(lambda d: _text(d, "run-status") == "WAITING_USER")
    browser.save_screenshot(str(shots / "console-question.png"))
    Select(browser.find_element(By.ID, "field-approved")).select_by_value("true")
    _post_form(browser, wait, "answer")
    wait.until(lambda d: d.find_elements(By.ID, "run-status") and "/reply" not in d.current_url)
    # marks this page load: a reload would drop the mark
    browser.execute_script("window.consoleMark = 'kept';")
    wait.until(lambda d: _text(d, "run-status") == "SUCCEEDED")
    assert browser.execute_script("return window.consoleMark;") == "kept"
    assert browser.find_elements(By.ID, "result") and not browser.find_elements(By.ID, "reply")
    browser.set_window_size(1400, 2400)  # the whole run: timeline, effects, state diagram
    browser.save_screenshot(str(shots / "console-run.png"))
    browser.set_window_size(1400, 1100)

    # the same run as a conversation: the goal, each answer, the guarded call and the approval
    browser.find_element(By.ID, "transcript-link").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "section.step"))
    first = browser.find_element(By.ID, "step-1")
    assert "update the pricing page" in first.text and "The model answered" in first.text
    asked = browser.find_elements(By.CSS_SELECTOR, "section.step .exchange")
    assert asked and "approval" in asked[0].text and "true" in asked[0].text
    calls = browser.find_elements(By.CSS_SELECTOR, "tr.tool-call")
    assert any(GUARDED.name in c.text and "SUCCEEDED" in c.text for c in calls)
    browser.set_window_size(1400, 1600)
    browser.save_screenshot(str(shots / "console-transcript.png"))
    browser.set_window_size(1400, 1100)

    browser.get(f"{stack.url}/ui/runs/{running}")
    wait.until(lambda d: _text(d, "run-status") == "WAITING_TOOL")
    _post_form(browser, wait, "cancel-button")
    wait.until(lambda d: d.find_elements(By.ID, "run-status"))
    browser.execute_script("window.consoleMark = 'kept';")
    wait.until(lambda d: _text(d, "run-status") == "CANCELLED")
    assert browser.execute_script("return window.consoleMark;") == "kept"
    assert stack.run(running)["status"] == "CANCELLED"

    marker = f"not-a-record-{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": stack.bootstrap, **client_settings()})
    producer.produce(
        topic_name(INBOX, stack.prefix), key=b"bad", value=marker.encode(), partition=1
    )
    assert producer.flush(30) == 0

    _log_in(browser, stack, OPERATOR_TOKEN)  # the dead letters are every tenant's: an admin's

    def dead_lettered(d: WebDriver) -> bool:
        d.get(f"{stack.url}/ui/dead-letters")
        return marker in d.page_source

    wait.until(dead_lettered)
    browser.find_element(By.CSS_SELECTOR, "#dead-letters details summary").click()
    browser.save_screenshot(str(shots / "console-dead-letters.png"))


def _timeline(driver: WebDriver, kind: str) -> list[str]:
    """The text of the timeline's rows of events of ``kind``."""
    rows = [str(row.text) for row in driver.find_elements(By.CSS_SELECTOR, "#timeline tr")]
    return [row for row in rows if kind in row.split()]


def test_an_operator_resolves_paused_runs_in_the_console(
    stack: Stack, browser: WebDriver, shots: Path
) -> None:
    wait = _wait(browser)
    stalled_key = f"console-stalled-{uuid.uuid4().hex}"
    stalled = run_id_for_key(stalled_key)
    stack.double.stalled_runs.add(stalled)
    stack.submit(stalled_key, loop={"max_steps_without_progress": 1})
    unknown_key = f"console-unknown-{uuid.uuid4().hex}"
    unknown = run_id_for_key(unknown_key)
    stack.double.undeterminable_runs.add(unknown)
    stack.submit(unknown_key)
    stack.wait_status(stalled, "PAUSED")
    stack.wait_status(unknown, "PAUSED")
    actor = f"operator:{OPERATOR}"

    # the API token's session: the run's page offers no operator action
    _log_in(browser, stack, TOKEN)
    for run_id in (stalled, unknown):
        browser.get(f"{stack.url}/ui/runs/{run_id}")
        wait.until(lambda d: _text(d, "run-status") == "PAUSED")
        assert not browser.find_elements(By.ID, "operator")
        assert not browser.find_elements(By.ID, "resolve")
        assert "Operator actions" not in browser.page_source

    # an operator's session: continue the run that made no progress
    _log_in(browser, stack, OPERATOR_TOKEN)
    browser.get(f"{stack.url}/ui/runs/{stalled}")
    wait.until(lambda d: _text(d, "run-status") == "PAUSED")
    assert f"as {OPERATOR}" in _text(browser, "operator")
    choices = Select(browser.find_element(By.ID, "resolve-action"))
    assert [o.get_attribute("value") for o in choices.options] == ["continue", "fail", "succeed"]
    assert not browser.find_elements(By.ID, "resolve-outcome")  # no call waits for a verdict
    choices.select_by_value("continue")
    browser.find_element(By.ID, "resolve-reason").send_keys("the index was rebuilt")
    browser.save_screenshot(str(shots / "console-operator-continue.png"))
    _post_form(browser, wait, "resolve-button")
    assert not browser.find_elements(By.ID, "error")
    # the page follows the run: reopened by the operator, a new step, paused again
    wait.until(lambda d: any(f"by {actor}" in row for row in _timeline(d, "RunReopened")))
    wait.until(lambda d: _text(d, "run-status") == "PAUSED" and stack.run(stalled)["resolution"])
    assert stack.run(stalled)["resolution"] == 1

    # the run paused on a tool call nobody could look up: the operator's verdict
    browser.get(f"{stack.url}/ui/runs/{unknown}")
    wait.until(lambda d: _text(d, "run-status") == "PAUSED")
    choices = Select(browser.find_element(By.ID, "resolve-action"))
    assert [o.get_attribute("value") for o in choices.options] == ["reconcile", "fail", "succeed"]
    choices.select_by_value("reconcile")
    Select(browser.find_element(By.ID, "resolve-outcome")).select_by_value("found_succeeded")
    browser.find_element(By.ID, "resolve-reason").send_keys("found it in the tracker")
    browser.save_screenshot(str(shots / "console-operator-verdict.png"))
    _post_form(browser, wait, "resolve-button")
    assert not browser.find_elements(By.ID, "error")
    browser.execute_script("window.consoleMark = 'kept';")
    wait.until(lambda d: _text(d, "run-status") == "SUCCEEDED")
    assert browser.execute_script("return window.consoleMark;") == "kept"  # no reload
    verdicts = _timeline(browser, "ReconcileCompleted")
    assert any(f"by {actor}" in row for row in verdicts), verdicts
    # an ended run: the operator may reopen it or correct its status, no longer reconcile
    assert browser.find_elements(By.ID, "reopen")
    choices = Select(browser.find_element(By.ID, "resolve-action"))
    assert [o.get_attribute("value") for o in choices.options] == ["fail"]
    browser.set_window_size(1400, 2400)
    browser.save_screenshot(str(shots / "console-operator-run.png"))
    browser.set_window_size(1400, 1100)
