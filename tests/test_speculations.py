"""Several speculative configs taking turns on one loaded target (`build_speculation` / `use_speculation`): each keeps
its drafter's and policy's state, a loaded draft model is shared, and the output stays the target's."""

import pytest

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
DRAFT = {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def generator():
    return RolloutGenerator("default", speculative_config=None, max_num_seqs=8, max_model_len=128)


def test_speculations_take_turns_and_keep_their_state(generator):
    prompts = default_prompts(4, seed=3)
    suffix, draft = generator.build_speculation(SUFFIX), generator.build_speculation(DRAFT)
    plain = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    generator.use_speculation(suffix)
    first = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert generator.config.method == "suffix"
    generator.use_speculation(draft)
    drafted = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert generator.config.method == "draft_model" and drafted.stats["num_draft_tokens"] > 0
    generator.use_speculation(suffix)
    again = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    outputs = [[s.completion_ids for s in batch.samples] for batch in (plain, first, drafted, again)]
    assert outputs[1:] == [outputs[0]] * 3  # greedy: the target's tokens whatever drafts
    # the suffix drafter's cache kept the first call's outputs across the turn: the same prompts replay them whole
    assert again.stats["mean_acceptance_length"] > first.stats["mean_acceptance_length"] + 1


def test_a_loaded_draft_model_is_shared(generator):
    one, other = generator.build_speculation(DRAFT), generator.build_speculation({**DRAFT, "num_speculative_tokens": 2})
    assert one.proposer is not other.proposer and one.proposer.runner.model is other.proposer.runner.model


def test_use_speculation_takes_only_what_build_speculation_made(generator):
    with pytest.raises(ValueError, match="speculation='suffix'"):
        generator.use_speculation("suffix")
    with pytest.raises(ValueError, match="method"):
        generator.build_speculation({"num_speculative_tokens": 4})
