"""backend="server" with two servers (`base_url=[a, b]`, rollout/server_backend/backend.py): each prompt's group runs on the
server its token ids hash to, every sample comes back in order and equals the embedded engine's (greedy); a server
that is down has its prompts run on the other, and the call says so; a weight sync reaches both; the two histories
save as one file and load into both. Both servers run the history drafter, keyed."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_testing import Server, hf_logprobs, require_vllm

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts
from rollout.server_backend.backend import route
from rollout.vllm_backend import wire
from spec.proposers.history import HistoryStore

pytestmark = require_vllm
HISTORY = {"method": "history", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 12}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    started = []
    try:
        for name in ("a", "b"):
            started.append(Server(["--model", "default", "--speculative-config", json.dumps(HISTORY),
                                   "--max-model-len", "256", "--max-num-seqs", "32",
                                   "--weights-dir", str(root / "weights"), "--history-dir", str(root / name)],
                                  root / f"{name}.log", api_key="pool-key"))
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def pool(servers):
    return RolloutGenerator(backend="server", base_url=[s.url for s in servers], server_kwargs={"api_key": "pool-key"})


@pytest.fixture(scope="module")
def reference():
    return RolloutGenerator("default", max_num_seqs=32)


def test_each_prompt_runs_on_its_server_and_every_sample_comes_back(pool, servers, reference):
    prompts = default_prompts(16, seed=2)
    batch = pool.generate(prompts, 2, GREEDY, use_tqdm=False)
    expected = reference.generate(prompts, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in expected.samples]
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(i, j) for i in range(16) for j in range(2)]
    routed = [route(s.prompt_ids, 2) for s in batch.samples]
    assert batch.stats["rows_per_server"] == {servers[0].url: routed.count(0), servers[1].url: routed.count(1)}
    assert 0 < routed.count(0) < 32 and batch.stats["skipped_servers"] == []
    assert batch.metrics["spec/server_load_imbalance"] == max(routed.count(0), routed.count(1)) / 16


def test_a_weight_sync_reaches_every_server(pool):
    target = default_model_paths()["target"]
    original = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    pool.load_weights(model.named_parameters())
    try:
        batch = pool.generate(default_prompts(16, seed=6), 1, GREEDY, use_tqdm=False)
        assert all(n > 0 for n in batch.stats["rows_per_server"].values())  # both servers answered
        for sample in batch.samples:
            expected = hf_logprobs(model.eval(), sample.prompt_ids, sample.completion_ids, GREEDY)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    finally:
        pool.load_weights(original.named_parameters())


def test_the_servers_histories_save_as_one_file_and_load_into_each(pool, tmp_path):
    prompts = default_prompts(8, seed=8)
    pool.generate(prompts, 2, GREEDY, use_tqdm=False)
    # vLLM's V1 runner tells the project's proposer that a call's requests finished at the next call's first step
    pool.generate(default_prompts(8, seed=9), 1, GREEDY, use_tqdm=False)
    pool.rollout_history.save(tmp_path / "job.npz")
    store = HistoryStore()
    store.load(tmp_path / "job.npz")
    ids = [pool.tokenizer(p)["input_ids"] for p in prompts]
    assert all(store.outputs(p) for p in ids)  # prompts of both servers in the one file
    pool.rollout_history.load(tmp_path / "job.npz")
    for i, server in enumerate(pool.backend.servers):  # each server loaded its own prompts' share only
        part = server.history_file()
        server.rpc(wire.SAVE_HISTORY, {"path": part}, "save one server's history")
        held = HistoryStore()
        held.load(part)
        os.remove(part)
        assert [bool(held.outputs(p)) for p in ids] == [route(p, len(pool.backend.servers)) == i for p in ids]
    with pytest.raises(ValueError, match="not a readable rollout history"):
        (tmp_path / "bad.npz").write_bytes(b"nope")
        pool.rollout_history.load(tmp_path / "bad.npz")


def test_a_server_that_is_down_has_its_prompts_run_on_the_next(pool, servers, reference):
    """Last: server b stops; its prompts run on a (the next in the list, wrapping around), and the call says so."""
    servers[1].stop()
    prompts = default_prompts(12, seed=4)
    with pytest.warns(RuntimeWarning, match=rf"servers skipped \(down\): \['{servers[1].url}'\]"):
        batch = pool.generate(prompts, 1, GREEDY, use_tqdm=False)
    expected = reference.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in expected.samples]
    assert batch.stats["skipped_servers"] == [servers[1].url]
    assert batch.stats["rows_per_server"] == {servers[0].url: 12, servers[1].url: 0}
    assert any(route(s.prompt_ids, 2) == 1 for s in batch.samples)  # some were b's
