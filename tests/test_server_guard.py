"""The rollout server's gate (rollout/vllm_backend/guard.py) as an ASGI middleware in front of a small ASGI app that
records what reaches it: the key on every route but /health, the RPC allowlist with its folders, /server_info
filtered. tests/test_vllm_server_access.py checks the same against a running `rollout serve`."""

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from rollout.vllm_backend.guard import ServerGuard, api_keys, check_rpc, server_info
from rollout.vllm_backend.wire import FOLDERS_ENV, SERVED

KEY = "s3cret"


class App:
    """The app behind the gate: answers 200 with what it received (or `answer` for /server_info)."""

    def __init__(self, api_key=None):
        self.state = SimpleNamespace(args=SimpleNamespace(api_key=api_key))
        self.received = []

    async def __call__(self, scope, receive, send):
        body = (await receive()).get("body", b"")
        self.received.append((scope["path"], body))
        answer = json.dumps({"vllm_config": {"model_config": {"dtype": "float32", "hf_token": "tok"},
                                             "scheduler_config": {"max_num_seqs": 8}},
                             "vllm_env": {"VLLM_X": "1"}, "system_env": {"HOME": "/root"}}).encode() \
            if scope["path"] == "/server_info" else body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


def call(app, path: str, method: str = "GET", body: dict | None = None, key: str | None = None,
         kind: str = "http"):
    """(status, body) of one HTTP request through the gate; for a websocket (kind), (the close code, its reason)."""
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": kind, "path": path, "headers": headers, "app": app,
             **({"method": method} if kind == "http" else {})}  # an ASGI websocket scope has no method
    raw = json.dumps(body).encode() if body is not None else b""
    messages = iter([{"type": "http.request", "body": raw[:5], "more_body": True},
                     {"type": "http.request", "body": raw[5:], "more_body": False}])
    sent = []

    async def receive():
        return next(messages, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    asyncio.run(ServerGuard(app)(scope, receive, send))
    if kind == "websocket" and sent and sent[0]["type"] == "websocket.close":
        return sent[0]["code"], sent[0]["reason"].encode()
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def folders(tmp_path, monkeypatch):
    made = {name: tmp_path / name for name in ("weights_dir", "history_dir")}
    for folder in made.values():
        folder.mkdir()
    monkeypatch.setenv(FOLDERS_ENV, json.dumps({k: str(v) for k, v in made.items()}))
    return made


def test_with_a_key_every_route_but_health_needs_it(folders):
    app = App(api_key=[KEY])
    for path, method in [("/v1/models", "GET"), ("/server_info", "GET"), ("/pause", "POST"), ("/metrics", "GET"),
                         ("/collective_rpc", "POST"), ("/docs", "GET"), ("/health", "POST")]:
        status, body = call(app, path, method)
        assert status == 401 and b"Authorization: Bearer" in body, path
        assert call(app, path, method, key="wrong")[0] == 401
    assert not app.received  # nothing refused reached the app
    assert call(app, "/health")[0] == 200 and call(app, "/v1/models", key=KEY)[0] == 200


def test_a_websocket_without_the_key_is_closed_before_it_reaches_the_app(folders):
    app = App(api_key=[KEY])
    for path in ("/v1/realtime", "/health", "/collective_rpc"):
        code, reason = call(app, path, kind="websocket")
        assert code == 1008 and b"API key" in reason, path  # 1008: policy violation, answered as HTTP 403
    assert not app.received
    assert call(app, "/v1/realtime", key=KEY, kind="websocket")[0] == 200 and len(app.received) == 1


@pytest.mark.parametrize("setting", [{"api_key": [""]}, {"api_key": ""}, {"api_key": [KEY, " "]},
                                     {"env": ""}, {"env": " padded "}])
def test_an_empty_key_is_a_broken_setting_that_refuses_everything(folders, monkeypatch, setting):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if "env" in setting:
        monkeypatch.setenv("VLLM_API_KEY", setting["env"])
    app = App(api_key=setting.get("api_key"))
    for path, method, key in [("/pause", "POST", None), ("/health", "GET", None), ("/v1/models", "GET", ""),
                              ("/v1/models", "GET", KEY)]:
        status, body = call(app, path, method, key=key)
        assert status == 500 and b"is not an API key" in body, (path, key)
    assert not app.received


def test_api_keys_is_the_one_rule_for_has_a_key():
    assert api_keys(None, {}) == [] and api_keys(None, {"VLLM_API_KEY": KEY}) == [KEY]
    assert api_keys([KEY], {"VLLM_API_KEY": "other"}) == [KEY] and api_keys(KEY, {}) == [KEY]  # as vLLM: flag first
    for given, environ, named in [([""], {}, "--api-key"), (None, {"VLLM_API_KEY": ""}, "VLLM_API_KEY"),
                                  (["\t"], {}, "--api-key"), ([None], {}, "--api-key")]:
        with pytest.raises(ValueError, match=f"{named}=.* is not an API key: a key is a non-empty string"):
            api_keys(given, environ)


def test_the_key_from_the_environment_when_the_server_has_no_flag(folders, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert call(App(), "/pause", "POST")[0] == 401 and call(App(), "/pause", "POST", key=KEY)[0] == 200
    monkeypatch.delenv("VLLM_API_KEY")
    assert call(App(), "/pause", "POST")[0] == 200  # no key anywhere: the gate keeps only its RPC and info rules


def test_only_the_clients_rpcs_with_paths_inside_the_servers_folders(folders, tmp_path):
    app = App(api_key=[KEY])
    inside = str(folders["history_dir"] / "h.npz")
    status, _ = call(app, "/collective_rpc", "POST", {"method": "save_rollout_history", "kwargs": {"path": inside}},
                     key=KEY)
    assert status == 200 and json.loads(app.received[-1][1])["kwargs"]["path"] == inside  # the body reaches vLLM
    os.symlink(tmp_path, folders["history_dir"] / "out")
    refused = {
        "execute_model": {"method": "execute_model", "kwargs": {}},
        "not one this server runs": {"method": "__init__"},
        "history_dir": {"method": "save_rollout_history", "kwargs": {"path": str(tmp_path / "x.npz")}},
        "is not inside": {"method": "load_rollout_history",
                          "kwargs": {"path": str(folders["history_dir"] / ".." / "x.npz")}},
        "out/x.npz": {"method": "save_rollout_history", "kwargs": {"path": str(folders["history_dir"] / "out/x.npz")}},
        "weights_dir": {"method": "reload_weights", "kwargs": {"weights_path": str(folders["history_dir"])}},
        "exactly the kwargs": {"method": "reload_weights", "kwargs": {"weights_path": str(folders["weights_dir"]),
                                                                      "weights_iterator": "x"}},
        "positional": {"method": "repack_tied_lm_head", "args": ["x"]},
    }
    for reason, body in refused.items():
        status, answer = call(app, "/collective_rpc", "POST", body, key=KEY)
        assert status == 403 and reason in json.loads(answer)["error"]["message"], (reason, answer)
    assert len(app.received) == 1


def test_server_info_holds_only_what_the_client_reads(folders):
    status, body = call(App(), "/server_info")
    info = json.loads(body)
    assert status == 200 and "vllm_env" not in info and "system_env" not in info and b"tok" not in body
    assert info["vllm_config"] == {"model_config": {"dtype": "float32"}, "scheduler_config": {"max_num_seqs": 8}}
    assert info["rollout_server"] == {k: str(v) for k, v in folders.items()}
    assert server_info({"vllm_config": "text form"}, {}) == {"vllm_config": {}, "rollout_server": {}}


def test_a_server_without_folders_refuses_every_path():
    for method, allowed in SERVED.items():
        paths = [name for name, folder in allowed.items() if folder]
        if paths:
            refusal = check_rpc(json.dumps({"method": method, "kwargs": {p: "/tmp/x" for p in paths}}).encode(), {})
            assert "none set: start the server with --" in refusal
    assert "not JSON" in check_rpc(b"{", {}) and "JSON object" in check_rpc(b"[]", {})
