"""backend="server": RolloutGenerator against a real vLLM OpenAI server (CPU build), started once for this module by
`python -m rollout serve` in a subprocess with the schedule `python -m rollout tune --backend vllm` printed for the
same pair (so vLLM's server must accept the tuned config as is), and stopped at the end.

The pair is the shipped default pair (the tuner must find speculation worth it, which a random tiny drafter is not);
the embedded engine and HF forwards on the same folders are the references. Rollouts stay a few tokens long.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from trainers_testing import accelerate_launch
from transformers import AutoModelForCausalLM
from vllm_testing import ROOT, Server, hf_logprobs, require_vllm

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts
from rollout.server_backend.http import ServerError

pytestmark = require_vllm
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    return {**default_model_paths(), "root": tmp_path_factory.mktemp("server")}


@pytest.fixture(scope="module")
def tuned(pair) -> dict:
    """`python -m rollout tune --backend vllm` on the pair, a small grid (its own vLLM engine, ended before the
    server starts)."""
    config = {"method": "draft_model", "model": pair["draft"], "num_speculative_tokens": 2}
    path = pair["root"] / "tuned.json"
    out = subprocess.run([sys.executable, "-m", "rollout", "tune", "--backend", "vllm", "--model", pair["target"],
                          "--speculative-config", json.dumps(config), "--max-num-seqs", "4", "--max-k", "2",
                          "--repeats", "1", "--max-tokens", "8", "--num-prompts", "4", "--output", str(path),
                          "--no-progress"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def server(pair, tuned):
    server = Server(["--model", pair["target"], "--speculative-config", json.dumps(tuned), "--max-model-len", "128",
                     "--max-num-seqs", "16"], pair["root"] / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return RolloutGenerator(**server.client_kwargs)


def _hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_client_reads_the_server_and_its_tuned_schedule(client, tuned, pair, server):
    print(f"server start-up: {server.startup_s:.1f} s")
    assert client.config.num_speculative_tokens_per_batch_size == tuned["num_speculative_tokens_per_batch_size"]
    assert client.config.num_speculative_tokens == tuned["num_speculative_tokens"]
    assert (client.max_model_len, client.max_num_seqs, client.eos_token_ids) == (128, 16, {2})
    assert client.backend.model_path == pair["target"] and client.tokenizer is not None
    batch = client.generate(["Q: 1+2\nA:\n"], 1, GREEDY, use_tqdm=False)  # one request: the schedule's K at 1
    k = client.config.schedule.k_for_batch_size(1)
    assert set(batch.samples[0].acceptance["k_per_step"]) == ({k} if k else set())


def test_samples_in_order_with_the_targets_processed_logprobs(client, pair):
    """Sampled with top-k and top-p: the server's worker has the CPU sampler fix (worker extension)."""
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, max_tokens=16)
    before = client.backend.servers[0].client.metrics()
    batch = client.generate(default_prompts(3), 2, params, use_tqdm=False)
    after = client.backend.servers[0].client.metrics()
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(i, j) for i in range(3) for j in range(2)]
    model = _hf(pair["target"])
    for sample in batch.samples:
        expected = hf_logprobs(model, sample.prompt_ids, sample.completion_ids, params)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    counted = [after[name] - before[name] for name in after if name.startswith("vllm:spec_decode_num_draft_tokens_tot")]
    assert counted == [batch.stats["num_draft_tokens"]] > [0]  # the records sum to the counters


def test_greedy_equals_the_embedded_engine_and_seeds_reproduce(client, pair, tuned, server):
    embedded = RolloutGenerator(pair["target"], speculative_config=tuned, max_num_seqs=16)
    prompts = default_prompts(4)
    ours, theirs = (g.generate(prompts, 1, GREEDY, use_tqdm=False) for g in (embedded, client))
    assert [s.completion_ids for s in theirs.samples] == [s.completion_ids for s in ours.samples]
    for a, b in zip(ours.samples, theirs.samples):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    # Seeded draws repeat where the requests batch the same way (the schedule's K, and so the draws the rejection
    # sampler consumes, follow the step's batch size): one request in flight at a time.
    serial = RolloutGenerator(backend="server", base_url=client.base_url,
                              server_kwargs={"max_concurrency": 1, "api_key": server.api_key})
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    runs = [[s.completion_ids for s in serial.generate(prompts, 2, params, use_tqdm=False).samples] for _ in range(2)]
    assert runs[0] == runs[1] and len({tuple(c) for c in runs[0]}) > 1


