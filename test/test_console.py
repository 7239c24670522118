"""The operator console in a real browser: headless Chromium (Debian's chromium + chromium-driver,
driven by selenium) loads the page served by `oxygen_bringup --demo --console PORT` with the token the
process printed, sees the status figures and the live pictures, asks a question and watches the reply
stream in, and switches action output off and on (checked over DDS: commands stop, then resume).
Then the console as an attacker and a careless operator meet it: no token, a foreign Host (DNS
rebinding), a foreign Origin, a page on another origin in the same browser, a "simple" text/plain
POST, a prompt over the robot's limit, a bad max_tokens, slow request heads and thousands of idle
connections (issue #21).

Waits are event-driven (WebDriverWait, wait_until) with generous bounds; the streaming check is made
deterministic by one decode step per frame (decode_budget fixed), not by timing."""
import http.client
import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from std_msgs.msg import Float64MultiArray, String

from oxygen_interfaces.srv import Converse

from ros_harness import output_stops, private_domain, running_bringup, wait_until

CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,860"]
MAX_CONNECTIONS = 16
HEAD_TIMEOUT_S = 2.0
PARAMS = f"""
oxygen_engine:
  ros__parameters:
    decode_budget: fixed        # one token per frame: a reply streams in several partials on any load
    tokens_per_frame: 1
oxygen_console:
  ros__parameters:
    max_connections: {MAX_CONNECTIONS}
    request_head_timeout_s: {HEAD_TIMEOUT_S}
oxygen_sim_robot:
  ros__parameters:
    enable_service: ''          # the output stays on through the resets: only these tests switch it
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Console:
    def __init__(self, driver, client, bringup, port: int, token: str):
        self.driver, self.client, self.bringup, self.port, self.token = driver, client, bringup, port, token
        self.base = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                token: bool = True) -> tuple[int, str]:
        """(status, body text) of a raw HTTP request (http.client sends exactly the headers given)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        headers = dict(headers or {})
        if token:
            headers.setdefault("X-Oxygen-Token", self.token)
        if body is not None:
            headers.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.read().decode(errors="replace")
        finally:
            conn.close()

    def status(self) -> dict:
        code, text = self.request("GET", "/status")
        assert code == 200, (code, text)
        return json.loads(text)


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    assert shutil.which("chromium") and shutil.which("chromedriver"), \
        "needs Debian's chromium and chromium-driver (scripts/test.sh installs them as root)"
    port = free_port()
    domain = private_domain(41)
    params = tmp_path_factory.mktemp("params") / "console.yaml"
    params.write_text(PARAMS)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROME_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    with running_bringup(["--demo", "--console", str(port), "--params-file", str(params), "--status-period", "0"],
                         domain, "console_test", ready=f"console on http://127.0.0.1:{port}/") as (bringup, client):
        # Like Jupyter: the URL with the token is printed at start (stdout only, not on /rosout).
        assert bringup.wait_for_line(f"http://127.0.0.1:{port}/?token=", 10), bringup.output()
        token = re.search(rf"http://127\.0\.0\.1:{port}/\?token=([\w-]+)", bringup.output()).group(1)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            driver.get(f"http://127.0.0.1:{port}/?token={token}")
            yield Console(driver, client, bringup, port, token)
        finally:
            driver.quit()


