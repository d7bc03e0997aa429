"""The chat page (``GET /``) in headless Chromium, on the real SmolLM2-135M-Instruct.

A learner's path through the page: type a question, press Enter, watch the answer stream in
with its TTFT and tokens/s. The server runs in a background thread (``tests/helpers/serving.py``), the
page in Chromium driven by Playwright's Python client. The page's temperature is set to 0, so
the answer is greedy and must equal ``Engine.chat`` on the same engine, word for word. What the
page shows is recorded in the page itself (a MutationObserver on the conversation): the answer
must be seen at two or more lengths before its last one, i.e. it streamed. Any console error
or uncaught page error fails the test. Every wait is bounded; nothing is asserted on time.

Also in Chromium: Enter while an answer streams queues the question (only Stop stops one); a
stopped answer stays on screen and in the conversation sent next; an answer cut at max_tokens is
marked; markdown (a scripted stream) is rendered safely, with a working Copy button on code; at
390×844 the message box is full width and the title one line; an error is scrolled into view.

Needs Playwright's Python client (``pip install -e '.[browser]'``, or ``pip install playwright``)
and a Chromium (Debian/Ubuntu: ``apt-get install chromium``; or ``MINILLM_CHROMIUM=/path/to/chrome``);
Playwright's own downloaded browsers are not used. Without them the test is skipped with that
reason, unless ``MINILLM_REQUIRE_BROWSER=1`` (set by CI's ``.ci/run``): then it fails. The
tests at the end need no browser: the page's markdown renderer run in Node (skipped without
``node``), and the page's script and structure read as text.

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


# In the page, before the question is sent: every change to the conversation, the stats line or
# the page's state is recorded as [answer length, stats text, state, the answer's note]. The state
# (body's data-state) is "prompt" from sending to the first token, "streaming" after it, "idle" at
# the end; the answer's raw text is in its data-text (its bubble shows it rendered as markdown).
JS_RECORD = """() => {
  window.__seen = [];
  const record = () => {
    const answers = document.querySelectorAll('#log .msg.assistant');
    const answer = answers.length ? answers[answers.length - 1] : null;
    const note = answer && answer.querySelector('.note');
    window.__seen.push([answer ? answer.dataset.text.length : -1, document.getElementById('stats').textContent,
                        document.body.dataset.state, note ? note.textContent : null]);
  };
  const observer = new MutationObserver(record);
  observer.observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true,
                                                    attributes: true});
  observer.observe(document.getElementById('stats'), {childList: true, subtree: true, characterData: true});
  observer.observe(document.body, {attributes: true, attributeFilter: ['data-state']});
  return true;
}"""

# Every request body the page sends, recorded by wrapping fetch (page.evaluate runs outside the CSP).
JS_RECORD_BODIES = """() => {
  window.__bodies = [];
  const fetch0 = window.fetch;
  window.fetch = (url, options) => { window.__bodies.push(JSON.parse(options.body)); return fetch0(url, options); };
}"""

# The answer has finished streaming: an answer bubble exists and the page is idle again.
JS_DONE = """() => document.querySelector('#log .msg.assistant') !== null && document.body.dataset.state === 'idle'"""

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
    text = answer.get_attribute("data-text")
    assert "Paris" in text
    assert text == chat.expected.text  # greedy: what Engine.chat answers on the same engine
    assert page.text_content("#log .msg.assistant .body") == text  # no markdown in it: shown as it is
    assert answer.locator(".note").count() == 0  # it ended by itself: nothing to mark

    # Until the first token the answer said it was processing the prompt; then it streamed: the
    # answer was on screen at two or more lengths, growing, before its last.
    seen = page.evaluate("() => window.__seen")
    before_text = [(state, note) for n, _, state, note in seen if n == 0]
    assert ("prompt", "processing prompt") in before_text, before_text
    lengths = [n for n, _, _, _ in seen if n >= 0]
    assert lengths == sorted(lengths), f"the answer shrank: {lengths}"
    assert lengths[-1] == len(text)
    partial = sorted({n for n in lengths if 0 < n < len(text)})
    assert len(partial) >= 2, f"the answer appeared at once, not streamed: lengths seen {lengths}"
    # ... and while it streamed, the stats line already showed a TTFT and a rate.
    streaming = [stats for n, stats, state, _ in seen if 0 < n < len(text) and state == "streaming"]
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


def test_stop_ends_the_answer_keeps_it_in_the_conversation_and_the_server_frees_its_blocks(page, chat):
    before = chat.served.metrics()
    page.evaluate(JS_RECORD_BODIES)
    # The page presses Stop itself, the moment the first words show: STORY's greedy answer runs
    # for hundreds of tokens (see STORY), so the abort, not the end of the answer, ends it.
    page.evaluate("""() => new MutationObserver((_, observer) => {
      const answer = document.querySelector('#log .msg.assistant');
      if (answer && answer.dataset.text) { observer.disconnect(); document.getElementById('stop').click(); }
    }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true,
                                                attributes: true})""")
    _ask(page, STORY, STOP_AFTER)
    page.wait_for_function(JS_DONE, timeout=WAIT_MS, polling=100)
    stopped = page.get_attribute("#log .msg.assistant", "data-text")
    assert stopped and page.text_content("#log .msg.assistant .note") == "stopped"
    assert "error" not in page.get_attribute("#log .msg.assistant", "class")
    assert page.is_hidden("#stop")
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
    # The stopped answer stays on screen and in the conversation: the next question sends it.
    _ask(page, QUESTION, 4)
    page.wait_for_function("() => document.querySelectorAll('#log .msg.assistant').length === 2 "
                           "&& document.body.dataset.state === 'idle'", timeout=WAIT_MS, polling=100)
    assert page.get_attribute("#log .msg.assistant >> nth=0", "data-text") == stopped
    bodies = page.evaluate("() => window.__bodies")
    assert bodies[-1]["messages"] == [{"role": "user", "content": STORY}, {"role": "assistant", "content": stopped},
                                      {"role": "user", "content": QUESTION}]


def test_a_question_sent_while_an_answer_streams_waits_its_turn(page, chat):
    """Enter while an answer streams neither stops it nor drops the new question: the question is
    shown as queued, asked when the answer ends, with that answer in its conversation."""
    page.evaluate(JS_RECORD_BODIES)
    _ask(page, QUESTION, MAX_TOKENS)
    page.wait_for_function("() => document.body.dataset.state !== 'idle'", timeout=WAIT_MS, polling=20)
    page.fill("#input", "And of Italy?")
    page.press("#input", "Enter")
    assert "queued" in page.get_attribute("#log .msg.user >> nth=1", "class")
    page.wait_for_function("() => document.querySelectorAll('#log .msg.assistant').length === 2 "
                           "&& document.body.dataset.state === 'idle'", timeout=WAIT_MS, polling=100)
    first = page.get_attribute("#log .msg.assistant >> nth=0", "data-text")
    assert first == chat.expected.text  # not stopped: the whole greedy answer
    assert page.locator("#log .note.stopped").count() == 0
    assert "queued" not in page.get_attribute("#log .msg.user >> nth=1", "class")
    bodies = page.evaluate("() => window.__bodies")
    assert [b["messages"] for b in bodies] == [
        [{"role": "user", "content": QUESTION}],
        [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first},
         {"role": "user", "content": "And of Italy?"}]]


def test_an_answer_cut_at_max_tokens_is_marked(page, chat):
    _ask(page, STORY, 3)
    page.wait_for_function(JS_DONE, timeout=WAIT_MS, polling=100)
    assert "max tokens" in page.text_content("#log .msg.assistant .note.cut")


# A scripted stream in the server's format (the page's fetch answered by Playwright, not the
# server): markdown with a code block, HTML that must stay text, and a cut at max_tokens.
SCRIPTED = ["Use **bold**, *italics* and `x < y`:\n\n", "- one\n- two\n\n", "```python\n",
            "print('<b>hi</b>')\n", "```\n", "<img src=x onerror=alert(1)>"]


def _scripted_stream(pieces: list[str], finish_reason: str) -> str:
    import json

    head = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    chunk = lambda delta, finish=None: "data: " + json.dumps(  # noqa: E731
        {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}) + "\n\n"
    return (chunk({"role": "assistant", "content": ""}) + "".join(chunk({"content": p}) for p in pieces)
            + chunk({}, finish_reason) + "data: [DONE]\n\n")


def test_markdown_is_rendered_safely_with_a_copy_button(page):
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=_scripted_stream(SCRIPTED, "length")))
    _ask(page, "show me markdown", 64)
    page.wait_for_function(JS_DONE, timeout=WAIT_MS, polling=100)
    body = page.locator("#log .msg.assistant .body")
    assert body.locator("strong").text_content() == "bold" and body.locator("em").text_content() == "italics"
    assert body.locator("p code").first.text_content() == "x < y"
    assert body.locator("ul li").all_text_contents() == ["one", "two"]
    assert body.locator("pre code.language-python").text_content() == "print('<b>hi</b>')"
    assert body.locator("img").count() == 0 and body.locator("b").count() == 0  # the model's HTML is text
    assert "<img src=x onerror=alert(1)>" in body.text_content()
    assert page.locator("#log .note.cut").count() == 1
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    body.locator("button.copy").click()
    page.wait_for_function("() => document.querySelector('#log button.copy').textContent === 'Copied'",
                           timeout=WAIT_MS, polling=50)
    assert page.evaluate("() => navigator.clipboard.readText()") == "print('<b>hi</b>')"


def test_on_a_phone_the_message_box_is_full_width_and_the_title_one_line(page):
    page.set_viewport_size({"width": 390, "height": 844})
    box = page.locator("#input").bounding_box()
    assert box["width"] >= 0.9 * 390 - 32, box
    h1 = page.evaluate("""() => { const h = document.querySelector('h1');
      return [h.getBoundingClientRect().height, parseFloat(getComputedStyle(h).lineHeight)]; }""")
    assert h1[0] <= 1.5 * h1[1], f"the title wraps: {h1}"
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390  # nothing wider than the screen


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
            assert page.evaluate("""() => { const e = document.querySelector('#log .msg.error').getBoundingClientRect();
              const log = document.getElementById('log').getBoundingClientRect();
              return e.top >= log.top - 1 && e.bottom <= log.bottom + 1; }"""), "the error is not in view"
            page.fill("#api_key", KEY)
            page.dispatch_event("#api_key", "change")
            _ask(page, "hello", 4)
            page.wait_for_function("() => document.querySelectorAll('#log .msg.assistant').length === 2 "
                                   "&& document.body.dataset.state === 'idle'",
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


# --------------------------------------------------------------------------- without a browser
# The page's markdown renderer, run in Node (skipped without `node`), and the page's structure read
# as text: these run wherever the tests run, Chromium or not.
PAGE = (Path(__file__).parents[2] / "minillm" / "chat.html").read_text(encoding="utf-8")
SCRIPT = re.search(r"<script>(.*?)</script>", PAGE, re.DOTALL)[1]
RENDERER = re.search(r"// --- markdown \(begin\).*?// --- markdown \(end\)", SCRIPT, re.DOTALL)[0]
# What the renderer may write: these tags, these attributes (the rest of its output is escaped text).
ALLOWED = {"p": set(), "br": set(), "strong": set(), "em": set(), "code": {"class"}, "pre": set(), "ul": set(),
           "ol": {"start"}, "li": set(), "h3": set(), "h4": set(), "h5": set(), "div": {"class"}, "button": {"type", "class"}}


def _node() -> str:
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("no `node` to run the page's markdown renderer")
    return node


def render(*texts: str) -> list[str]:
    """renderMarkdown(text) for each text, in one Node process."""
    import json
    import subprocess

    program = RENDERER + "\nprocess.stdout.write(JSON.stringify(JSON.parse(require('fs').readFileSync(0, 'utf8'))" \
                         ".map(renderMarkdown)));"
    proc = subprocess.run([_node(), "-e", program], input=json.dumps(texts), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("text, html", [
    ("Paris.", "<p>Paris.</p>"),
    ("one\ntwo\n\nthree", "<p>one<br>two</p><p>three</p>"),
    ("**bold**, __bold__, *it*, _it_ and snake_case_name", "<p><strong>bold</strong>, <strong>bold</strong>, "
                                                          "<em>it</em>, <em>it</em> and snake_case_name</p>"),
    ("2 * 3 * 4 is not italic", "<p>2 * 3 * 4 is not italic</p>"),
    ("`a **b** <c>` and `d`", "<p><code>a **b** &lt;c&gt;</code> and <code>d</code></p>"),
    ("- one\n- **two**\n  continued\n\n3. c\n4. d", "<ul><li>one</li><li><strong>two</strong> continued</li></ul>"
                                                  '<ol start="3"><li>c</li><li>d</li></ol>'),
    ("# Title\ntext", "<h3>Title</h3><p>text</p>"),
    ("```python\nif a < b:\n    print('&')\n```\nafter",
     '<div class="code"><button type="button" class="copy">Copy</button><pre><code class="language-python">'
     "if a &lt; b:\n    print(&#39;&amp;&#39;)</code></pre></div><p>after</p>"),
    ("```\nstill streaming **not bold**", '<div class="code"><button type="button" class="copy">Copy</button>'
                                         "<pre><code>still streaming **not bold**</code></pre></div>"),
    ('<script>alert("x")</script>', "<p>&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;</p>"),
    ('<img src=x onerror="alert(1)">', "<p>&lt;img src=x onerror=&quot;alert(1)&quot;&gt;</p>"),
    ('```"><img src=x>\ncode\n```', '<p>```&quot;&gt;&lt;img src=x&gt;<br>code</p><div class="code">'
                                     '<button type="button" class="copy">Copy</button><pre><code></code></pre></div>'),
    ("", ""),
], ids=["plain", "paragraphs", "emphasis", "stars", "inline-code", "lists", "heading", "fence", "open-fence",
        "script", "img", "fence-language", "empty"])
def test_the_markdown_renderer(text, html):
    assert render(text) == [html]


def test_the_renderer_writes_only_its_own_tags_whatever_the_text():
    """Random text from markdown's and HTML's special characters: every tag and attribute in the
    output is one the renderer writes, and the visible text is the input's (escaped, not dropped)."""
    import random
    from html.parser import HTMLParser

    rng = random.Random(12)
    alphabet = list("<>&\"'`*_#-+.1 \n") + ["```", "```js\n", "<script>", "</p>", "onerror=", "\u0000", "é", "🐉"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))) for _ in range(400)]
    for text, html in zip(texts, render(*texts)):
        found: list[str] = []

        class Tags(HTMLParser):
            def handle_starttag(self, tag, attrs):
                assert tag in ALLOWED and {a for a, _ in attrs} <= ALLOWED[tag], (text, html)
                for name, value in attrs:
                    assert re.fullmatch(r"[\w+#. -]*", value), (text, html)

            def handle_data(self, data):
                found.append(data)

        Tags(convert_charrefs=True).feed(html)
        visible = "".join(found).replace("Copy", "")
        for ch in "<>&\"'é🐉":  # what the text holds is shown, as text
            assert (ch in visible) == (ch in text.replace("\u0000", "")), (text, html)


