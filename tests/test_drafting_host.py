"""One drafting host (spec/drafting_host.py) for both engines: the same drafter, fed the same steps through the host the
embedded engine builds (rollout/embedded_backend/engine.py, given the views Engine.step passes) and through vLLM's
workers' drafting (rollout/vllm_backend/drafting.py, given the rows its adapters pass, built from a stand-in
vllm_config: no vLLM needed), cuts each request's drafts after its stop ids, counts the same drafts and faults, warns
once, stops after the same max_drafter_faults, groups requests by prompt alike, and refuses the same proposals.
draft_probs differ by the host's one setting: the embedded engine verifies them, vLLM's workers refuse them."""

import types

import pytest
import torch

from rollout.embedded_backend.engine import Engine
from rollout.embedded_backend.request import Request
from rollout.sampling_params import SamplingParams
from rollout.vllm_backend.drafting import RolloutDrafting, Row
from rollout.vllm_backend.wire import CONFIG_KEY, FAULTS_KEY
from spec import DrafterConfigError, Proposal, RequestAcceptance, SpecConfig, StaticPolicy, StepInfo, build_proposer
from spec.drafting_host import MAX_DRAFTER_FAULTS

K, VOCAB, STOP, MAX_MODEL_LEN = 4, 32, 5, 64
DRAFTS = [7, STOP, 8, 9]  # every request's drafts: a stop id inside them
PROMPTS = {"a": [1, 2, 3], "b": [1, 2, 3], "c": [4, 5]}  # a and b: one GRPO group
STOP_IDS = {"a": {STOP}, "b": {STOP}, "c": set()}  # c: EOS ignored, no stop ids


class Scripted:
    """Drafts DRAFTS for every request; its n-th call does script[n]: "ok", "raises", "draft_probs" (a proposal with
    draft distributions) or "outside_vocab" (a draft id past the vocabulary). Records each call's group ids."""

    script: list[str] = []

    def __init__(self, config):
        self.num_calls = 0
        self.groups = []

    def propose(self, requests, max_num_tokens) -> Proposal:
        action = self.script[self.num_calls]
        self.num_calls += 1
        self.groups.append([r.group_id for r in requests])
        if action == "raises":
            raise RuntimeError("a drafter bug")
        drafts = [DRAFTS[:k] for k in max_num_tokens]
        proposal = Proposal(drafts, [[0.5] * len(d) for d in drafts])
        if action == "draft_probs":
            proposal.draft_probs = [torch.full((len(d), VOCAB), 1.0 / VOCAB) for d in drafts]
        elif action == "outside_vocab":
            proposal.token_ids[0][0] = VOCAB
        return proposal

    def finish(self, request) -> None:
        pass


CONFIG = SpecConfig.from_dict({"method": "custom_class", "model": f"{__name__}.Scripted", "num_speculative_tokens": K})


