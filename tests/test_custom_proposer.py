import sys
import types

import pytest

from spec import DraftRequest, Proposal, SpecConfig, build_proposer


class RepeatLast:
    """A custom drafter: proposes the last token k times, confidence 0.5 each."""

    def __init__(self, config):
        self.config = config
        self.finished = []

    def propose(self, requests, max_num_tokens):
        return Proposal([[r.token_ids[-1]] * k for r, k in zip(requests, max_num_tokens)],
                        [[0.5] * k for k in max_num_tokens])

    def finish(self, request):
        self.finished.append(request.req_id)


class OverConfident(RepeatLast):
    def propose(self, requests, max_num_tokens):
        return Proposal([[1] for _ in requests], [[1.5] for _ in requests])


class NotAProposal(RepeatLast):
    def propose(self, requests, max_num_tokens):
        return [[1] for _ in requests]


@pytest.fixture(autouse=True)
def drafters_module():
    module = types.ModuleType("my_drafters")
    module.RepeatLast, module.OverConfident, module.NotAProposal = RepeatLast, OverConfident, NotAProposal
    sys.modules["my_drafters"] = module
    yield
    del sys.modules["my_drafters"]


def _build(path):
    config = SpecConfig.from_dict({"method": "custom_class", "model": path, "num_speculative_tokens": 3})
    return build_proposer(config, max_num_seqs=4, max_model_len=64)


def test_custom_class_is_built_from_the_config_and_called():
    proposer = _build("my_drafters.RepeatLast")
    request = DraftRequest(req_id=7, group_id=0, token_ids=[4, 5, 6], num_prompt_tokens=2)
    proposal = proposer.propose([request], [2])
    assert proposal.token_ids == [[6, 6]] and proposal.confidence == [[0.5, 0.5]]
    proposer.finish(request)
    assert proposer.inner.finished == [7] and proposer.inner.config.num_speculative_tokens == 3


@pytest.mark.parametrize("path, message", [
    ("RepeatLast", "dotted path"),
    ("no_such_module.Drafter", "cannot import module"),
    ("my_drafters.Missing", "has no class 'Missing'"),
])
def test_bad_class_path(path, message):
    with pytest.raises(ValueError, match=message):
        _build(path)


def test_confidence_outside_unit_interval_is_refused():
    proposer = _build("my_drafters.OverConfident")
    with pytest.raises(ValueError, match=r"confidence 1.5 .* outside \[0, 1\]"):
        proposer.propose([DraftRequest(0, 0, [1, 2], 1)], [2])


def test_too_many_drafts_are_refused():
    proposer = _build("my_drafters.OverConfident")
    with pytest.raises(ValueError, match="at most 0 allowed"):
        proposer.propose([DraftRequest(0, 0, [1, 2], 1)], [0])


def test_wrong_return_type_is_refused():
    with pytest.raises(ValueError, match="return a spec.Proposal"):
        _build("my_drafters.NotAProposal").propose([DraftRequest(0, 0, [1], 1)], [1])