def text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def test_status_pictures_chat_and_enable(console):
    driver, client, bringup = console.driver, console.client, console.bringup
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    # Status figures and the lifecycle state come from the running engine.
    wait.until(lambda d: text(d, "lifecycle") == "active")
    wait.until(lambda d: text(d, "status-action_hz").endswith("Hz") and float(text(d, "status-action_hz")[:-3]) > 0)
    assert "/" in text(driver, "status-kv") and text(driver, "status-faults") == "0"
    wait.until(lambda d: re.fullmatch(r"touch the \w+ cube", text(d, "prompt")))   # the sim's task
    # Live pictures: the overlay (448 px wide) and each camera with an image.
    width = "return document.getElementById(arguments[0]).naturalWidth"
    wait.until(lambda d: d.execute_script(width, "picture-overlay") == 448)
    wait.until(lambda d: d.find_elements(By.ID, "picture-base_0_rgb")
               and d.execute_script(width, "picture-base_0_rgb") == 64)     # the demo model's 64 px input

    # A question: the reply streams in (several partial updates), then is complete. No session unless the
    # operator starts one: the demo model is single-turn.
    driver.find_element(By.ID, "chat-input").send_keys("How many cubes are there?")
    driver.find_element(By.ID, "chat-send").click()
    reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".reply"))
    wait.until(lambda d: "done" in reply.get_attribute("class") or "failed" in reply.get_attribute("class"))
    assert "done" in reply.get_attribute("class"), reply.text
    assert int(reply.get_attribute("data-partials")) >= 2, "the reply did not stream"
    assert reply.get_attribute("title").split()[0].isdigit()       # "N tokens, frame F, T ms"
    assert reply.get_attribute("data-session") == ""
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
    assert output_stops(actions), "commands published while disabled"
    switch.click()
    wait.until(lambda d: text(d, "enable-message") == "action output enabled")
    count = len(actions)
    assert wait_until(lambda: len(actions) > count + 10, 30), "commands did not resume"
    assert "Traceback" not in bringup.output()


def test_sessions_are_started_by_the_operator(console):
    driver = console.driver
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    wait.until(lambda d: text(d, "lifecycle") == "active")
    driver.find_element(By.ID, "session-start").click()
    session = wait.until(lambda d: text(d, "session-id"))
    assert session.startswith("console-")
    for question in ("How many cubes are there?", "Is there a red cube?"):
        before = len(driver.find_elements(By.CSS_SELECTOR, ".reply"))
        driver.find_element(By.ID, "chat-input").send_keys(question)
        driver.find_element(By.ID, "chat-send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".reply")) > before
                   and "streaming" not in d.find_elements(By.CSS_SELECTOR, ".reply")[-1].get_attribute("class"))
        assert driver.find_elements(By.CSS_SELECTOR, ".reply")[-1].get_attribute("data-session") == session
    driver.find_element(By.ID, "session-end").click()
    wait.until(lambda d: text(d, "session-id") == "")


def test_bad_requests_get_a_clear_error(console):
    post = lambda path, body: console.request("POST", path, body)  # noqa: E731
    assert post("/enable", b"not json") == (400, "expected a JSON body")
    assert post("/enable", b'{"enabled": "yes"}') == (400, "'enabled' must be true or false")
    assert post("/ask", b'{"text": "  "}') == (400, "'text' must be a non-empty string")
    assert post("/prompt", b"[1, 2]") == (400, "expected a JSON object")
    code, message = post("/ask", b'{"text": "How many cubes are there?", "max_tokens": "abc"}')
    assert code == 400 and "max_tokens" in message and "'abc'" in message, (code, message)
    code, message = post("/ask", b'{"text": "hi", "session_id": 7}')
    assert code == 400 and "session_id" in message, (code, message)
    # The robot takes at most max_prompt_chars (500): the console says so instead of "success".
    prompts = console.client.collect(String, "/oxygen/prompt")
    code, message = post("/prompt", json.dumps({"text": "touch the red cube " + "x" * 600}).encode())
    assert code == 400 and "500" in message, (code, message)
    code, message = console.request("GET", "/picture/nope")
    assert code == 404 and "one of overlay, caption, base_0_rgb" in message
    time.sleep(1.0)          # what was published would have arrived
    assert not [m for _, m in list(prompts) if len(m.data) > 500]
    status = console.status()
    assert status["lifecycle"] == "active" and status["faults"] == 0


ATTACK_PROMPT = "touch the purple cube"      # no cube of the demo is purple: only an attacker says this


