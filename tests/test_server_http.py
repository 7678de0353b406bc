"""The server client's HTTP layer (rollout/server_backend/http.py) against a real HTTP server on 127.0.0.1 (the standard
library's): a server that comes up late is found again, errors name the URL and the request, /metrics is parsed."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from vllm_testing import free_port

from rollout.server_backend.http import ServerClient, ServerError

METRICS = """# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 180.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
process_start_time_seconds 1.7964e+09
"""


KEY = "k3y"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/keyed":
            self._reply(200 if self.headers.get("Authorization") == f"Bearer {KEY}" else 401, '{"error": "no key"}')
        elif self.path == "/metrics":
            self._reply(200, METRICS, "text/plain")
        elif self.path == "/slow":
            time.sleep(2)
            self._reply(200, "{}")
        else:
            self._reply(200, json.dumps({"path": self.path}))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._reply(500 if body.get("fail") else 200, json.dumps({"error": "boom"} if body.get("fail") else body))

    def _reply(self, status: int, text: str, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the timed-out client of /slow has gone: writing its answer fails, as it should


class Serve:
    """An HTTP server on `port`, listening from delay_s seconds on (a thread); stop() closes it."""

    def __init__(self, port: int, delay_s: float = 0.0):
        self.server = None
        self.thread = threading.Thread(target=self._run, args=(port, delay_s), daemon=True)
        self.thread.start()

    def _run(self, port: int, delay_s: float) -> None:
        time.sleep(delay_s)
        self.server = QuietServer(("127.0.0.1", port), Handler)
        self.server.serve_forever()

    def stop(self) -> None:
        while self.server is None:
            time.sleep(0.05)
        self.server.shutdown()
        self.server.server_close()


def test_a_server_that_comes_up_late_is_found_again():
    port = free_port()
    client = ServerClient(f"http://127.0.0.1:{port}", timeout_s=5, reconnect_s=20)
    server = Serve(port, delay_s=1.5)
    try:
        assert client.post("/echo", {"x": 1}) == {"x": 1}
        assert client.num_reconnects >= 1
    finally:
        server.stop()


def test_errors_name_the_url_and_the_request():
    port = free_port()
    server = Serve(port)
    try:
        client = ServerClient(f"http://127.0.0.1:{port}", timeout_s=0.5, reconnect_s=1)
        with pytest.raises(ServerError, match=rf"POST http://127.0.0.1:{port}/v1/x \(sample 3\) -> HTTP 500: .*boom"):
            client.post("/v1/x", {"fail": True}, "sample 3")
        with pytest.raises(ServerError, match=r"GET .*/slow: no answer within 0 s"):
            client.get("/slow")
        assert client.metrics() == {
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}': 180.0,
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"}': 7.0,
            "process_start_time_seconds": 1.7964e9}
    finally:
        server.stop()
    with pytest.raises(ServerError, match=rf"GET http://127.0.0.1:{port}/v1/models: cannot reach the server for 1 s"):
        client.get("/v1/models")
    with pytest.raises(ValueError, match="base_url='127.0.0.1:8000'"):
        ServerClient("127.0.0.1:8000")


def test_the_key_goes_with_every_request_and_a_401_says_how_to_pass_it():
    port = free_port()
    server = Serve(port)
    try:
        assert ServerClient(f"http://127.0.0.1:{port}", api_key=KEY).get("/keyed") == {"error": "no key"}
        for client in (ServerClient(f"http://127.0.0.1:{port}"), ServerClient(f"http://127.0.0.1:{port}", api_key="x")):
            with pytest.raises(ServerError, match=r"(?s)HTTP 401.*wants an API key: pass .*server_kwargs=\{'api_key'"):
                client.get("/keyed")
    finally:
        server.stop()
    with pytest.raises(ValueError, match="api_key=''"):
        ServerClient("http://127.0.0.1:1", api_key="")
