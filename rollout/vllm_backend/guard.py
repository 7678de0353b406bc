"""The rollout server's gate: an ASGI middleware that `python -m rollout serve` puts in front of vLLM's OpenAI server
(vLLM's `--middleware rollout.vllm_backend.guard.ServerGuard`), so that the server admits its trainers only. The
server runs in dev mode (the client needs /server_info and /collective_rpc), which also opens vLLM's RL routes, and
vLLM's own key check covers only /v1, /v2, /inference and /cohere. This gate, outermost in the app, adds:

- **the key on every route**: with a key (vLLM's `--api-key`, else VLLM_API_KEY), every request carries
  `Authorization: Bearer <key>`, on every path, method and protocol (websockets too), except `GET`/`HEAD /health`;
  otherwise 401. A key is a non-empty string (api_keys): one set but empty refuses every request (500).
- **only the client's RPCs**: `POST /collective_rpc` runs only the served worker calls (wire.SERVED) with exactly
  their keywords, a path argument inside the server's folder for it (`..` and symlinks resolved); else 403.
- **no secrets out**: /server_info answers only SERVER_INFO_FIELDS of the engine config and the server's folders.

The RPC and /server_info rules hold with or without a key. The key is read from the running app, the folders from
wire.FOLDERS_ENV (set by serve.py), at the first request. It runs in the API server's process and imports the
standard library and wire.py only.
"""

import hashlib
import json
import os
import secrets

from rollout.vllm_backend.wire import CONFIG_KEY, FOLDERS, FOLDERS_ENV, KEY_ENV, SERVED, SERVER_KEY, is_inside

# what /server_info returns of vLLM's engine config: section -> its fields kept
SERVER_INFO_FIELDS = {
    "speculative_config": ("method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"),
    "scheduler_config": ("max_num_seqs",),
    "parallel_config": ("worker_extension_cls",),
    "model_config": ("dtype", "logprobs_mode", "max_model_len"),
    "observability_config": ("per_request_spec_decode_metrics",),
    "additional_config": (CONFIG_KEY,),
}
OPEN_ROUTES = {("GET", "/health"), ("HEAD", "/health")}


class ServerGuard:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(ServerGuard)`)."""

    def __init__(self, app):
        self.app = app
        self._key_digests = None  # sha256 of each accepted key; [] when the server has none
        self._broken = None  # why every request is refused: the key setting is not a key
        self._folders = None  # FOLDERS name -> the server's folder

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        self._read_settings(scope["app"])
        if self._broken:
            return await _refuse(scope, send, 500, self._broken)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope.get("method")  # None for a websocket: no open route takes one
        if (method, path) not in OPEN_ROUTES and not self._admits(scope):
            return await _refuse(scope, send, 401, "this server needs its API key: send the header 'Authorization: "
                                                   "Bearer <key>' (RolloutGenerator: server_kwargs={'api_key': ...} "
                                                   "or VLLM_API_KEY in the environment)")
        if path == "/collective_rpc":
            body = await _read_body(receive)
            refusal = check_rpc(body, self._folders)
            if refusal:
                return await _refuse(scope, send, 403, refusal)
            receive = _replay(body)
        elif path == "/server_info":
            send = _filtered_server_info(send, self._folders)
        await self.app(scope, receive, send)

    def _read_settings(self, app) -> None:
        if self._key_digests is not None:
            return
        try:
            keys = api_keys(getattr(getattr(app.state, "args", None), "api_key", None), os.environ)
        except ValueError as e:
            keys, self._broken = [], f"the server refuses every request: {e}"
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        folders = json.loads(os.environ.get(FOLDERS_ENV) or "{}")
        self._folders = {name: folders[name] for name in FOLDERS if folders.get(name)}

    def _admits(self, scope) -> bool:
        if not self._key_digests:
            return True
        headers = dict(scope.get("headers") or ())
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        digest = hashlib.sha256(token.encode()).digest()
        matches = [secrets.compare_digest(digest, accepted) for accepted in self._key_digests]
        return scheme.lower() == "bearer" and any(matches)


def api_keys(given, environ) -> list[str]:
    """The server's keys, as vLLM reads them: those given (`--api-key`: a string or a list), else KEY_ENV's when it is
    set in `environ`, else none. A key is a non-empty string without surrounding blanks: anything else is a
    ValueError naming where it came from, so that an empty setting can never mean "no key"."""
    keys, source = ([given] if isinstance(given, str) else given, "--api-key") if given is not None else (
        [environ[KEY_ENV]] if KEY_ENV in environ else [], KEY_ENV)
    for key in keys:
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ValueError(f"{source}={key!r} is not an API key: a key is a non-empty string without surrounding "
                             f"blanks; set a real key (e.g. {KEY_ENV}=$(cat /path/to/key.file)), or unset {KEY_ENV} "
                             "and drop --api-key to serve without one on loopback")
    return list(keys)


def check_rpc(body: bytes, folders: dict[str, str]) -> str | None:
    """Why a /collective_rpc body is refused, None when it is admitted (module docstring)."""
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        return "the body is not JSON"
    if not isinstance(request, dict):
        return "the body is not a JSON object"
    method = request.get("method")
    if method not in SERVED:
        return (f"method {method!r} is not one this server runs for its clients; it runs "
                f"{', '.join(sorted(SERVED))}")
    if request.get("args"):
        return f"method {method!r}: positional args are not accepted; pass kwargs"
    kwargs, allowed = request.get("kwargs") or {}, SERVED[method]
    if not isinstance(kwargs, dict) or set(kwargs) != set(allowed):
        return f"method {method!r} takes exactly the kwargs {sorted(allowed)}, not {kwargs!r}"
    for name, folder in allowed.items():
        if folder is not None and not is_inside(kwargs[name], folders.get(folder)):
            return (f"method {method!r}: {name}={kwargs[name]!r} is not inside the server's {folder} "
                    f"({folders.get(folder) or 'none set: start the server with --' + folder.replace('_', '-')})")
    return None


def server_info(info: dict, folders: dict[str, str]) -> dict:
    """/server_info as the client reads it: SERVER_INFO_FIELDS of the engine config and the server's folders."""
    config = info.get("vllm_config")
    config = config if isinstance(config, dict) else {}
    kept = {}
    for section, fields in SERVER_INFO_FIELDS.items():
        values = config.get(section)
        if isinstance(values, dict):
            kept[section] = {name: values[name] for name in fields if name in values}
    return {"vllm_config": kept, SERVER_KEY: folders}


async def _read_body(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes):
    """A receive() that hands the app the body already read, then waits for whatever comes next (a disconnect)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive


def _filtered_server_info(send, folders: dict[str, str]):
    """A send() that buffers vLLM's /server_info answer and passes on only server_info() of it."""
    start, chunks = None, []

    async def filtered(message):
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body":
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        if start["status"] == 200:
            body = json.dumps(server_info(json.loads(body), folders)).encode()
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return filtered


async def _refuse(scope, send, status: int, reason: str) -> None:
    if scope["type"] == "websocket":  # closing before accepting answers the handshake with 403
        return await send({"type": "websocket.close", "code": 1008, "reason": reason[:120]})
    body = json.dumps({"error": {"message": reason, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
