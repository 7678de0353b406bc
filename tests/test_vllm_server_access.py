"""A keyed `python -m rollout serve` admits its trainers only (rollout/vllm_backend/guard.py): every route the
running app has refuses a request without the key except /health, whatever the method (HEAD and OPTIONS too), the
spelling of the path (trailing or double slash, case, percent-encoding) or the protocol (websockets); with the key,
RPCs outside the client's and paths outside the server's folders are refused and nothing is written, under every
spelling of the path; /server_info holds no environment; the key, given on the launcher's command line, reaches no
process's argv; a client without the key gets a clear error. The other server tests (test_vllm_server*.py) run their
servers keyed too."""

import asyncio
import http.client
import json
import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote

import pytest
from vllm_testing import Server, require_vllm

from rollout import RolloutGenerator
from rollout.server_backend.http import ServerError
from rollout.vllm_backend.serve import build_command

pytestmark = require_vllm
SECRET = "do-not-leak-3141"  # in the server's environment only
ARGS = ["--model", "default", "--speculative-config", json.dumps({"method": "history", "num_speculative_tokens": 2}),
        "--max-model-len", "128", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("access")
    args = [*ARGS, "--weights-dir", str(root / "weights"), "--history-dir", str(root / "history")]
    server = Server(args, root / "server.log", env={"ROLLOUT_TEST_SECRET": SECRET}, key_in_argv=True)
    server.root, server.args = root, args
    yield server
    server.stop()


def send(server, path: str, method: str = "GET", body: dict | None = None, key: str | None = None):
    """(status, body text) of one request to the server."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def send_raw(server, path: str, method: str = "GET", body: dict | None = None, key: str | None = None):
    """(status, body text) of one request with `path` sent as it is written (no normalising, no redirects)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(method, path, None if body is None else json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def build_server_app(server, monkeypatch):
    """vLLM's own build_app on the argv and environment `rollout serve` ran (the gate among its middleware)."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    args, env = build_command(server.args, is_cpu=True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_API_KEY", server.api_key)
    return build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(args), supported_tasks=("generate",))


def app_routes(server, monkeypatch) -> set[tuple[str, str]]:
    """(method, path) of every route of the server's app: vLLM's own build_app on the argv `rollout serve` ran,
    checked against the running server's OpenAPI schema (which leaves out routes such as /docs and /metrics)."""
    app = build_server_app(server, monkeypatch)
    routes = {(method, route.path) for route in app.routes for method in (getattr(route, "methods", None) or {"GET"})}
    status, schema = send(server, "/openapi.json", key=server.api_key)
    served = {(m.upper(), p) for p, ops in json.loads(schema)["paths"].items() for m in ops}
    assert status == 200 and served <= routes and len(routes) > len(served), served - routes
    return routes


def test_every_route_but_health_needs_the_key(server, monkeypatch):
    routes = app_routes(server, monkeypatch)
    assert {("POST", "/collective_rpc"), ("GET", "/server_info"), ("POST", "/pause"), ("GET", "/metrics")} <= routes
    admitted = {}
    for method, path in sorted(routes):
        url_path = re.sub(r"\{[^}]*\}", "x", path)
        status, _ = send(server, url_path, method, {} if method in ("POST", "PUT") else None)
        if status != 401:
            admitted[(method, path)] = status
    assert admitted == {("GET", "/health"): 200}
    assert send(server, "/v1/models", key="wrong")[0] == 401 and send(server, "/v1/models", key=server.api_key)[0] == 200


def test_rpcs_and_paths_outside_the_clients_are_refused(server):
    history = server.root / "history"
    outside = server.root / "outside.npz"
    (history / "link").symlink_to(server.root)
    for body, reason in [
        ({"method": "save_rollout_history", "kwargs": {"path": str(outside)}}, "is not inside the server's history_dir"),
        ({"method": "save_rollout_history", "kwargs": {"path": str(history / ".." / "outside.npz")}}, "is not inside"),
        ({"method": "save_rollout_history", "kwargs": {"path": str(history / "link" / "outside.npz")}}, "not inside"),
        ({"method": "reload_weights", "kwargs": {"weights_path": str(history)}}, "weights_dir"),
        ({"method": "sampler_fix_applied"}, "method 'sampler_fix_applied' is not one this server runs"),
    ]:
        status, text = send(server, "/collective_rpc", "POST", body, key=server.api_key)
        assert status == 403 and reason in text, (body, text)
    assert not outside.exists()
    inside = history / "h.npz"
    status, text = send(server, "/collective_rpc", "POST", {"method": "save_rollout_history",
                                                            "kwargs": {"path": str(inside)}}, key=server.api_key)
    assert status == 200 and inside.exists(), text  # the allowlist admits what the client runs


def test_server_info_holds_no_environment(server):
    status, text = send(server, "/server_info?config_format=json", key=server.api_key)
    info = json.loads(text)
    assert status == 200 and SECRET not in text and server.api_key not in text
    assert set(info) == {"vllm_config", "rollout_server"} and "vllm_env" not in text and "system_env" not in text
    assert info["rollout_server"]["weights_dir"] == str(server.root / "weights")


def test_the_client_needs_the_key_and_says_how_to_pass_it(server, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ServerError, match=r"(?s)/v1/models.*HTTP 401.*wants an API key"):
        RolloutGenerator(backend="server", base_url=server.url)
    client = RolloutGenerator(**server.client_kwargs)
    assert client.backend.servers[0].weights_dir == server.root / "weights"  # the server's own folder, read from it
    with pytest.raises(ValueError, match="is not inside the weights_dir of the server"):
        RolloutGenerator(backend="server", base_url=server.url,
                         server_kwargs={"api_key": server.api_key, "weights_dir": str(server.root / "elsewhere")})
    assert os.environ.get("VLLM_API_KEY") is None


GUARDED = ("/collective_rpc", "/server_info", "/pause", "/health")


def spellings(path: str) -> list[str]:
    """Other spellings of `path` that a router might take for it: trailing and double slashes, case, percent-encoding
    of a letter and of the slash, a dot segment."""
    name = path.lstrip("/")
    return [f"{path}/", f"/{path}", path.upper(), path.title(), f"/%{ord(name[0]):02X}{name[1:]}",
            path.replace("_", "%5F"), f"{path}%2F", f"/.{path}", f"/v1/..{path}", f"{path}?x=1"]


def test_every_spelling_of_a_guarded_route_needs_the_key(server):
    admitted = {}
    for path in (p for route in GUARDED for p in spellings(route)):
        for method in ("GET", "POST", "HEAD", "OPTIONS"):
            status, _ = send_raw(server, path, method, {} if method == "POST" else None)
            if status != 401:
                admitted[(method, path)] = status
    # admitted: only GET and HEAD of what the server decodes to /health itself (a query, %68ealth), none refused
    assert {unquote(path.partition("?")[0]) for _, path in admitted} == {"/health"}, admitted
    assert {method for method, _ in admitted} == {"GET", "HEAD"} and ("GET", "/health?x=1") in admitted


def test_with_the_key_no_spelling_reaches_an_rpc_outside_the_clients(server):
    outside = server.root / "spelled.npz"
    bodies = [{"method": "save_rollout_history", "kwargs": {"path": str(outside)}}, {"method": "sampler_fix_applied"}]
    for path in spellings("/collective_rpc"):
        for body in bodies:
            status, text = send_raw(server, path, "POST", body, key=server.api_key)
            assert status != 200 and "results" not in text, (path, body, status, text)
    assert not outside.exists()
    for path in spellings("/server_info"):
        status, text = send_raw(server, path, "GET", key=server.api_key)
        assert SECRET not in text and server.api_key not in text and "system_env" not in text, (path, status)


def test_head_and_options_on_every_route_need_the_key(server, monkeypatch):
    admitted = {}
    for _, path in sorted(app_routes(server, monkeypatch)):
        for method in ("HEAD", "OPTIONS"):
            status, _ = send(server, re.sub(r"\{[^}]*\}", "x", path), method)
            if status != 401:
                admitted[(method, path)] = status
    assert set(admitted) == {("HEAD", "/health")}  # the gate's one open route (vLLM's own route answers 405)


def test_a_websocket_without_the_key_is_refused(server, monkeypatch):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:  # the running server
        sock.sendall(f"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
                     "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 403")
    app = build_server_app(server, monkeypatch)  # the same app in process: who refused it, the gate or the router

    def first_message(path: str, key: str | None) -> dict:
        sent = []
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        scope = {"type": "websocket", "path": path, "raw_path": path.encode(), "headers": headers, "query_string": b"",
                 "root_path": "", "scheme": "ws", "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 1)}

        async def receive():
            return {"type": "websocket.connect"}

        async def record(message):
            sent.append(message)

        asyncio.run(app(scope, receive, record))
        return sent[0]

    for path in ("/v1/realtime", "/health", "/collective_rpc"):
        refused = first_message(path, None)
        assert refused["type"] == "websocket.close" and refused["code"] == 1008 and "API key" in refused["reason"]
    assert first_message("/v1/realtime", server.api_key)["code"] != 1008  # with the key it reaches the router


def test_the_key_reaches_no_process_argv(server):
    """The fixture passed the key as --api-key to the launcher: the launcher moved it into vLLM's environment."""
    session = [pid for pid in os.listdir("/proc") if pid.isdigit() and _session_of(pid) == server.process.pid]
    cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in session}
    assert len(cmdlines) >= 2 and any(b"vllm.entrypoints.openai.api_server" in c for c in cmdlines.values())
    assert not [pid for pid, cmdline in cmdlines.items() if server.api_key.encode() in cmdline]
    assert any(f"VLLM_API_KEY={server.api_key}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
               for pid in session)


def _session_of(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[3])
    except (OSError, IndexError, ValueError):
        return None