def test_the_page_script_parses_and_keeps_to_its_csp():
    """The script is valid JavaScript (node --check); nothing in the page loads from elsewhere; the
    only HTML it writes is the renderer's; no handler attributes or style attributes (the CSP would
    block them); Enter while an answer streams queues the question, only Stop aborts."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".js", delete=False) as f:
        f.write(SCRIPT)
    proc = subprocess.run([_node(), "--check", f.name], capture_output=True, text=True, timeout=60)
    Path(f.name).unlink()
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"https?://", PAGE)  # no CDN, no font, no script from elsewhere: works offline
    assert re.findall(r"\.innerHTML\s*=\s*([^;]+);", SCRIPT) == ["renderMarkdown(text)"]
    assert not re.search(r"\son[a-z]+\s*=|\sstyle\s*=|setAttribute\(\s*[\"']style|eval\(|new Function", PAGE)
    assert SCRIPT.count(".abort()") == 1 and re.search(r'stop\.addEventListener\("click", \(\) => controller\?\.abort\(\)\)',
                                                       SCRIPT)


def test_the_page_keeps_the_servers_csp():
    """The page adds no script or style element the server's CSP does not name: one of each."""
    assert PAGE.count("<script>") == 1 and PAGE.count("<style>") == 1
    assert "<script " not in PAGE and "<style " not in PAGE and "<link rel=\"stylesheet\"" not in PAGE
