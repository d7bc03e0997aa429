"""Who may use the server (``minillm.serve.security``): Host, Origin and CORS, the API key, the
Content-Type of a POST, the chat page's headers, and the warning when serving the network.

The policy's laws are checked on ``Guard`` alone, in front of a stub app (Starlette's TestClient,
no model, no socket), over many variants; then end to end on an in-process server and on the real
command. Every refusal is OpenAI's error JSON with ``Connection: close``, and the app behind the
guard never sees a refused request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import signal
import socket
from collections.abc import Iterator
from html.parser import HTMLParser

import httpx
import openai
import pytest
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from minillm import Engine, load_model
from minillm.serve.security import Guard, Policy, host_name

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import Served, serve_command, serving

HOST = "127.0.0.1:8000"
KEY = "sk-workshop-7f3a"
APP_ORIGIN = "http://app.example:3000"


# --------------------------------------------------------------------------- Guard alone
def guarded(policy: Policy) -> tuple[TestClient, list[str]]:
    """Guard in front of a stub app that records the paths it was asked for."""
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append(scope["path"])
        await JSONResponse({"ok": True})(scope, receive, send)

    return TestClient(Guard(app, policy), base_url=f"http://{HOST}"), seen


def _refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert response.headers["connection"] == "close"
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "localhost.", "localhost",
                                  "[::1]:8000", "[::1]", "10.1.2.3:8000", "192.168.0.5", "[fe80::1]:80", "0.0.0.0"])
def test_localhost_and_ip_addresses_are_hosts_of_the_server(host):
    client, seen = guarded(Policy())
    assert client.get("/v1/models", headers={"Host": host}).status_code == 200
    assert seen == ["/v1/models"]


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:8000", "127.0.0.1.nip.io:8000", "localhost.evil.example", "attacker.localhost",
    "7f000001.rbndr.us", "", "127.0.0.1:80:80", "[::1", "[::1]x", "[::1]:x", "localhost:", "localhost:abc",
    "127.0.0.1:8000@evil.example", "0x7f.1", "2130706433x"])
def test_any_other_host_is_refused_with_400_dns_rebinding_included(host):
    client, seen = guarded(Policy())
    for method, path in (("GET", "/"), ("GET", "/health"), ("POST", "/v1/chat/completions")):
        response = client.request(method, path, headers={"Host": host, "Content-Type": "application/json"},
                                  content=b"{}")
        _refused(response, 400, "invalid_host")
        assert "--allowed-hosts" in response.json()["error"]["message"]
    assert seen == []


def test_allowed_hosts_adds_names_and_star_allows_any():
    client, _ = guarded(Policy.of(allowed_hosts=["MyHost.lan", " workshop.local. "]))
    for host in ("myhost.lan:8000", "MYHOST.LAN", "workshop.local:80", "localhost"):
        assert client.get("/", headers={"Host": host}).status_code == 200, host
    for host in ("other.lan", "myhost.lan.evil.example"):
        _refused(client.get("/", headers={"Host": host}), 400, "invalid_host")
    client, _ = guarded(Policy.of(allowed_hosts=["*"]))
    assert client.get("/", headers={"Host": "evil.example"}).status_code == 200


def test_host_name_parses_ports_brackets_and_refuses_malformed():
    assert host_name("Example.COM:8000") == "example.com"
    assert host_name("[::1]:8000") == host_name("[::1]") == "::1"
    assert host_name("localhost.") == "localhost"
    for bad in (None, "", ":8000", "a:b", "[::1", "[::1]:", "a:1:2"):
        assert host_name(bad) is None, bad


@pytest.mark.parametrize("origin", ["http://evil.example", "https://127.0.0.1:8000", "http://127.0.0.1:8001",
                                    "http://localhost:8000", "null", "file://", APP_ORIGIN])
def test_a_page_of_another_origin_is_refused_without_cors(origin):
    client, seen = guarded(Policy())
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("OPTIONS", "/v1/completions")):
        headers = {"Origin": origin, "Content-Type": "application/json", "Access-Control-Request-Method": "POST"}
        _refused(client.request(method, path, headers=headers, content=b"{}"), 403, "cross_origin_refused")
    assert seen == []


def test_the_same_origin_and_no_origin_pass_without_cors_headers():
    client, seen = guarded(Policy())
    for headers in ({}, {"Origin": f"http://{HOST}"}, {"Origin": f"HTTP://{HOST.upper()}"}):
        response = client.post("/v1/completions", headers={**headers, "Content-Type": "application/json"},
                               content=b"{}")
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    assert len(seen) == 3


def test_cors_origin_opts_one_origin_in_with_preflight():
    client, seen = guarded(Policy.of(cors_origins=[APP_ORIGIN + "/", "http://other.example"], api_key=KEY))
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # a preflight carries no key
    assert preflight.status_code == 204 and seen == []
    assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")} >= \
        {"authorization", "content-type"}
    response = client.post("/v1/chat/completions", content=b"{}", headers={
        "Origin": APP_ORIGIN, "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "origin" in response.headers["vary"].lower()
    # A refusal of an allowed page is readable by that page (the 401 carries the CORS header) ...
    response = client.post("/v1/chat/completions", content=b"{}",
                           headers={"Origin": APP_ORIGIN, "Content-Type": "application/json"})
    assert response.status_code == 401 and response.headers["access-control-allow-origin"] == APP_ORIGIN
    # ... and another origin is still refused, preflight or not.
    for origin in ("http://app.example:3001", "https://app.example:3000", "http://evil.example"):
        for method in ("OPTIONS", "POST"):
            response = client.request(method, "/v1/chat/completions", content=b"{}", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST", "Content-Type": "application/json",
                "Authorization": f"Bearer {KEY}"})
            _refused(response, 403, "cross_origin_refused")
    assert seen == ["/v1/chat/completions"]


def test_cors_star_allows_any_origin():
    client, _ = guarded(Policy.of(cors_origins=["*"]))
    response = client.get("/v1/models", headers={"Origin": "http://anything.example"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://anything.example"


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx", "application/json-patch+json", "text/json",
                                          "json", ""])
def test_a_post_that_is_not_application_json_is_refused_with_415(content_type):
    client, seen = guarded(Policy())
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path in ("/v1/chat/completions", "/v1/completions", "/anything"):
        response = client.post(path, content=b'{"prompt": "hi"}', headers=headers)
        _refused(response, 415, "unsupported_media_type")
    assert seen == []


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "APPLICATION/JSON", "application/json;charset=UTF-8",
                                          " application/json ; charset=utf-8"])
def test_application_json_with_or_without_a_charset_gets_in(content_type):
    client, seen = guarded(Policy())
    assert client.post("/v1/completions", content=b"{}", headers={"Content-Type": content_type}).status_code == 200
    assert client.get("/v1/models").status_code == 200  # a GET has no body to type
    assert seen == ["/v1/completions", "/v1/models"]


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", f"Basic {KEY}", f"Bearer {KEY}x",
                                           f"Bearer {KEY[:-1]}", f"Token {KEY}", KEY, f"Bearer {KEY.upper()}"])
def test_with_an_api_key_a_missing_or_wrong_bearer_is_401(authorization):
    client, seen = guarded(Policy.of(api_key=KEY))
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"), ("GET", "/v2/x")):
        response = client.request(method, path, headers={**headers, "Content-Type": "application/json"},
                                  content=b"{}")
        _refused(response, 401, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    assert seen == []


def test_with_an_api_key_the_right_bearer_gets_in_and_the_page_and_health_stay_open(monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    client, seen = guarded(Policy.of(api_key=KEY))
    for authorization in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY} "):
        assert client.get("/v1/models", headers={"Authorization": authorization}).status_code == 200
    assert len(compared) == 3  # compared in constant time
    assert client.get("/").status_code == client.get("/health").status_code == 200
    assert seen == ["/v1/models"] * 3 + ["/", "/health"]


def test_the_checks_run_in_order_host_origin_key_content_type():
    client, _ = guarded(Policy.of(api_key=KEY))
    everything_wrong = {"Host": "evil.example", "Origin": "http://evil.example", "Content-Type": "text/plain"}
    _refused(client.post("/v1/completions", headers=everything_wrong), 400, "invalid_host")
    _refused(client.post("/v1/completions", headers={**everything_wrong, "Host": HOST}), 403, "cross_origin_refused")
    no_origin = {"Host": HOST, "Content-Type": "text/plain"}
    _refused(client.post("/v1/completions", headers=no_origin), 401, "invalid_api_key")
    _refused(client.post("/v1/completions", headers={**no_origin, "Authorization": f"Bearer {KEY}"}), 415,
             "unsupported_media_type")


def test_echoed_headers_are_clipped():
    client, _ = guarded(Policy())
    for name, value, code in (("Host", "h" * 5000 + ".example", "invalid_host"),
                              ("Origin", "http://" + "o" * 5000, "cross_origin_refused"),
                              ("Content-Type", "text/" + "c" * 5000, "unsupported_media_type")):
        response = client.post("/v1/completions", headers={name: value})
        assert response.json()["error"]["code"] == code
        assert len(response.json()["error"]["message"]) < 400 and "…" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- an in-process server
@pytest.fixture(scope="module")
def engine_folder(tmp_path_factory, tiny_tokenizer):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                              max_position_embeddings=512, vocab_size=300)


def _engine(folder) -> Engine:
    model, tok = load_model(folder, device="cpu")
    return Engine(model, tok, backend="eager", kv_cache_tokens=2048)


@pytest.fixture(scope="module")
def open_server(engine_folder) -> Iterator[Served]:
    with serving(_engine(engine_folder), "tiny") as served:
        yield served


@pytest.fixture(scope="module")
def keyed_server(engine_folder) -> Iterator[Served]:
    with serving(_engine(engine_folder), "tiny", api_key=KEY, cors_origins=[APP_ORIGIN]) as served:
        yield served


@pytest.mark.parametrize("content_type, status", [(None, 415), ("text/plain", 415),
                                                  ("application/x-www-form-urlencoded", 415),
                                                  ("application/json; charset=utf-8", 200)])
def test_the_endpoints_take_json_only(open_server, content_type, status):
    body = {"/v1/completions": '{"prompt": "hi", "max_tokens": 1}',
            "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'}
    for path, text in body.items():
        headers = {} if content_type is None else {"Content-Type": content_type}
        response = httpx.post(f"{open_server.url}{path}", content=text, headers=headers, timeout=60)
        assert response.status_code == status, response.text


def test_a_refusal_is_sent_before_the_body_is_read_and_closes_the_connection(open_server):
    """A cross-site form claims 10 MB of text/plain, and sends none of it: the 415 comes at once."""
    port = int(open_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                     b"Content-Length: 10000000\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 415") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.nip.io"])
def test_a_rebinding_host_is_refused_end_to_end(open_server, host):
    for path in ("/", "/v1/models", "/health", "/metrics"):
        response = httpx.get(f"{open_server.url}{path}", headers={"Host": host}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host"


def test_a_request_without_host_is_refused(open_server):
    port = int(open_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 400") and b"invalid_host" in received


def test_the_openai_client_with_the_key_works_and_without_it_gets_authentication_error(keyed_server):
    reply = keyed_server.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert reply.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.url}/metrics").status_code == 401
    assert "minillm_requests_running" in httpx.get(f"{keyed_server.url}/metrics",
                                                   headers={"Authorization": f"Bearer {KEY}"}).text


# --------------------------------------------------------------------------- the chat page
def _inline(page: str, tag: str) -> list[str]:
    """The text of each ``tag`` element, as an HTML parser (and so a browser) reads the page."""
    found: list[str] = []

    class Parser(HTMLParser):
        inside = False

        def handle_starttag(self, name, attrs):
            if name == tag:
                self.inside = True
                found.append("")

        def handle_endtag(self, name):
            self.inside = self.inside and name != tag

        def handle_data(self, data):
            if self.inside:
                found[-1] += data

    Parser(convert_charrefs=False).feed(page)
    return found


def _sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.mark.parametrize("server, auth", [("open_server", "none"), ("keyed_server", "bearer")])
def test_the_chat_page_has_a_strict_csp_naming_its_own_script_and_style(request, server, auth):
    served = request.getfixturevalue(server)
    response = httpx.get(f"{served.url}/")  # open, with or without a key
    assert response.status_code == 200
    page, headers = response.text, response.headers
    directives = {d.split()[0]: d.split()[1:] for d in headers["content-security-policy"].split(";") if d.strip()}
    assert directives["default-src"] == ["'none'"]
    [script], [style] = _inline(page, "script"), _inline(page, "style")
    assert directives["script-src"] == [_sha(script)] and directives["style-src"] == [_sha(style)]
    assert directives["connect-src"] == ["'self'"] and directives["frame-ancestors"] == ["'none'"]
    assert "'unsafe-inline'" not in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    # Nothing else in the page would need the policy loosened: no handler attributes, no other source.
    assert not re.search(r"\son[a-z]+\s*=", page)
    assert re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", page) == ["data:,"]
    assert f'<meta name="auth" content="{auth}">' in page
    assert 'id="api_key"' in page and "Authorization" in script


# --------------------------------------------------------------------------- the command line
def _network_address() -> str | None:
    """An address of this machine other than loopback, or None (then the network tests skip)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _stop(served) -> str:
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(60) == 0
    return served.log()


