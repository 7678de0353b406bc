"""The rollout history (spec/proposers/history.py) and the drafter that drafts from it (method "history",
spec/proposers/suffix.py): what it keeps, its bounds, where drafts come from, its file, and that output stays the
target's."""

import random

import numpy as np
import pytest
import torch

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts
from spec import SpecConfig
from spec.proposers.base import DraftRequest
from spec.proposers.history import HistoryStore
from spec.proposers.suffix import MATCH_EVIDENCE, SuffixProposer

HISTORY = {"method": "history", "num_speculative_tokens": 8}


def _request(req_id, group_id, prompt, output=()):
    return DraftRequest(req_id=req_id, group_id=group_id, token_ids=list(prompt) + list(output),
                        num_prompt_tokens=len(prompt))


def _contents(store: HistoryStore) -> dict:
    return {key: [(e.tokens.tolist(), e.count) for e in entries] for key, entries in store._prompts.items()}


# --- the store ---

def test_a_prompt_keeps_its_latest_rollouts_identical_ones_once():
    store = HistoryStore(max_rollouts_per_prompt=3)
    for output in ([1, 2], [3], [1, 2], [4, 5, 6]):
        store.add([9, 9], output)
    # [3] is the oldest of the 4 rollouts and goes; [1, 2] was produced twice, stored once
    assert [(e.tokens.tolist(), e.count) for e in store.outputs([9, 9])] == [([1, 2], 2), ([4, 5, 6], 1)]
    assert store.num_tokens == 5 and store.num_rollouts == 3 and store.outputs([9]) == []


def test_the_least_recently_used_prompts_go_first():
    store = HistoryStore(max_rollouts_per_prompt=4, max_tokens=6)
    store.add([1], [10, 11])
    store.add([2], [20, 21])
    store.add([3], [30, 31])
    store.outputs([1])  # read: prompt 1 is now the most recently used
    store.add([4], [40, 41])  # 8 tokens > 6: prompt 2, the least recently used, goes
    assert [store.outputs([p]) != [] for p in (1, 2, 3, 4)] == [True, False, True, True]
    assert store.num_tokens == 6


def test_memory_stays_within_the_budget_over_200_calls():
    rng = random.Random(0)
    store = HistoryStore(max_rollouts_per_prompt=8, max_tokens=2_000)
    for _ in range(200):
        for _ in range(16):  # a call's rollouts: prompts from a pool of 50, outputs up to 60 tokens
            store.add([rng.randrange(50)], [rng.randrange(28) for _ in range(rng.randrange(1, 60))])
        stored = sum(len(e.tokens) for p in range(50) for e in store._prompts.get(np.int32(p).tobytes(), []))
        assert stored == store.num_tokens <= 2_000 and store.nbytes() == 4 * store.num_tokens
        assert all(sum(e.count for e in entries) <= 8 for entries in store._prompts.values())


@pytest.mark.parametrize("kwargs, key", [({"history_max_rollouts_per_prompt": -1}, "history_max_rollouts_per_prompt"),
                                         ({"history_max_tokens": 1.5}, "history_max_tokens"),
                                         ({"history_max_tokens": True}, "history_max_tokens")])
def test_bad_history_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SpecConfig.from_dict({**HISTORY, **kwargs})


def test_save_and_load_round_trip(tmp_path):
    store = HistoryStore(max_rollouts_per_prompt=4)
    for p in range(5):
        for r in range(p + 1):
            store.add([p, 7], [p, r % 3, 2])
    store.save(tmp_path / "h.npz")
    loaded = HistoryStore(max_rollouts_per_prompt=4)
    loaded.load(tmp_path / "h.npz", vocab_size=28)
    assert _contents(loaded) == _contents(store) and loaded.num_tokens == store.num_tokens


@pytest.mark.parametrize("damage, message", [
    (lambda path: path.write_bytes(path.read_bytes()[:100]), "not a readable rollout history"),
    (lambda path: path.write_bytes(b"not a zip"), "not a readable rollout history"),
    (lambda path: np.savez(path, something=np.zeros(2)), "not a rollout history"),
])
def test_a_damaged_file_is_refused_and_the_store_kept(tmp_path, damage, message):
    store = HistoryStore()
    store.add([1], [2, 3])
    path = tmp_path / "h.npz"
    store.save(path)
    damage(path)
    with pytest.raises(ValueError, match=message):
        store.load(path)
    assert _contents(store) == {np.int32(1).tobytes(): [([2, 3], 1)]}


