"""``tpflexctl``'s HTTP client (httpx): JSON calls with the bearer token, ``--cacert``,
cursor pagination, and the console's event stream for ``--watch``."""

from __future__ import annotations

import json
import ssl
import urllib.parse
from collections.abc import Iterator

import httpx

PAGE = 1000  # items per request when a list is read page by page


class CliError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ProtocolError(CliError):
    """The server answered something tpflexctl cannot read (a stream message that is not
    JSON, or not of the documented shape): exit 1 like a 5xx; ``--watch`` does not
    reconnect on it (the next stream would say the same)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1)


class Client:
    def __init__(self, url: str, token: str | None, timeout: float, cacert: str | None = None) -> None:
        bad = CliError(f"invalid --url {url!r}: expected http(s)://host:port", 2)
        try:
            parsed = urllib.parse.urlsplit(url)
            parsed.port  # noqa: B018 -- raises ValueError for a port that is not a number
            if parsed.hostname:
                parsed.hostname.encode("idna")  # a label over 63 characters, for one
        except (ValueError, UnicodeError):
            raise bad from None
        if parsed.scheme not in ("http", "https") or not parsed.netloc or not parsed.hostname:
            raise bad
        if cacert is not None and parsed.scheme != "https":
            raise CliError(f"--cacert is for https URLs; --url is {url!r}", 2)
        self.base = url.rstrip("/")
        self.token = token
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            verify = ssl.create_default_context(cafile=cacert) if cacert else True
        except (OSError, ValueError, ssl.SSLError) as exc:  # unreadable or malformed CA file
            raise CliError(f"cannot use --cacert {cacert}: {exc}", 2) from None
        try:
            self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout, verify=verify)
        except (httpx.InvalidURL, ValueError):
            raise bad from None

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None):
        return self._send(method, path, body, query).json()

    def _send(self, method: str, path: str, body: dict | None, query: dict | None) -> httpx.Response:
        params = {k: v for k, v in (query or {}).items() if v is not None}
        try:
            resp = self.http.request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach the tpflex controller at {self.base}: {_reason(exc)}", 1) from None
        if resp.status_code >= 400:
            raise http_error(resp)
        try:
            resp.json()
        except ValueError as exc:
            raise CliError(f"the server at {self.base} sent a response that is not JSON: {exc}", 1) from None
        return resp

    def pages(self, path: str, query: dict | None = None, limit: int | None = None,
              after: str | None = None) -> tuple[list, str | None]:
        """A list endpoint read page by page: every item (or the first ``limit`` after the
        cursor ``after``) and the cursor of what follows (None at the end)."""
        items: list = []
        while True:
            size = PAGE if limit is None else min(PAGE, limit - len(items))
            resp = self._send("GET", path, None, {**(query or {}), "limit": size, "after": after})
            items += resp.json()
            after = resp.headers.get("X-Next-Cursor")
            if after is None or (limit is not None and len(items) >= limit):
                return items, after

    def stream(self, path: str) -> Iterator[tuple[str, object]]:
        """Server-sent events of ``path``: (event name, decoded data) until the server ends."""
        try:
            with self.http.stream("GET", path, headers={"Accept": "text/event-stream"},
                                  timeout=httpx.Timeout(10.0, read=60.0)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise http_error(resp)
                yield from _events(resp.iter_lines(), self.base)
        except httpx.HTTPError as exc:
            raise CliError(f"lost the stream from {self.base}: {_reason(exc)}", 1) from None


def _events(lines: Iterator[str], base: str) -> Iterator[tuple[str, object]]:
    name, data = "message", []
    for line in lines:
        if line == "":
            if data:
                try:
                    decoded = json.loads("\n".join(data))
                except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
                    raise ProtocolError(f"the server at {base} sent a {name!r} stream message that is not "
                                        f"JSON: {_reason(exc)}") from None
                yield name, decoded
            name, data = "message", []
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:300]


def http_error(resp: httpx.Response) -> CliError:
    try:
        err = resp.json()["error"]
        message = f"{err['message']} (HTTP {resp.status_code} {err['code']})"
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {resp.status_code}: {resp.text[:200] or resp.reason_phrase}"
    return CliError(message, 2 if 400 <= resp.status_code < 500 else 1)
