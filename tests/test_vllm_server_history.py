"""The project's history drafter in a vLLM server (`python -m rollout serve --speculative-config '{"method":
"history", ...}'`): the launcher turns it into vLLM's custom_class hook on the project's proposer, the server's
worker holds the history, and every client of the server drafts from it. The embedded engine without speculation
is the greedy reference (the server tests in test_vllm_server.py check that the two engines agree)."""

import json

import pytest
import torch
from vllm_testing import Server, require_vllm

from rollout import RolloutGenerator, SamplingParams, default_prompts

pytestmark = require_vllm
HISTORY = {"method": "history", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 12}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(["--model", "default", "--speculative-config", json.dumps(HISTORY), "--max-model-len", "256",
                     "--max-num-seqs", "32"], tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.stop()


def test_every_client_drafts_from_the_servers_history_losslessly(server, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", server.api_key)  # the clients' key from the environment
    prompts = default_prompts(16, seed=5)
    reference = RolloutGenerator("default", max_num_seqs=16).generate(prompts, 1, GREEDY, use_tqdm=False)
    first_client, second_client = (RolloutGenerator(backend="server", base_url=server.url) for _ in range(2))
    assert first_client.config.to_dict() == {**first_client.config.to_dict(), **HISTORY}  # read from the server
    batches = [first_client.generate(prompts, 2, GREEDY, use_tqdm=False),
               second_client.generate(prompts, 1, GREEDY, use_tqdm=False)]
    for batch in batches:
        for sample in batch.samples:
            expected = reference.samples[sample.prompt_index]
            assert sample.completion_ids == expected.completion_ids
            torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(expected.logprobs), atol=1e-4,
                                       rtol=0)
    # the second client's prompts were all rolled out by the first (greedy: the same outputs), so their history
    # drafts them almost whole; the first drafted from the prompts and siblings only
    first, second = (b.stats["mean_acceptance_length"] for b in batches)
    assert second > first + 1, (first, second)
