"""Weight sync (trainers/weight_sync.py): the generator's target equals the trained policy after each step, is left
alone while global_step stands still, and takes a LoRA policy's merged weights; under ZeRO-3 (a stand-in for
deepspeed.zero that shards and releases as ZeRO-3 does) each weight is read inside its gather."""

import contextlib
import importlib.util
import sys
import types

import pytest
import torch
from peft import LoraConfig

from trainers import SpecRolloutCallback, policy_weights
from trainers.weight_sync import gathered
from trainers_testing import PROBE_IDS, grpo_config, grpo_trainer, logits, shared_grpo_run, tiny_generator, tiny_policy


def test_target_equals_trained_policy_after_a_step():
    run = shared_grpo_run()
    trainer, generator, sync = run.trainer, run.generator, run.callback.weight_sync
    assert not torch.equal(logits(tiny_generator(target_seed=1).backend.runner.model, PROBE_IDS),
                           logits(run.initial_policy, PROBE_IDS))  # the target started elsewhere
    assert trainer.state.global_step == 2
    # Synced before the rollouts of steps 0 and 1; the policy then took step 2, which no rollout followed.
    assert sync.num_syncs == 2 and sync.last_synced_step == 1
    assert not torch.allclose(logits(trainer.model, PROBE_IDS), logits(run.initial_policy, PROBE_IDS),
                              atol=1e-3)  # it trained
    sync.maybe_sync(trainer)  # what the next step's rollout does first
    assert torch.equal(logits(generator.backend.runner.model, PROBE_IDS), logits(trainer.model, PROBE_IDS))


