"""The server's front door: which requests get in, checked before any of them is read.

A server on a laptop is reachable by more than its owner: by every web page its browser opens
(a page may send requests to ``http://127.0.0.1:8000``), and, bound to ``0.0.0.0`` on a workshop
network, by everyone on it. ``Guard``, an ASGI middleware, checks each HTTP request in this order,
and the first check that fails answers with OpenAI's error JSON and ``Connection: close`` (the
request's body is never read):

1. **Host** (400): localhost, an IP address, or a name the server was told about. This stops
   *DNS rebinding*: a page at ``http://evil.example:8000`` whose name is then re-pointed at
   127.0.0.1 can talk to the server as "same origin", but its requests still say
   ``Host: evil.example``. (An IP address in ``Host`` cannot be such a page: a page served from
   that address is this server itself.)
2. **Origin** (403): a browser names the page that sends a request; a page of another origin is
   refused unless ``cors_origins`` lists it (``--cors-origin``). Only then do responses carry
   ``Access-Control-Allow-Origin`` (and a preflight ``OPTIONS`` is answered): without it, a
   browser lets no other page read an answer.
3. **API key** (401), when one is set: every path but the chat page and ``/health`` needs
   ``Authorization: Bearer KEY``, compared in constant time.
4. **Content-Type** (415): a POST must be ``application/json``. A browser sends ``text/plain`` or
   a form from any page without asking the server first; ``application/json`` needs a CORS
   preflight, which step 2 refuses.

``uvicorn_config`` bounds what one connection can hold: its request's headers must arrive within
the request timeout (``header_deadline_protocol``: uvicorn bounds idle keep-alive connections, not
one that sends its headers a byte at a time) and fit in 16 KiB; ``read_body`` bounds the body the
same way. Not bounded: how many connections are open, and how slowly a client reads its answer.
The chat page gets a Content-Security-Policy (``page_headers``).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from minillm.serve.protocol import ApiError, clip

LOCAL_NAMES = frozenset({"localhost"})
OPEN_PATHS = frozenset({"/", "/health"})  # what an API key leaves open: the chat page asks for the key itself


@dataclass(frozen=True)
class Policy:
    """Who may use the server. ``allowed_hosts``: the names (besides localhost and IP addresses)
    a request's ``Host`` may give, ``"*"`` for any; ``cors_origins``: the other origins whose pages
    may call it (``"http://host:port"``), ``"*"`` for any; ``api_key``: the bearer key, or None."""

    allowed_hosts: frozenset[str] = frozenset()
    cors_origins: frozenset[str] = frozenset()
    api_key: str | None = None

    @classmethod
    def of(cls, allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = (),
           api_key: str | None = None) -> Policy:
        hosts = frozenset(h.strip().lower().rstrip(".") for h in allowed_hosts if h.strip())
        origins = frozenset(o.strip().lower().rstrip("/") for o in cors_origins if o.strip())
        return cls(hosts, origins, api_key or None)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names this server."""
        if "*" in self.allowed_hosts:
            return True
        name = host_name(host)
        if name is None:
            return False
        if name in LOCAL_NAMES or name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin.lower().rstrip("/") in self.cors_origins

    def key_matches(self, authorization: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())


def host_name(host: str | None) -> str | None:
    """The name in a ``Host`` header, lower-case, without port or trailing dot; None if malformed."""
    if not host:
        return None
    host = host.strip().lower()
    if host.startswith("["):  # [v6] or [v6]:port
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        return name
    name, colon, port = host.partition(":")
    if colon and not port.isdigit():
        return None
    return name.rstrip(".") or None


def is_loopback(address: str) -> bool:
    """Whether a listening address reaches this machine only (``127.0.0.1``, ``::1``; not ``0.0.0.0``)."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _same_origin(origin: str, scheme: str, host: str | None) -> bool:
    """Whether ``Origin`` (``scheme://host[:port]``) is the server the request was sent to."""
    return host is not None and origin.lower() == f"{scheme}://{host.strip()}".lower()


def _refusal(error: ApiError, extra: dict[str, str] | None = None) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers={"Connection": "close", **(extra or {})})


