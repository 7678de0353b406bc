"""HTTP to a vLLM OpenAI server with the standard library: JSON requests with clear errors, bounded reconnection, and
the Prometheus counters of /metrics.

Errors name the URL and the request. An HTTP error status is a ServerError at once (the server answered: retrying would
not change its answer); a 401 says the server wants a key and how to pass one. With an API key every request carries
`Authorization: Bearer <key>`. A connection that cannot be made or breaks (server down, restarting, not up yet) is
retried with exponential backoff for up to `reconnect_s` seconds, then a ServerError. A request that gets no answer
within `timeout_s` is a ServerError (the server may still be running it; it is not sent again).
"""

import http.client
import json
import re
import time
import urllib.error
import urllib.request

_BACKOFF_S = (0.25, 8.0)  # first wait and the longest one between reconnection attempts
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


class ServerError(RuntimeError):
    """A request to the server failed; the message names the URL, the request and the server's answer. status: the
    answer's HTTP status, None where there was no answer."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerUnreachable(ServerError):
    """No connection to the server could be made, or kept, for reconnect_s: it is down (another server can take
    its requests)."""


class ServerClient:
    """base_url: e.g. "http://127.0.0.1:8000". timeout_s: the longest wait for one answer. reconnect_s: how long a
    request keeps retrying a connection that cannot be made or breaks. api_key: the server's key (None: none)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, reconnect_s: float = 120.0,
                 api_key: str | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r}: expected the server's URL, e.g. 'http://127.0.0.1:8000'")
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.reconnect_s = timeout_s, reconnect_s
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError(f"api_key={api_key!r}: expected the server's key, a non-empty string (or None for a "
                             "server without one)")
        self._headers = {"Content-Type": "application/json",
                         **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.num_reconnects = 0  # connection failures recovered from, over the client's life

    def get(self, path: str, what: str = "") -> dict | str:
        return self.request("GET", path, None, what)

    def post(self, path: str, body: dict | None = None, what: str = "") -> dict | str:
        return self.request("POST", path, body, what)

    def request(self, method: str, path: str, body: dict | None, what: str = "") -> dict | str:
        """The answer's JSON (or text when it is not JSON). `what` describes the request in errors."""
        url = self.base_url + path
        label = f"{method} {url}" + (f" ({what})" if what else "")
        deadline, wait = time.monotonic() + self.reconnect_s, _BACKOFF_S[0]
        while True:
            try:
                return self._send(method, url, body)
            except urllib.error.HTTPError as e:
                raise ServerError(f"{label} -> HTTP {e.code}: {_text(e)[:1000]}{_hint(e.code)}", e.code) from None
            except TimeoutError:
                raise ServerError(f"{label}: no answer within {self.timeout_s:.0f} s (request_timeout_s); the server "
                                  "may be overloaded or stuck") from None
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                if time.monotonic() + wait > deadline:
                    raise ServerUnreachable(f"{label}: cannot reach the server for {self.reconnect_s:.0f} s ({e}); is it "
                                      "running? (python -m rollout serve --model FOLDER ... starts one)") from None
                time.sleep(wait)
                wait = min(2 * wait, _BACKOFF_S[1])
                self.num_reconnects += 1

    def is_up(self, timeout_s: float) -> bool:
        """Whether GET /health answers 200 within timeout_s (one try, no reconnection)."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout_s) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):  # URLError, HTTPError, timeouts and resets are OSErrors
            return False

    def metrics(self) -> dict[str, float]:
        """/metrics as {name + labels: value} for every sample line (Prometheus text format)."""
        values = {}
        for line in self.get("/metrics", "Prometheus counters").splitlines():
            match = _METRIC_LINE.match(line)
            if match and not line.startswith("#"):
                values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
        return values

    def _send(self, method: str, url: str, body: dict | None) -> dict | str:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=self._headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            text = response.read().decode()
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:
            return text


def _hint(status: int) -> str:
    if status != 401:
        return ""
    return ("\nThe server wants an API key: pass RolloutGenerator(backend='server', ..., server_kwargs={'api_key': "
            "<key>}) or set VLLM_API_KEY in this process's environment, with the key the server was started with")


def _text(error: urllib.error.HTTPError) -> str:
    try:
        return error.read().decode(errors="replace")
    except OSError:
        return str(error)
