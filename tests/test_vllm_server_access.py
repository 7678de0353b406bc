"""A keyed `python -m rollout serve` admits its trainers only (rollout/vllm_backend/guard.py): every route the
running app has refuses a request without the key except /health; with the key, RPCs outside the client's and paths
outside the server's folders are refused and nothing is written; /server_info holds no environment; a client
without the key gets a clear error. The other server tests (test_vllm_server*.py) run their servers keyed too."""

import json
import os
import re
import urllib.error
import urllib.request

import pytest
from vllm_testing import Server, require_vllm

from rollout import RolloutGenerator
from rollout.server_http import ServerError
from rollout.vllm_backend.serve import build_command

pytestmark = require_vllm
SECRET = "do-not-leak-3141"  # in the server's environment only
ARGS = ["--model", "default", "--speculative-config", json.dumps({"method": "history", "num_speculative_tokens": 2}),
        "--max-model-len", "128", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("access")
    args = [*ARGS, "--weights-dir", str(root / "weights"), "--history-dir", str(root / "history")]
    server = Server(args, root / "server.log", env={"ROLLOUT_TEST_SECRET": SECRET})
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


def app_routes(server, monkeypatch) -> set[tuple[str, str]]:
    """(method, path) of every route of the server's app: vLLM's own build_app on the argv `rollout serve` ran,
    checked against the running server's OpenAPI schema (which leaves out routes such as /docs and /metrics)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    args, env = build_command(server.args, is_cpu=True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(args), supported_tasks=("generate",))
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