class Guard:
    """The checks of the module docstring, as an ASGI middleware in front of the app."""

    def __init__(self, app: Any, policy: Policy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        cross = origin is not None and not _same_origin(origin, scope.get("scheme", "http"), headers.get("host"))
        if cross and self.policy.origin_allowed(origin):  # the opt-in: answers this page may read
            send = _with_headers(send, {"Access-Control-Allow-Origin": origin, "Vary": "Origin"})
        refusal = self.check(scope, headers, cross)
        if refusal is not None:
            await refusal(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def check(self, scope: Any, headers: Headers, cross: bool) -> Response | None:
        """The first failed check's answer (a preflight's answer too), or None to let the request in."""
        policy, host, origin = self.policy, headers.get("host"), headers.get("origin")
        if not policy.host_allowed(host):
            names = ", ".join(sorted(policy.allowed_hosts)) or "none"
            return _refusal(ApiError(400, f"the Host header {clip(repr(host), 100)} is not a name of this server "
                                          f"(allowed: localhost, IP addresses, {names}; add a name with "
                                          "--allowed-hosts)", code="invalid_host"))
        if cross:
            assert origin is not None
            if not policy.origin_allowed(origin):
                return _refusal(ApiError(403, f"cross-origin requests from {clip(repr(origin), 100)} are refused "
                                              "(allow a web page's origin with --cors-origin)",
                                         code="cross_origin_refused"))
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # a preflight
                return Response(status_code=204, headers={
                    "Access-Control-Allow-Methods": "GET, POST", "Access-Control-Max-Age": "600",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type"})
        if policy.api_key is not None and scope["path"] not in OPEN_PATHS \
                and not policy.key_matches(headers.get("authorization")):
            said = "an incorrect API key" if "authorization" in headers else "no API key"
            return _refusal(ApiError(401, f"this server needs an API key: the request gave {said} (send "
                                          "the header Authorization: Bearer KEY)", code="invalid_api_key"),
                            {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            media = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != "application/json":
                got = repr(headers["content-type"]) if "content-type" in headers else "none"
                return _refusal(ApiError(415, f"the request body must be JSON, sent with Content-Type: "
                                              f"application/json (got {clip(got, 100)})",
                                         code="unsupported_media_type"))
        return None


def _with_headers(send: Any, extra: dict[str, str]) -> Any:
    """``send`` that adds ``extra`` to the response's headers."""
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]

    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *raw]}
        await send(message)

    return wrapped


def uvicorn_config(app: Any, log_level: str = "info", request_timeout: float = 30.0,
                   **options: Any) -> uvicorn.Config:
    """How uvicorn serves the app: logs on stderr (the CLI keeps stdout for results), a request's
    headers within ``request_timeout`` seconds, 16 KiB of headers at most (h11's limit), an idle
    keep-alive connection closed after 5 s, and at most 1 s of waiting for connections on shutdown
    (``Server.shutdown`` has ended the requests by then)."""
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["handlers"]["access"]["stream"] = "ext://sys.stderr"
    settings: dict[str, Any] = {"log_level": log_level, "log_config": logs, "timeout_keep_alive": 5,
                                "http": header_deadline_protocol(request_timeout),
                                "h11_max_incomplete_event_size": 16 * 1024, "timeout_graceful_shutdown": 1}
    return uvicorn.Config(app, **{**settings, **options})


def header_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all
    arrived ``seconds`` after it opened or after its previous response ended. (uvicorn closes a
    keep-alive connection idle for ``timeout_keep_alive``, but the first byte of a request stops
    that clock, and a client may send the rest a byte at a time.)"""

    class HeaderDeadline(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            # IDLE: no request line and headers parsed since the clock started.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def page_headers(page: str) -> dict[str, str]:
    """The chat page's headers. Its Content-Security-Policy lets only its own inline script and
    style run (named by their hashes), lets it talk to this server only and load nothing else; and
    no other page may frame it (clickjacking)."""
    without_comments = re.sub(r"<!--.*?-->", "", page, flags=re.DOTALL)

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", without_comments, flags=re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    policy = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
              "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}