class Embedded:
    """The embedded engine's host, fed as Engine.step feeds it: its requests' draft views."""

    def __init__(self, max_drafter_faults: int = MAX_DRAFTER_FAULTS):
        proposer = build_proposer(CONFIG, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
        self.engine = Engine(None, proposer, StaticPolicy(), lambda batch_size: K, max_num_seqs=8,
                             max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, max_drafter_faults=max_drafter_faults)
        self.requests = [self._request(i, name) for i, name in enumerate(PROMPTS)]
        for request in self.requests:
            self.engine.add(request)
        self.drafter = proposer.inner

    @staticmethod
    def _request(i: int, name: str) -> Request:
        return Request(i, 100 + i, i, 0, list(PROMPTS[name]), SamplingParams(), torch.Generator(), None,
                       RequestAcceptance.sized(K), frozenset(STOP_IDS[name]))

    def step(self, token: int) -> list[list[int]]:
        for request in self.requests:
            request.output_ids.append(token)
        step = StepInfo([r.req_id for r in self.requests], [1] * len(self.requests), [K] * len(self.requests), K)
        return self.engine.host.draft(step, lambda: [r.draft_view() for r in self.requests]).verified.token_ids

    @property
    def counts(self) -> tuple[int, int]:
        return self.engine.num_proposed_drafts, self.engine.num_drafter_faults


class VLLM:
    """vLLM's workers' drafting, fed as its adapters feed it: rows, their new token ids, and each one's stop ids."""

    def __init__(self, max_drafter_faults: int = MAX_DRAFTER_FAULTS):
        vllm_config = types.SimpleNamespace(
            additional_config={CONFIG_KEY: CONFIG.to_dict(), FAULTS_KEY: max_drafter_faults},
            model_config=types.SimpleNamespace(max_model_len=MAX_MODEL_LEN, get_vocab_size=lambda: VOCAB),
            scheduler_config=types.SimpleNamespace(max_num_seqs=8))
        self.drafting = RolloutDrafting(vllm_config, "test", lambda vllm_id: frozenset(STOP_IDS[vllm_id]))
        self.outputs: list[int] = []
        self.drafter = self.drafting.drafter.inner

    def step(self, token: int) -> list[list[int]]:
        self.outputs.append(token)
        rows = [Row(name, len(prompt), len(prompt) + len(self.outputs), 1) for name, prompt in PROMPTS.items()]
        starts = self.drafting.missing(rows)
        tokens = [(prompt + self.outputs)[first:] for prompt, first in zip(PROMPTS.values(), starts)]
        return self.drafting.propose(rows, tokens, K, 0.0)

    @property
    def counts(self) -> tuple[int, int]:
        return self.drafting.stats["num_draft_tokens"], self.drafting.stats["num_faults"]


def _run(host, script: list[str]) -> list[list[list[int]]]:
    Scripted.script = script
    return [host.step(token) for token in range(10, 10 + len(script))]


@pytest.mark.parametrize("host", [Embedded, VLLM])
def test_both_hosts_cut_count_fault_and_stop_alike(host):
    """Good steps verify each request's drafts up to its stop id; a fault costs its step's drafts; the first fault
    warns; after max_drafter_faults the drafter is not called again."""
    script = ["ok", "raises", "ok"] + ["raises"] * (MAX_DRAFTER_FAULTS - 1) + ["ok"] * 2
    cut, none = [[7, STOP], [7, STOP], DRAFTS], [[], [], []]
    host = host()
    with pytest.warns(RuntimeWarning) as caught:
        assert _run(host, script) == [cut, none, cut] + [none] * (MAX_DRAFTER_FAULTS - 1) + [none] * 2
    assert host.counts == (2 * 3 * K, MAX_DRAFTER_FAULTS)  # proposed drafts counted before the stop cut
    assert host.drafter.num_calls == MAX_DRAFTER_FAULTS + 2
    faults = [w for w in caught if "faulted" in str(w.message)]
    assert len(faults) == 1 and "RuntimeError: a drafter bug" in str(faults[0].message)


@pytest.mark.parametrize("host", [Embedded, VLLM])
def test_both_hosts_take_the_configured_fault_limit(host):
    """max_drafter_faults reaches both hosts (the vLLM workers' through additional_config, wire.FAULTS_KEY)."""
    host = host(max_drafter_faults=2)
    with pytest.warns(RuntimeWarning, match="max_drafter_faults=2"):
        _run(host, ["raises"] * 4)
    assert host.counts[1] == 2 and host.drafter.num_calls == 2
    with pytest.raises(RuntimeError, match="a drafter bug"):
        _run(type(host)(max_drafter_faults=0), ["raises"])


def test_both_hosts_group_requests_by_prompt():
    embedded, vllm = Embedded(), VLLM()
    for host in (embedded, vllm):
        _run(host, ["ok"])
        a, b, c = host.drafter.groups[0]
        assert a == b != c


def test_draft_probs_are_verified_on_the_embedded_engine_and_refused_on_vllm():
    embedded = Embedded()
    Scripted.script = ["draft_probs"]
    step = StepInfo([r.req_id for r in embedded.requests], [1] * 3, [K] * 3, K)
    verified = embedded.engine.host.draft(step, lambda: [r.draft_view() for r in embedded.requests]).verified
    assert [len(p) for p in verified.draft_probs] == [2, 2, K]  # cut with the drafts
    with pytest.raises(DrafterConfigError, match="returned draft_probs: this engine verifies .* point proposals"):
        _run(VLLM(), ["draft_probs"])


@pytest.mark.parametrize("host", [Embedded, VLLM])
def test_draft_ids_outside_the_vocabulary_raise_on_both(host):
    with pytest.raises(DrafterConfigError, match=r"outside the target's vocabulary \[0, 32\)"):
        _run(host(), ["ok", "outside_vocab"])
