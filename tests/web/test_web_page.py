"""The web page at `/` (appliance/web/) in a real browser: headless Chromium (Debian's chromium and chromium-driver,
which `make test` installs) driven by selenium against a real `appliance serve` started with an API key file and
TLS (a self-signed certificate the browser is told to accept), so the page runs as it does on a guarded box: a
URL that named another scheme or origin would be blocked there (mixed content, the CSP) and show as a console
error. Plain HTTP adds no case: on 127.0.0.1 it is a secure context too, and the page uses nothing else.

What is shown: the page loads with no console error; the status shows the model (state, export, precision, device)
and the CPU's ISA; a chat reply streams in (the answer's text grows several times before the reply ends) and ends
with its token counts and speed; a JSON-schema reply is JSON of that schema; the tokens/s plot gets positive points
after the reply; a wrong key shows a clear message and a right one works, and the key never appears in a URL. The
page itself is public and forbids other origins (CSP). A screenshot of each view is saved under the directory
the run prints (`APPLIANCE_ARTIFACTS_DIR`, else pytest's temporary directory).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import jsonschema
import pytest
import requests

from appliance.testing import browser
from tests.e2e.test_exposure import TlsServer, make_cert
from tests.helpers import ours_missing

KEY = "web-page-test-key-0123456789"
# as tests/openai_api/test_tools_e2e.py's: a thought, then an answer
THOUGHT = r"<think>[a-z ]{1,24}</think>[A-Za-z ]{1,24}"
OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
WAIT = 120  # seconds: a loaded 2-core box may take long for the first reply


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    """One server with an API key and TLS for the module (1 worker: the browser's requests are few); it parses
    `<think>` thoughts (only an output that starts with one has any, so the other replies are plain answers)."""
    folder = tmp_path_factory.mktemp("web")
    keys = folder / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    cert, key = make_cert(folder)
    tls = ["--tls-certfile", str(cert), "--tls-keyfile", str(key)]
    args = ["--workers", "1", "--api-key-file", str(keys), "--reasoning-parser", "think", *tls]
    with TlsServer(model_dir, folder / "serve.log", cert, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def artifacts(request, tmp_path_factory) -> Path:
    folder = Path(os.environ.get("APPLIANCE_ARTIFACTS_DIR") or tmp_path_factory.mktemp("web-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nweb page screenshots: {folder}")
    return folder


@pytest.fixture
def chromium():
    why = browser.missing()
    if why:  # `make browser` installs them where it can, and says so where it cannot
        ours_missing(why)
    with browser.Browser(flags=("--ignore-certificate-errors",)) as driver:
        yield driver


def wait_for(driver, script: str, what: str, timeout: float = WAIT):
    """Until the JavaScript expression `script` is truthy in the page; its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script("return " + script)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} ({script})")


def console_errors(driver, allowed: re.Pattern | None = None) -> list[dict]:
    return [
        e
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and not (allowed and allowed.search(e["message"]))
    ]