def test_serving_the_network_without_a_key_warns_and_the_machine_name_is_a_host(engine_folder, tmp_path):
    with serve_command(engine_folder, tmp_path / "log.txt", host="0.0.0.0") as served:
        name = socket.gethostname()
        assert httpx.get(f"{served.url}/v1/models", headers={"Host": f"{name}:80"}).status_code == 200
        assert httpx.get(f"{served.url}/v1/models", headers={"Host": "evil.example"}).status_code == 400
        address = _network_address()
        if address is not None:  # from the network's side
            port = served.url.rsplit(":", 1)[1]
            assert httpx.get(f"http://{address}:{port}/v1/models", timeout=30).status_code == 200
        log = _stop(served)
    assert "WARNING: listening on 0.0.0.0 with no API key" in log and "--api-key" in log


def test_the_key_from_the_environment_protects_the_api_and_silences_the_warning(engine_folder, tmp_path):
    env = {**os.environ, "MINILLM_API_KEY": KEY}
    with serve_command(engine_folder, tmp_path / "log.txt", host="0.0.0.0", env=env) as served:
        assert httpx.get(f"{served.url}/v1/models").status_code == 401
        assert httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{served.url}/").status_code == 200
        log = _stop(served)
    assert "WARNING" not in log and KEY not in log  # (the key is never printed)


def test_loopback_does_not_warn_and_cli_options_reach_the_server(engine_folder, tmp_path):
    with serve_command(engine_folder, tmp_path / "log.txt", "--api-key", KEY, "--cors-origin",
                       f"{APP_ORIGIN},http://b.example", "--cors-origin", "http://c.example",
                       "--allowed-hosts", "myhost.lan,other.lan") as served:
        auth = {"Authorization": f"Bearer {KEY}"}
        for origin in (APP_ORIGIN, "http://b.example", "http://c.example"):
            response = httpx.get(f"{served.url}/v1/models", headers={**auth, "Origin": origin})
            assert response.headers["access-control-allow-origin"] == origin
        assert httpx.get(f"{served.url}/v1/models", headers={**auth, "Origin": "http://d.example"}).status_code == 403
        for host in ("myhost.lan", "other.lan:1"):
            assert httpx.get(f"{served.url}/v1/models", headers={**auth, "Host": host}).status_code == 200
        log = _stop(served)
    assert "WARNING" not in log and KEY not in log