def test_requests_without_the_token_or_from_elsewhere_are_refused(console):
    assert wait_until(lambda: console.status()["enabled"], 30)
    prompts = console.client.collect(String, "/oxygen/prompt")
    change = json.dumps({"enabled": False}).encode()
    # No token, a wrong one: nothing is served, not even the page.
    for path in ("/", "/status", "/picture/overlay", "/picture/base_0_rgb"):
        assert console.request("GET", path, token=False)[0] == 401, path
        assert console.request("GET", path, headers={"X-Oxygen-Token": "guess"})[0] == 401, path
    assert console.request("POST", "/enable", change, token=False)[0] == 401
    # DNS rebinding: the browser talks to 127.0.0.1 but says Host: attacker.example.
    for path in ("/status", "/picture/base_0_rgb"):
        code, message = console.request("GET", path, headers={"Host": f"attacker.example:{console.port}"})
        assert code == 403 and "Host" in message, (code, message)
    # Another origin, even with the token (a script that stole it cannot use it from a page).
    code, message = console.request("POST", "/enable", change, headers={"Origin": "http://attacker.example"})
    assert code == 403 and "Origin" in message, (code, message)
    code, _ = console.request("POST", "/enable", change, headers={"Sec-Fetch-Site": "cross-site"})
    assert code == 403
    # A CORS "simple" request (text/plain needs no preflight): changes take JSON only.
    code, message = console.request("POST", "/prompt", json.dumps({"text": ATTACK_PROMPT}).encode(),
                                    headers={"Content-Type": "text/plain"})
    assert code == 415 and "application/json" in message, (code, message)
    assert console.request("POST", "/prompt", json.dumps({"text": ATTACK_PROMPT}).encode(), token=False)[0] == 401
    time.sleep(1.0)          # what was published would have arrived
    assert console.status()["enabled"]
    assert ATTACK_PROMPT not in [m.data for _, m in list(prompts)]


