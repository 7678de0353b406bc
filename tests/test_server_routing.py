"""The server backend's routing (rollout/server_backend/backend.py, `route`): the server a prompt runs on is a function of
its token ids alone, the same in every process and run, and spreads prompts evenly; and the checks on base_url."""

import os
import random
import subprocess
import sys

import pytest

from rollout.server_backend.backend import _urls, route


def test_a_prompt_routes_to_the_same_server_in_every_process():
    prompts = [[1, 20, 17, 18], [1, 20, 17, 9, 9], [5]]
    here = [route(p, 3) for p in prompts]
    code = f"from rollout.server_backend.backend import route; print([route(p, 3) for p in {prompts!r}])"
    # Python's own bytes hashing is salted per process (this one's seed is random): routing must not use it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == str(here), out.stderr[-2000:]
    assert route([1, 20, 17, 18], 1) == 0


def test_prompts_spread_evenly_over_the_servers():
    rng = random.Random(0)
    prompts = {tuple(rng.randrange(28) for _ in range(rng.randrange(5, 30))) for _ in range(4000)}
    for num_servers in (2, 3, 8):
        counts = [0] * num_servers
        for prompt in prompts:
            counts[route(list(prompt), num_servers)] += 1
        expected = len(prompts) / num_servers
        # binomial standard deviation is under 45 here: 5 of them is far beyond chance for a fair hash
        assert all(abs(c - expected) < 5 * (expected * (1 - 1 / num_servers)) ** 0.5 for c in counts), counts


def test_base_url_is_a_url_or_a_list_of_distinct_urls():
    assert _urls("http://a:1") == ["http://a:1"] and _urls(["http://a:1", "http://b:1"]) == ["http://a:1", "http://b:1"]
    for bad in ([], ["http://a:1", "http://a:1"], 5, [1]):
        with pytest.raises(ValueError, match="base_url=.*expected a server's URL or a list of distinct URLs"):
            _urls(bad)
