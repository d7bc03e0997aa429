"""The chat page (``GET /``) in headless Chromium, on the real SmolLM2-135M-Instruct.

A learner's path through the page: type a question, press Enter, watch the answer stream in
with its TTFT and tokens/s. The server runs in a background thread (``tests/helpers/serving.py``), the
page in Chromium driven by Playwright's Python client. The page's temperature is set to 0, so
the answer is greedy and must equal ``Engine.chat`` on the same engine, word for word. What the
page shows is recorded in the page itself (a MutationObserver on the conversation): the answer
must be seen at two or more lengths before its last one, i.e. it streamed. Any console error
or uncaught page error fails the test. Every wait is bounded; nothing is asserted on time.

Needs Playwright's Python client (``pip install -e '.[browser]'``, or ``pip install playwright``)
and a Chromium (Debian/Ubuntu: ``apt-get install chromium``; or ``MINILLM_CHROMIUM=/path/to/chrome``);
Playwright's own downloaded browsers are not used. Without them the test is skipped with that
reason, unless ``MINILLM_REQUIRE_BROWSER=1`` (set by CI's ``.ci/run``): then it fails.

    python -m pytest tests/12_serving/test_chat_page.py -v
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from minillm import Engine, SamplingParams
from minillm.engine.request import Completion

from helpers.serving import Served, serving

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24  # the greedy answer, "The capital of France is Paris.", fits
# The Stop test's question and max tokens: greedy, SmolLM2 answers it with a story of more than
# STOP_AFTER tokens (no end-of-sequence before), far more than the page lets through.
STORY = "Write a long story about a dragon who learns to read."
STOP_AFTER = 256
WAIT_MS = 120_000  # the longest any one wait in the page may take (a busy 2-core machine)

# find_chromium() is shared with the JupyterLab check (a standalone script, loaded by path).
_spec = importlib.util.spec_from_file_location("check_lab", Path(__file__).parents[1] / "browser" / "check_lab.py")
check_lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lab)


def browser_missing() -> str | None:
    """Why the page cannot be opened here (with how to fix it), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return ("Playwright's Python client is not installed: pip install -e '.[browser]' "
                "(or pip install playwright; its downloaded browsers are not needed)")
    if check_lab.find_chromium() is None:
        where = os.environ.get("MINILLM_CHROMIUM")
        return (f"MINILLM_CHROMIUM={where} is not a file" if where else
                "no Chromium found: apt-get install chromium (Debian/Ubuntu), or set MINILLM_CHROMIUM=/path/to/chrome")
    return None


# In the page, before the question is sent: every change to the conversation or to the stats
# line is recorded as [answer length, stats text, the button's label] (the button says Stop
# while an answer streams).
JS_RECORD = """() => {
  window.__seen = [];
  const record = () => {
    const answers = document.querySelectorAll('#log .msg.assistant');
    const answer = answers.length ? answers[answers.length - 1] : null;
    window.__seen.push([answer ? answer.textContent.length : -1, document.getElementById('stats').textContent,
                        document.getElementById('send').textContent]);
  };
  const observer = new MutationObserver(record);
  for (const id of ['log', 'stats', 'send'])
    observer.observe(document.getElementById(id), {childList: true, subtree: true, characterData: true});
  return true;
}"""

# The answer has finished streaming: an answer bubble exists and the button is back to Send.
JS_DONE = """() => document.querySelector('#log .msg.assistant') !== null
                 && document.getElementById('send').textContent === 'Send'"""

STATS = re.compile(r"^TTFT (\d+) ms · (\d+\.\d) tokens/s · (\d+) tokens$")


@pytest.fixture(scope="session")  # session: set up before the session-scoped model
def chromium() -> str:
    """The Chromium binary; skips (or, with MINILLM_REQUIRE_BROWSER=1, fails) without one."""
    why = browser_missing()
    if why:
        if os.environ.get("MINILLM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MINILLM_REQUIRE_BROWSER=1, but the chat page cannot be tested: {why}", pytrace=False)
        pytest.skip(f"chat page in Chromium: {why}")
    return check_lab.find_chromium()


@dataclass
class Chat:
    served: Served
    expected: Completion  # Engine.chat, greedy, MAX_TOKENS, on the engine the server runs


@pytest.fixture(scope="module")
def chat(chromium, smollm) -> Iterator[Chat]:  # chromium first: no model work when the test is skipped
    """The server on the real model. The greedy reference is computed first, with the same Engine
    (which compiles its decode step on the way), which the server then takes over."""
    model, tok = smollm
    engine = Engine(model, tok)
    expected = engine.chat([{"role": "user", "content": QUESTION}], SamplingParams(max_new_tokens=MAX_TOKENS))
    with serving(engine, MODEL) as served:
        yield Chat(served, expected)