def test_a_page_on_another_origin_cannot_switch_the_robot(console):
    """The attack as a browser runs it: the operator's Chromium (the console open in it) visits a page on
    another origin that posts to the console without a preflight."""
    attack = f"""<!doctype html><script>
      for (const [path, body] of [["/enable", '{{"enabled": false}}'], ["/prompt", '{{"text": "{ATTACK_PROMPT}"}}']])
        fetch("http://127.0.0.1:{console.port}" + path, {{method: "POST", mode: "no-cors", credentials: "include",
              headers: {{"Content-Type": "text/plain"}}, body}}).catch(() => {{}});
      document.title = "sent";
    </script>"""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(attack.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.2", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prompts = console.client.collect(String, "/oxygen/prompt")
    assert console.status()["enabled"]
    refused_before = refused_requests(console)
    driver = console.driver
    try:
        driver.get(f"http://127.0.0.2:{server.server_address[1]}/")
        WebDriverWait(driver, 30).until(lambda d: d.title == "sent")
        time.sleep(2.0)      # the requests went out (no-cors: the page cannot see their answer)
    finally:
        server.shutdown()
        driver.get(f"{console.base}/?token={console.token}")
    assert console.status()["enabled"]
    assert ATTACK_PROMPT not in [m.data for _, m in list(prompts)]
    # The two requests did reach the console, which refused them.
    assert wait_until(lambda: refused_requests(console) >= refused_before + 2, 10)


def refused_requests(console) -> int:
    """The console's count of refused requests, from its /diagnostics status (published every second)."""
    from diagnostic_msgs.msg import DiagnosticArray

    seen = []
    sub = console.client.node.create_subscription(
        DiagnosticArray, "/diagnostics",
        lambda m: seen.extend(int(kv.value) for st in m.status if st.name == "oxygen_ros: console"
                              for kv in st.values if kv.key == "refused_requests"), 10)
    try:
        assert wait_until(lambda: seen, 10), "no console diagnostics"
        return seen[-1]
    finally:
        console.client.node.destroy_subscription(sub)


def test_slow_heads_and_idle_connections_are_bounded(console):
    pid = console.bringup.proc.pid
    fds = lambda: len(os.listdir(f"/proc/{pid}/fd"))  # noqa: E731
    baseline = fds()
    # A head that never ends (slowloris) is closed after request_head_timeout_s.
    slow = socket.create_connection(("127.0.0.1", console.port))
    slow.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    slow.settimeout(HEAD_TIMEOUT_S * 10)
    opened = time.monotonic()
    assert slow.recv(1024) == b"", "the incomplete request was answered"
    assert time.monotonic() - opened >= HEAD_TIMEOUT_S * 0.9
    slow.close()
    # 500 idle connections: at most max_connections are kept; the process does not run out of descriptors.
    idle = []
    for _ in range(500):
        try:
            idle.append(socket.create_connection(("127.0.0.1", console.port), timeout=5))
        except OSError:
            pass
    time.sleep(0.5)
    assert fds() < baseline + MAX_CONNECTIONS + 20, (baseline, fds())
    # When the idle ones are timed out, the console answers again.
    assert wait_until(lambda: fds() < baseline + 5, HEAD_TIMEOUT_S * 10), (baseline, fds())
    for s in idle:
        s.close()
    assert console.status()["lifecycle"] == "active"


# Every <img> the page shows has a picture: one still waiting (none loaded yet, or the server's 204 "no picture
# yet") is hidden behind its tile's waiting text, never a broken-image icon (shown: no source, or one that
# failed to load).
BROKEN_PICTURES = """return [...document.images].filter(i => i.offsetParent !== null
                                                      && (!i.getAttribute("src") || (i.complete && i.naturalWidth === 0)))
                               .map(i => i.id)"""


def test_first_paint_shows_no_broken_picture_and_asks_for_no_favicon(console):
    driver = console.driver
    driver.get(f"{console.base}/?token={console.token}")
    broken = set()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:           # from the first paint until the pictures are in
        broken.update(driver.execute_script(BROKEN_PICTURES))
        time.sleep(0.05)
    assert not broken, f"broken pictures shown: {broken}"
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    wait.until(lambda d: "loaded" in d.find_element(By.ID, "tile-base_0_rgb").get_attribute("class"))
    # Each camera tile names its slot and the frame it shows; the debug picture says what it is.
    assert re.fullmatch(r"base_0_rgb\nframe \d+", text(driver, "tile-base_0_rgb"))
    assert text(driver, "tile-overlay").startswith("debug picture")
    # A browser asks every page load for /favicon.ico, without the token: answered 404 before the checks,
    # not refused (a refusal is a warning in the log, at every page load).
    assert console.request("GET", "/favicon.ico", token=False)[0] == 404
    time.sleep(1.0)
    assert "favicon" not in console.bringup.output(), console.bringup.output()


def test_the_caption_is_shown_beside_the_frame_it_describes(console):
    driver = console.driver
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    assert wait_until(lambda: console.status()["caption"] is not None, 60), "no caption"
    caption = console.status()["caption"]
    assert caption["picture"], caption
    wait.until(lambda d: text(d, "caption-frame").startswith("frame "))
    frame = int(text(driver, "caption-frame").split()[1])
    # The page shows a caption with its own frame's index and picture (the 64 px camera image of that frame).
    wait.until(lambda d: d.execute_script("return document.getElementById('picture-caption').naturalWidth") == 64)
    assert text(driver, "caption-text") and "(the picture beside it)" in text(driver, "caption-frame")
    assert frame <= console.status()["frame_index"]
    code, _ = console.request("GET", "/picture/caption")
    assert code == 200


def test_no_connection_dims_what_is_stale_and_the_stop_is_quiet(console):
    """Runs last: it stops the bringup. A question still being answered when the process stops gets its
    refusal, logged at info (an orderly stop is no fault); the page then says it has no connection."""
    driver, client = console.driver, console.client
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    driver.get(f"{console.base}/?token={console.token}")
    wait.until(lambda d: text(d, "lifecycle") == "active")
    cli = client.node.create_client(Converse, "/oxygen/converse")
    assert cli.wait_for_service(20)
    # One token per frame at the camera's 15 Hz (PARAMS): the description (~12 tokens) takes ~0.8 s, the
    # stop sent as soon as the engine has the question comes within ~0.2 s.
    pending = cli.call_async(Converse.Request(text="Describe the scene.", max_tokens=200, timeout_s=120.0))
    assert wait_until(lambda: sum(console.status()[k] for k in ("active_requests", "queued_requests")) >= 1, 30)
    assert console.bringup.stop() == 0
    # The refusal reaches the caller when the services executor sends it before the process exits: usually,
    # not always (seen missing once in three clean runs); the process's own account below always holds.
    if wait_until(pending.done, 20):
        assert not pending.result().success and "shutting down" in pending.result().error
    out = console.bringup.output()
    assert "conversation request ended" in out and "shutting down" in out and "oxygen_bringup: stopped" in out, out
    assert not [line for line in out.splitlines() if "[WARN]" in line and "shutting down" in line], out
    # The page: a banner, the figures dimmed but kept, the state unknown, the switch out of use.
    wait.until(lambda d: "offline" in d.find_element(By.TAG_NAME, "body").get_attribute("class"))
    assert text(driver, "lifecycle") == "no connection" and text(driver, "action-state") == "unknown"
    assert text(driver, "offline").startswith("no connection to the robot's process since")
    assert not driver.find_element(By.ID, "enable").is_enabled()
    assert float(driver.execute_script(
        "return getComputedStyle(document.getElementById('figures')).opacity")) < 0.5
    assert text(driver, "status-faults") == "0"          # the last figures received, still there
    assert "Traceback" not in out


HIERARCHY_PARAMS = """
oxygen_engine:
  ros__parameters:
    hierarchy: joint            # the demo model serves the joint recipe (its texts are untrained: any text)
    subtask_period_s: 0.5
oxygen_sim_robot:
  ros__parameters:
    prompt_topic: sim/episode_task   # the episodes' tasks go elsewhere: the robot's task is the test's, fixed
"""
TASK = "put the cubes in a row"


def test_the_hierarchys_language_is_shown_live_and_an_interjection_is_answered(tmp_path):
    """The page shows the robot's subtask (what /oxygen/subtask publishes, with its frame) as it changes;
    an interjection typed on the page goes through /oxygen/interject and its plan appears on the page."""
    from oxygen_interfaces.msg import LanguageUpdate
    from oxygen_ros.nodes.language import qos_for

    port = free_port()
    params = tmp_path / "hierarchy.yaml"
    params.write_text(HIERARCHY_PARAMS)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROME_FLAGS + [f"--user-data-dir={tmp_path / 'chromium'}"]:
        options.add_argument(flag)
    with running_bringup(["--demo", "--console", str(port), "--params-file", str(params), "--status-period", "0"],
                         private_domain(42), "console_hierarchy_test",
                         ready=f"console on http://127.0.0.1:{port}/") as (bringup, client):
        assert bringup.wait_for_line(f"http://127.0.0.1:{port}/?token=", 10), bringup.output()
        token = re.search(rf"http://127\.0\.0\.1:{port}/\?token=([\w-]+)", bringup.output()).group(1)
        subtasks = client.collect(LanguageUpdate, "/oxygen/subtask", qos_for("subtask"))
        plans = client.collect(LanguageUpdate, "/oxygen/plan", qos_for("plan"))
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            driver.get(f"http://127.0.0.1:{port}/?token={token}")
            wait = WebDriverWait(driver, 90, poll_frequency=0.2)
            wait.until(lambda d: text(d, "lifecycle") == "active")
            prompts = client.node.create_publisher(String, "/oxygen/prompt", 10)

            def task_shown(d) -> bool:        # the robot's task is the test's (published until the page shows it)
                prompts.publish(String(data=TASK))
                return text(d, "lang-task") == TASK
            wait.until(task_shown)
            assert wait_until(lambda: subtasks, 90), bringup.output()[-3000:]
            published = {(m.text, m.frame_index) for _, m in subtasks}
            # What the page shows is one of the published subtasks, with the frame it came from.
            wait.until(lambda d: (text(d, "lang-subtask"), int(text(d, "lang-subtask-frame").split()[-1] or -1)
                                  if text(d, "lang-subtask-frame") else None) in
                       ({(m.text, m.frame_index) for _, m in subtasks} | published))
            driver.find_element(By.ID, "interject-input").send_keys("first the red cube")
            driver.find_element(By.CSS_SELECTOR, "#interject-form button").click()
            wait.until(lambda d: text(d, "interject-message").startswith(("answered from frame", "(")))
            message = text(driver, "interject-message")
            answered = re.match(r'answered from frame (\d+): (?:plan "(.*)"|no plan)', message)
            assert answered, message
            frame, plan = int(answered.group(1)), answered.group(2)
            if plan:      # published (latched) and shown with its frame
                assert wait_until(lambda: plans, 30), (message, bringup.output()[-2000:])
                assert (plans[-1][1].text, plans[-1][1].frame_index) == (plan, frame)
                wait.until(lambda d: text(d, "lang-plan-frame") == f"frame {frame}")
                assert text(driver, "lang-plan") == plan and text(driver, "lang-task") == TASK
            else:         # the untrained demo may answer nothing: no plan published, none shown
                time.sleep(1.0)
                assert not plans and text(driver, "lang-plan") == "(none yet)"
        finally:
            driver.quit()
        assert "Traceback" not in bringup.output()
