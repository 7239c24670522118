"""The operator console in a real browser: headless Chromium (Debian's chromium + chromium-driver,
driven by selenium) loads the page served by `oxygen_bringup --demo --console PORT`, sees the status
figures and the live pictures, asks a question and watches the reply stream in, and switches action
output off and on (checked over DDS: commands stop, then resume)."""
import os
import re
import shutil
import socket
import time

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from std_msgs.msg import Float64MultiArray

from ros_harness import private_domain, running_bringup, wait_until

CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,860"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    assert shutil.which("chromium") and shutil.which("chromedriver"), \
        "needs Debian's chromium and chromium-driver (scripts/setup.sh installs them as root)"
    port = free_port()
    domain = private_domain(41)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROME_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    with running_bringup(["--demo", "--console", str(port), "--status-period", "0"], domain, "console_test",
                         ready=f"console on http://127.0.0.1:{port}/") as (bringup, client):
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            driver.get(f"http://127.0.0.1:{port}/")
            yield driver, client, bringup
        finally:
            driver.quit()


def text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def test_status_pictures_chat_and_enable(console):
    driver, client, bringup = console
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    # Status figures and the lifecycle state come from the running engine.
    wait.until(lambda d: text(d, "lifecycle") == "active")
    wait.until(lambda d: text(d, "status-action_hz").endswith("Hz") and float(text(d, "status-action_hz")[:-3]) > 20)
    assert "/" in text(driver, "status-kv") and text(driver, "status-faults") == "0"
    assert re.fullmatch(r"touch the \w+ cube", text(driver, "prompt")), text(driver, "prompt")   # the sim's task
    # Live pictures: the overlay (448 px wide) and each camera with an image.
    width = "return document.getElementById(arguments[0]).naturalWidth"
    wait.until(lambda d: d.execute_script(width, "picture-overlay") == 448)
    wait.until(lambda d: d.find_elements(By.ID, "picture-base_0_rgb")
               and d.execute_script(width, "picture-base_0_rgb") == 64)     # the demo model's 64 px input

    # A question: the reply streams in (several partial updates), then is complete.
    driver.find_element(By.ID, "chat-input").send_keys("What is on the table?")
    driver.find_element(By.ID, "chat-send").click()
    reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".reply"))
    wait.until(lambda d: "done" in reply.get_attribute("class") or "failed" in reply.get_attribute("class"))
    assert "done" in reply.get_attribute("class"), reply.text
    assert int(reply.get_attribute("data-partials")) >= 2, "the reply did not stream"
    assert reply.get_attribute("title").split()[0].isdigit()       # "N tokens, frame F, T ms"
    if os.environ.get("OXYGEN_CONSOLE_SCREENSHOT"):
        driver.save_screenshot(os.environ["OXYGEN_CONSOLE_SCREENSHOT"])

    # The enable switch: off stops the commands (over DDS), on resumes them.
    actions = client.collect(Float64MultiArray, "/oxygen/action")
    assert wait_until(lambda: len(actions) > 10, 30)
    switch = driver.find_element(By.ID, "enable")
    assert switch.is_selected()
    switch.click()
    wait.until(lambda d: text(d, "enable-message") == "action output disabled")
    wait.until(lambda d: text(d, "action-state") == "disabled")
    off = time.monotonic()
    time.sleep(1.0)
    assert not [t for t, _ in list(actions) if t > off + 0.3], "commands published while disabled"
    switch.click()
    wait.until(lambda d: text(d, "enable-message") == "action output enabled")
    count = len(actions)
    assert wait_until(lambda: len(actions) > count + 10, 30), "commands did not resume"
    assert "Traceback" not in bringup.output()


def test_bad_requests_get_a_clear_error(console):
    import json
    import urllib.error
    import urllib.request

    driver, _, _ = console
    base = driver.current_url.rstrip("/")

    def post(path, body: bytes):
        try:
            with urllib.request.urlopen(urllib.request.Request(base + path, data=body, method="POST"), timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert post("/enable", b"not json") == (400, "expected a JSON body")
    assert post("/enable", b'{"enabled": "yes"}') == (400, "'enabled' must be true or false")
    assert post("/ask", b'{"text": "  "}') == (400, "'text' must be a non-empty string")
    assert post("/prompt", b"[1, 2]") == (400, "expected a JSON object")
    try:
        urllib.request.urlopen(base + "/picture/nope", timeout=10)
        raise AssertionError("no error for an unknown picture")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and "one of overlay, base_0_rgb" in e.read().decode()
    status = json.loads(urllib.request.urlopen(base + "/status", timeout=10).read())
    assert status["lifecycle"] == "active" and status["faults"] == 0