def test_weight_sync_is_atomic_and_reaches_the_server(client, pair):
    original = _hf(pair["target"])
    model = _hf(pair["target"])
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    assert client.load_weights(model.named_parameters()) == len(list(model.parameters()))
    bad = [(n, p.long() if n.endswith("norm.weight") else p) for n, p in original.named_parameters()]
    with pytest.raises(ValueError, match="dtype torch.int64"):
        client.load_weights(bad)
    for sample in client.generate(default_prompts(2), 1, GREEDY, use_tqdm=False).samples:  # still the perturbed
        expected = hf_logprobs(model, sample.prompt_ids, sample.completion_ids, GREEDY)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    client.load_weights(original.named_parameters())


def _greedy_acceptance(client) -> list[int]:
    """Accepted drafts of four greedy completions, one request at a time: requests sent together may share a step
    or not, depending on when each reaches the server, and the schedule's K depends on the step's batch size."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    return [client.generate([prompt], 1, params, use_tqdm=False).samples[0].acceptance["num_accepted_draft_tokens"]
            for prompt in default_prompts(4)]


def test_draft_weights_reach_the_servers_drafter(client, pair):
    original = list(_hf(pair["draft"]).named_parameters())
    accepted = _greedy_acceptance(client)
    torch.manual_seed(0)
    client.load_draft_weights([(n, 0.05 * torch.randn_like(p)) for n, p in original])
    assert sum(_greedy_acceptance(client)) < 0.5 * sum(accepted)
    client.load_draft_weights(original)
    assert _greedy_acceptance(client) == accepted


def test_server_errors_name_the_url_and_the_sample(client, server):
    with pytest.raises(ServerError, match=rf"POST {server.url}/v1/completions \(sample 0 of prompt 0.*HTTP 400"):
        client.generate([[1, 5]], 1, SamplingParams(max_tokens=500), use_tqdm=False)  # past max_model_len


def test_two_trainer_processes_share_the_server(client, server, pair, tmp_path):
    """accelerate launch, 2 processes, one server: each gets its own rows back; only the main process writes
    weights (2 target syncs, 2 drafter refreshes reach the server, not 4 and 4); afterwards the server's target is
    the policy as last synced, and its drafter the main process's refreshed draft."""
    log_start = len(server.log_path.read_text())
    accelerate_launch(ROOT / "tests" / "two_process_server_grpo.py", str(tmp_path), server.url,
                      env={"VLLM_API_KEY": server.api_key})  # the clients' key from the environment
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [(r["world_size"], len(r["calls"]), r["num_syncs"]) for r in ranks] == [(2, 2, 2)] * 2
    assert [r["num_refreshes"] for r in ranks] == [2, 0]
    for call in (c for r in ranks for c in r["calls"]):
        assert len(call["completion_ids"]) == 6 and all(n == len(c) for n, c in zip(call["num_logprobs"],
                                                                                    call["completion_ids"]))
    assert server.log_path.read_text()[log_start:].count("POST /reset_prefix_cache") == 4  # one after each load
    policy = _hf(pair["target"])
    missing, unexpected = policy.load_state_dict(load_file(tmp_path / "policy.safetensors"), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied to the embeddings
    for sample in client.generate(default_prompts(2), 1, GREEDY, use_tqdm=False).samples:
        expected = hf_logprobs(policy.eval(), sample.prompt_ids, sample.completion_ids, GREEDY)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    on_server = _greedy_acceptance(client)
    client.load_draft_weights(load_file(tmp_path / "draft.safetensors").items())
    assert _greedy_acceptance(client) == on_server  # loading the main process's draft again changes nothing
    client.load_draft_weights(_hf(pair["draft"]).named_parameters())
    assert _greedy_acceptance(client) != on_server  # the refresh had changed the server's drafter
    client.load_weights(_hf(pair["target"]).named_parameters())