@pytest.fixture
def page(chromium, chat):
    """A fresh page on the chat page; afterwards, no console error and no uncaught error."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text} ({m.location})")
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.goto(f"{chat.served.url}/", wait_until="load")
            yield page
            page.close()  # console messages still in flight arrive before close returns
        finally:
            browser.close()
    assert not errors, "the chat page logged errors:\n" + "\n".join(errors)


def _ask(page, question: str, max_tokens: int) -> None:
    page.fill("#temperature", "0")  # greedy: the page's default (0.2) samples
    page.fill("#max_tokens", str(max_tokens))
    page.evaluate(JS_RECORD)
    page.fill("#input", question)
    page.press("#input", "Enter")


def test_the_chat_page_streams_a_greedy_answer_with_ttft_and_tokens_per_second(page, chat):
    assert page.title() == f"minillm · {MODEL}"
    assert page.text_content("#stats") == "TTFT – · – tokens/s"
    _ask(page, QUESTION, MAX_TOKENS)
    page.wait_for_function(JS_DONE, timeout=WAIT_MS, polling=100)

    assert page.locator("#log .msg.user").all_text_contents() == [QUESTION]
    assert page.input_value("#input") == ""  # sent, and the box cleared for the next question
    answer = page.locator("#log .msg.assistant")
    assert answer.count() == 1
    assert "error" not in answer.get_attribute("class")
    text = answer.text_content()
    assert "Paris" in text
    assert text == chat.expected.text  # greedy: what Engine.chat answers on the same engine

    # It streamed: the answer was on screen at two or more lengths, growing, before its last.
    seen = page.evaluate("() => window.__seen")
    lengths = [n for n, _, _ in seen if n >= 0]
    assert lengths == sorted(lengths), f"the answer shrank: {lengths}"
    assert lengths[-1] == len(text)
    partial = sorted({n for n in lengths if 0 < n < len(text)})
    assert len(partial) >= 2, f"the answer appeared at once, not streamed: lengths seen {lengths}"
    # ... and while it streamed, the stats line already showed a TTFT and a rate.
    streaming = [stats for n, stats, button in seen if 0 < n < len(text) and button == "Stop"]
    assert any(STATS.match(s) for s in streaming), f"no TTFT / tokens/s while streaming: {streaming}"

    # At the end: TTFT in ms, a rate, and the exact token count (the server's usage chunk).
    stats = page.text_content("#stats")
    match = STATS.match(stats)
    assert match, f"stats line: {stats!r}"
    ttft_ms, rate, tokens = int(match[1]), float(match[2]), int(match[3])
    assert ttft_ms >= 0 and rate > 0
    assert tokens == len(chat.expected.token_ids)
    metrics = chat.served.wait_until_idle()
    assert metrics["minillm_requests_running"] == 0


def test_stop_ends_the_answer_and_the_server_frees_its_blocks(page, chat):
    before = chat.served.metrics()
    # The page presses Stop itself, the moment the first words show: STORY's greedy answer runs
    # for hundreds of tokens (see STORY), so the abort, not the end of the answer, ends it.
    page.evaluate("""() => new MutationObserver((_, observer) => {
      const answer = document.querySelector('#log .msg.assistant');
      if (answer && answer.textContent.length > 0) { observer.disconnect(); document.getElementById('send').click(); }
    }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true})""")
    _ask(page, STORY, STOP_AFTER)
    page.wait_for_function(JS_DONE, timeout=WAIT_MS, polling=100)
    text = page.text_content("#log .msg.assistant")
    assert text.endswith(" [stopped]") and len(text) > len(" [stopped]")
    assert "error" not in page.get_attribute("#log .msg.assistant", "class")
    stats = page.text_content("#stats")  # stopped after a token or two: the rate may not be shown yet
    match = re.match(r"^TTFT (\d+) ms · (–|\d+\.\d) tokens/s · (\d+) tokens$", stats)
    assert match and 0 < int(match[3]) < STOP_AFTER, f"stats line: {stats!r}"
    # The abort reached the engine: the request finished as aborted, nothing is left running,
    # and every KV block is back in the pool.
    after = chat.served.wait_until_idle()
    assert after['minillm_requests_finished_total{reason="abort"}'] == \
        before['minillm_requests_finished_total{reason="abort"}'] + 1
    assert after["minillm_requests_running"] == 0
    assert after["minillm_kv_blocks_free"] == after["minillm_kv_blocks_total"]


# --------------------------------------------------------------------------- with an API key
KEY = "sk-page-test"


@pytest.fixture(scope="module")
def keyed(chromium, tmp_path_factory, tiny_tokenizer) -> Iterator[Served]:
    """A server that needs an API key, on a tiny random model (what it says does not matter here)."""
    from minillm import load_model

    from helpers.checkpoints import tiny_hf_checkpoint

    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                                max_position_embeddings=512, vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    with serving(Engine(model, tok, backend="eager", kv_cache_tokens=2048), "tiny", api_key=KEY) as served:
        yield served


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(chromium, keyed):
    """The page (open without a key, under its CSP) shows a key field; a wrong key's 401 is shown
    as an error; with the right key the answer streams."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            # A 401 is logged by Chromium as a failed resource load: expected once, below.
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.goto(f"{keyed.url}/", wait_until="load")
            assert page.is_visible("#api_key")
            page.fill("#api_key", "sk-wrong")
            _ask(page, "hello", 4)
            page.wait_for_function(JS_DONE, timeout=WAIT_MS, polling=100)
            answer = page.locator("#log .msg.assistant").last
            assert "error" in answer.get_attribute("class") and "API key" in answer.text_content()
            page.fill("#api_key", KEY)
            page.dispatch_event("#api_key", "change")
            _ask(page, "hello", 4)
            page.wait_for_function("() => document.querySelectorAll('#log .msg.assistant').length === 2 "
                                   "&& document.getElementById('send').textContent === 'Send'",
                                   timeout=WAIT_MS, polling=100)
            answer = page.locator("#log .msg.assistant").last
            assert "error" not in answer.get_attribute("class")
            assert re.match(r"^TTFT .* · (\d+) tokens$", page.text_content("#stats"))
            page.reload(wait_until="load")  # the key is kept for the tab
            assert page.input_value("#api_key") == KEY
            page.close()
        finally:
            browser.close()
    assert [e for e in errors if "401" not in e] == [], errors