def text(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById({element_id!r}).textContent")


def test_the_page_is_public_and_forbids_other_origins(keyed):
    page = requests.get(keyed.base + "/", verify=keyed.cert, timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert "<script>" not in page.text and "style=" not in page.text  # nothing inline: the CSP would block it
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        asset = requests.get(f"{keyed.base}/ui/{name}", verify=keyed.cert, timeout=30)
        assert asset.status_code == 200 and asset.headers["Content-Type"].startswith(kind), name
        assert "Content-Security-Policy" in asset.headers
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", asset.text), f"{name} names another origin"
    # the data behind it needs the key
    assert requests.get(keyed.base + "/v1/status", verify=keyed.cert, timeout=30).status_code == 401
    assert requests.get(keyed.base + "/ui/other.js", verify=keyed.cert, timeout=30).status_code in (401, 404)
    authorized = {"Authorization": f"Bearer {KEY}"}
    status = requests.get(keyed.base + "/v1/status", headers=authorized, verify=keyed.cert, timeout=30).json()
    jsonschema.validate(status, json.loads(OPENAPI.read_text())["components"]["schemas"]["Status"])
    (model,) = status["models"]
    assert model["state"] == "ready" and model["device"] == "CPU" and model["backend"] == "openvino"
    assert model["weight_format"] and status["version"] and status["cpu_isa"]["name"]
    assert 0 < time.time() - status["started"] < 3600


def test_status_plots_and_a_streamed_chat(keyed, chromium, artifacts, model_name):
    driver = chromium
    driver.get(keyed.base + "/ui/favicon.svg")  # the origin, without the page: its key first, as the dialog stores it
    driver.execute_script(f"sessionStorage.setItem('appliance.apiKey', {KEY!r})")
    driver.get(keyed.base + "/#status")
    model = model_name

    # status
    wait_for(driver, f"document.querySelector('#models tbody').textContent.includes({model!r})", "the model row")
    row = driver.execute_script("return [...document.querySelectorAll('#models tbody td')].map((td) => td.textContent)")
    assert row[:2] == [model, "ready"] and row[2] == "openvino" and row[4] == "CPU", row
    wait_for(driver, "document.getElementById('s-uptime').textContent.includes('s')", "the uptime")
    assert text(driver, "s-isa") not in ("", "–") and text(driver, "s-version") not in ("", "–")
    assert "ready" in text(driver, "health")
    driver.save_screenshot(str(artifacts / "web-status.png"))

    # the plots' p50/p99: Prometheus' histogram_quantile over the buckets' difference between two polls
    q = (  # "inf" for +Inf (JSON has no infinity)
        "const b = (x) => x.map(([le, c]) => [le === 'inf' ? Infinity : le, c]);"
        "return quantile(arguments[0], b(arguments[1]), b(arguments[2]))"
    )
    inf = "inf"
    then = [[0.1, 5], [0.2, 5], [0.5, 5], [inf, 5]]
    now = [[0.1, 5], [0.2, 15], [0.5, 15], [inf, 15]]  # ten more, all in (0.1, 0.2]
    assert driver.execute_script(q, 0.5, now, then) == pytest.approx(0.15)
    assert driver.execute_script(q, 0.99, now, then) == pytest.approx(0.199)
    assert driver.execute_script(q, 0.5, then, then) is None  # nothing new: no point
    assert driver.execute_script(q, 0.5, [[0.1, 0], [inf, 4]], []) == pytest.approx(0.1)  # +Inf: its lower bound
    parsed = driver.execute_script(
        "return parseMetrics(arguments[0])",
        '# HELP x y\nappliance_queue_depth 2.0\nappliance_queue_depth{model="a \\"b\\""} 1.0\n',
    )
    assert parsed["appliance_queue_depth"][1] == {"labels": {"model": 'a \\"b\\"'}, "value": 1.0}

    # plots: samples accumulate every 2 s; nothing generated yet in this page's window
    driver.get(keyed.base + "/#plots")
    wait_for(driver, "Number(document.getElementById('plot-tps').dataset.points || 0) >= 2", "two samples")
    positive_before = int(driver.execute_script("return document.getElementById('plot-tps').dataset.positive"))

    # chat: the answer's text is watched as it changes; it must grow several times before the reply ends
    driver.get(keyed.base + "/#chat")
    wait_for(driver, f"document.getElementById('c-model').value === {model!r}", "the model list")
    driver.execute_script(
        """
        window.lengths = [];
        new MutationObserver(() => {
          const answers = document.querySelectorAll('#transcript .msg.assistant .text');
          const last = answers[answers.length - 1];
          const done = document.querySelector('#transcript .msg.assistant:last-child .stats.done');
          if (last && !done) window.lengths.push(last.textContent.length);
        }).observe(document.getElementById('transcript'), {childList: true, subtree: true, characterData: true});
        document.getElementById('c-temp').value = '0';
        document.getElementById('c-max').value = '60';
        document.getElementById('c-system').value = 'You are a storyteller.';
        """
    )
    driver.find_element("id", "c-input").send_keys("Tell me a story about a robot who learns to paint.")
    driver.find_element("id", "c-send").click()
    stats = wait_for(
        driver, "document.querySelector('#transcript .msg.assistant .stats.done')?.textContent", "the reply's stats"
    )
    grew = sorted(set(driver.execute_script("return window.lengths")))
    assert len([n for n in grew if n > 0]) >= 3, f"the reply did not stream in: text lengths {grew}"
    counts = re.search(r"(\d+) prompt \+ (\d+) completion tokens · ([\d.]+) tokens/s", stats)
    assert counts and int(counts[2]) > 1 and float(counts[3]) > 0, stats
    assert "first token" in stats and "finish:" in stats

    # a JSON-schema reply: the answer is JSON of the page's default schema
    driver.find_element("id", "c-json").click()
    driver.execute_script("document.getElementById('c-max').value = '200'")
    driver.find_element("id", "c-input").send_keys("Make up a person.")
    driver.find_element("id", "c-send").click()
    wait_for(
        driver, "document.querySelectorAll('#transcript .msg.assistant .stats.done').length === 2", "the JSON reply"
    )
    answer = driver.execute_script(
        "return [...document.querySelectorAll('#transcript .msg.assistant .text')][1].textContent"
    )
    person = json.loads(answer)
    assert isinstance(person["name"], str) and isinstance(person["age"], int), answer

    # reasoning apart from the answer: the server parses <think> (--reasoning-parser think) and a regex format,
    # which the page has no control for, is put into its request here so that this small model writes a thought
    driver.find_element("id", "c-json").click()  # off
    driver.execute_script(
        '''
        const format = {type: 'regex', schema: arguments[0]};
        const original = window.fetch;
        window.fetch = (url, options) => {
          if (String(url).endsWith('chat/completions')) {
            const body = {...JSON.parse(options.body), response_format: format};
            options = Object.assign({}, options, {body: JSON.stringify(body)});
          }
          return original(url, options);
        };
        document.getElementById('c-max').value = '40';
        ''',
        THOUGHT,
    )
    driver.find_element("id", "c-input").send_keys("Say hello.")
    driver.find_element("id", "c-send").click()
    wait_for(
        driver, "document.querySelectorAll('#transcript .msg.assistant .stats.done').length === 3", "the 3rd reply"
    )
    reasoning, hidden, answer = driver.execute_script(
        "const last = [...document.querySelectorAll('#transcript .msg.assistant')][2];"
        "return [last.querySelector('.reasoning').textContent, last.querySelector('details').hidden,"
        " last.querySelector('.text').textContent]"
    )
    assert reasoning.strip() and not hidden and "<think>" not in answer and "</think>" not in answer, (
        reasoning,
        answer,
    )
    driver.execute_script("[...document.querySelectorAll('#transcript details')].forEach((d) => (d.open = true))")
    driver.save_screenshot(str(artifacts / "web-chat.png"))

    # the plots saw the generation
    driver.get(keyed.base + "/#plots")  # same document (hash change): the samples are kept
    wait_for(
        driver,
        f"Number(document.getElementById('plot-tps').dataset.positive) > {positive_before}",
        "a positive tokens/s point",
    )
    wait_for(driver, "Number(document.getElementById('plot-ttft').dataset.positive) > 0", "a TTFT point")
    time.sleep(1)
    driver.save_screenshot(str(artifacts / "web-plots.png"))

    # a small screen
    driver.set_window_size(390, 844)
    driver.get(keyed.base + "/#status")
    time.sleep(1)
    driver.save_screenshot(str(artifacts / "web-small-screen.png"))
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")

    assert console_errors(driver) == []


def test_a_wrong_key_shows_a_clear_message_and_a_right_one_works(keyed, chromium, artifacts, model_name):
    driver = chromium
    driver.get(keyed.base + "/")
    wait_for(driver, "document.getElementById('key-dialog').open", "the key dialog")
    assert not driver.execute_script("return sessionStorage.getItem('appliance.apiKey')")

    driver.find_element("id", "key-input").send_keys("not-the-key")
    driver.find_element("id", "key-ok").click()
    message = wait_for(
        driver,
        "!document.getElementById('key-msg').hidden && document.getElementById('key-dialog').open"
        " && document.getElementById('key-msg').textContent",
        "the wrong key's message",
    )
    assert "refused" in message and "401" in message, message
    driver.save_screenshot(str(artifacts / "web-wrong-key.png"))

    driver.find_element("id", "key-input").send_keys(KEY)
    driver.find_element("id", "key-ok").click()
    model = model_name
    wait_for(driver, f"document.querySelector('#models tbody').textContent.includes({model!r})", "the status")
    assert driver.execute_script("return sessionStorage.getItem('appliance.apiKey')") == KEY
    assert not driver.execute_script("return document.getElementById('key-dialog').open")
    urls = driver.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    assert urls and not [u for u in urls if KEY in u or "not-the-key" in u]
    assert keyed.base.startswith("https://") and all(u.startswith(keyed.base + "/") for u in urls), urls
    # the only errors are the refused requests themselves
    assert console_errors(driver, re.compile(r"status of 401")) == []