def test_rollout_logprobs_follow_the_synced_target():
    run = shared_grpo_run()
    trainer, generator = run.trainer, run.generator
    run.callback.weight_sync.maybe_sync(trainer)
    out = trainer.rollout_func([trainer.train_dataset[0]["prompt"]] * 4, trainer)
    policy = trainer.model.eval()
    for prompt_ids, completion_ids, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        with torch.no_grad():
            all_logits = policy(input_ids=torch.tensor([prompt_ids + completion_ids])).logits[0]
        log_probs = torch.log_softmax(all_logits[len(prompt_ids) - 1:-1], dim=-1)  # temperature 1
        expected = log_probs.gather(1, torch.tensor(completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
    policy.train()


def test_no_sync_while_global_step_is_unchanged():
    run = shared_grpo_run()
    trainer, generator, sync = run.trainer, run.generator, run.callback.weight_sync
    sync.maybe_sync(trainer)
    num_syncs = sync.num_syncs
    with torch.no_grad():
        trainer.model.lm_head.weight.add_(0.5)  # the policy moves, global_step does not
    try:
        trainer.rollout_func([trainer.train_dataset[0]["prompt"]] * 4, trainer)
        assert sync.num_syncs == num_syncs
        assert not torch.allclose(logits(generator.backend.runner.model, PROBE_IDS), logits(trainer.model, PROBE_IDS))
        trainer.state.global_step += 1
        trainer.rollout_func([trainer.train_dataset[0]["prompt"]] * 4, trainer)
        assert sync.num_syncs == num_syncs + 1
        assert torch.equal(logits(generator.backend.runner.model, PROBE_IDS), logits(trainer.model, PROBE_IDS))
    finally:
        trainer.state.global_step -= 1
        with torch.no_grad():
            trainer.model.lm_head.weight.sub_(0.5)


def test_lora_policy_syncs_merged_weights(tmp_path):
    generator = tiny_generator(target_seed=1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    callback = SpecRolloutCallback(generator)
    trainer = grpo_trainer(tiny_policy(0), callback, grpo_config(tmp_path, max_steps=1), peft_config=lora)
    trainer.train()
    assert callback.weight_sync.maybe_sync(trainer)  # global_step 1: the adapters as trained by step 1
    policy = trainer.model
    with policy.disable_adapter():
        base = logits(policy, PROBE_IDS)
    merged = logits(policy, PROBE_IDS)  # the adapters active, unmerged
    target = logits(generator.backend.runner.model, PROBE_IDS)
    assert not torch.allclose(base, merged, atol=1e-3)  # the adapters matter
    torch.testing.assert_close(target, merged, atol=1e-5, rtol=1e-5)
    assert not any("lora_" in name for name, _ in generator.backend.runner.model.named_parameters())


def test_policy_weights_use_the_base_model_names():
    from peft import get_peft_model
    model = get_peft_model(tiny_policy(0), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    names = [name for name, _ in policy_weights(model)]
    assert names == [name for name, _ in tiny_policy(0).named_parameters()]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed")
def test_zero3_without_deepspeed_says_how_to_install():
    with pytest.raises(ImportError, match="pip install deepspeed"):
        with gathered([torch.nn.Parameter(torch.zeros(1))], is_zero3=True):
            pass


class FakeZero3:
    """deepspeed.zero as ZeRO-3 treats a model, for what weight sync relies on: outside GatheredParameters each
    parameter holds an empty shard; inside, its whole tensor; on leaving, the whole tensor is released (zeroed here,
    as reused memory would be overwritten), and changes made inside are dropped (no modifier_rank). So a reader that
    keeps a tensor past its gather, or reads outside one, gets no weights."""

    def __init__(self, model: torch.nn.Module):
        self.whole = {param: param.data.clone() for param in model.parameters()}
        self.num_gathered = 0
        for param in model.parameters():
            param.data = torch.empty(0, dtype=param.dtype)

    @contextlib.contextmanager
    def GatheredParameters(self, params):  # noqa: N802 (deepspeed's name)
        params = list(params)
        for param in params:
            param.data = self.whole[param].clone()
        self.num_gathered += len(params)
        try:
            yield
        finally:
            for param in params:
                param.data.zero_()
                param.data = torch.empty(0, dtype=param.dtype)


def _zero3(monkeypatch, model) -> FakeZero3:
    fake = FakeZero3(model)
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(zero=fake))
    return fake


def _target_weights(generator) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in generator.backend.runner.model.named_parameters()}


def test_zero3_weights_are_read_inside_each_gather(monkeypatch):
    model = tiny_policy(0)
    expected = {name: param.detach().clone() for name, param in model.named_parameters()}
    fake = _zero3(monkeypatch, model)
    sizes, kept = [], []
    for _, tensor in policy_weights(model, is_zero3=True):
        sizes.append(tensor.numel())
        kept.append(tensor)
    assert sizes == [tensor.numel() for tensor in expected.values()]  # whole while read
    assert not any(tensor.any() for tensor in kept)  # released after: a reader must copy inside the gather
    generator = tiny_generator(target_seed=1)
    assert generator.load_weights(policy_weights(model, is_zero3=True)) == len(expected)
    target = _target_weights(generator)
    assert all(torch.equal(target[name], tensor) for name, tensor in expected.items())
    assert fake.num_gathered == 2 * len(expected)  # one parameter at a time, in each of the two reads
    assert all(param.numel() == 0 for param in model.parameters())  # every gather released


def test_zero3_lora_policy_syncs_merged_weights_gathered_once(monkeypatch):
    from peft import get_peft_model
    policy = get_peft_model(tiny_policy(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    expected = {name: tensor.clone() for name, tensor in policy_weights(policy)}  # merged, before sharding
    fake = _zero3(monkeypatch, policy)
    generator = tiny_generator(target_seed=1)
    generator.load_weights(policy_weights(policy, is_zero3=True))
    target = _target_weights(generator)
    assert all(torch.equal(target[name], tensor) for name, tensor in expected.items())
    assert fake.num_gathered == len(list(policy.parameters()))  # the whole model, once: merging needs it all


def test_load_weights_rejects_a_different_architecture():
    generator = tiny_generator(target_seed=1)
    other = tiny_policy(0, num_layers=3)
    with pytest.raises(ValueError, match="model.layers.2"):
        generator.load_weights(other.named_parameters())
    with pytest.raises(ValueError, match="were not given"):
        generator.load_weights(list(tiny_policy(0).named_parameters())[:-1])