def test_a_file_for_another_vocabulary_is_refused(tmp_path):
    store = HistoryStore()
    store.add([1], [2, 300])
    store.save(tmp_path / "h.npz")
    with pytest.raises(ValueError, match="another model"):
        HistoryStore().load(tmp_path / "h.npz", vocab_size=28)


# --- the drafter ---

def test_drafts_come_from_the_prompts_history_its_siblings_or_the_global_cache():
    """Each source holds tokens of its own (history of prompt A: 10s; sibling: 20s; global cache: 30s), so every
    draft can be traced to its source: a prompt's history never drafts for another prompt."""
    history = HistoryStore()
    history.add([1, 2, 3, 4], [10, 11, 12, 13])
    proposer = SuffixProposer(history=history, max_cached_requests=0)
    fresh = proposer.propose([_request(0, 0, [1, 2, 3, 4]), _request(1, 1, [5, 6, 7, 8])], [4, 4])
    assert fresh.token_ids == [[10, 11, 12, 13], []]  # prompt A drafts its history; prompt B has none
    sibling = proposer.propose([_request(2, 1, [5, 6, 7, 8], [20, 21, 22]), _request(3, 1, [5, 6, 7, 8])], [4, 4])
    assert sibling.token_ids[1] == [20, 21, 22]  # B's second sample drafts from its running sibling
    assert sibling.token_ids[0] == []  # nothing of A's history: B's own prefix never goes on past 22
    cached = SuffixProposer(history=HistoryStore(), max_cached_requests=10)
    cached.finish(_request(0, 0, [7], [30, 31, 32, 7, 30, 31, 32]))
    assert cached.propose([_request(1, 1, [8, 32, 7, 30])], [2]).token_ids == [[31, 32]]  # the global cache


def test_finished_outputs_go_to_the_history_and_start_the_next_group_of_their_prompt():
    proposer = SuffixProposer(history=HistoryStore())
    for req_id, output in enumerate(([4, 5, 6, 2], [4, 5, 6, 2], [4, 9, 9, 2])):
        proposer.propose([_request(req_id, 0, [1, 3, 7, 8], output[:1])], [2])
        proposer.finish(_request(req_id, 0, [1, 3, 7, 8], output))
    assert proposer.num_groups == 0 and proposer.history.num_rollouts == 3
    drafts, confidence = (x[0] for x in (lambda p: (p.token_ids, p.confidence))(
        proposer.propose([_request(9, 1, [1, 3, 7, 8])], [4])))
    assert drafts == [4, 5, 6, 2]  # the most frequent rollout, 2 of 3
    # frequencies 1, 2/3, 1, 1 after the whole 4-token prompt, weighed by the match (spec/proposers/suffix.py)
    assert confidence == pytest.approx([f * 4 / (4 + MATCH_EVIDENCE) for f in (1.0, 2 / 3, 1.0, 1.0)])


def test_a_failed_call_keeps_its_partial_outputs_out_of_the_history():
    proposer = SuffixProposer(history=HistoryStore())
    proposer.propose([_request(0, 0, [1, 3], [4, 5])], [2])
    proposer.release_all()
    assert proposer.num_groups == 0 and proposer.history.num_rollouts == 0


@pytest.fixture(scope="module")
def hf_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    paths = default_model_paths()
    model = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    prompts = default_prompts(6, seed=5)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return prompts, outputs


def test_greedy_output_equals_hf_with_and_without_history(hf_greedy):
    prompts, expected = hf_greedy
    generator = RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=8, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    first, again = (generator.generate(prompts, 1, params, use_tqdm=False) for _ in range(2))
    for batch in (first, again):
        assert [s.completion_ids for s in batch.samples] == expected
    assert again.stats["mean_acceptance_length"] > first.stats["mean_acceptance_length"] + 2  # drafted from history


def test_a_saved_history_drafts_again_after_loading(tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompts = default_prompts(6, seed=6)
    trained = RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=8, max_model_len=128)
    trained.generate(prompts, 1, params, use_tqdm=False)
    trained.rollout_history.save(tmp_path / "h.npz")
    expected = trained.generate(prompts, 1, params, use_tqdm=False).stats
    resumed = RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=8, max_model_len=128)
    resumed.rollout_history.load(tmp_path / "h.npz")
    stats = resumed.generate(prompts, 1, params, use_tqdm=False).stats
    # the same history, the same greedy tokens: the same drafts, accepted alike
    assert (stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]) == (
        expected["num_draft_tokens"], expected["num_accepted_draft_tokens"])
    plain = RolloutGenerator("default", max_num_seqs=8, max_model_len=128)
    assert plain.rollout_history is None  # no history kept, nothing to save
