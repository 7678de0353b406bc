"""The seam between vLLM's generations (rollout/vllm_backend/versions.py, plugin.py), without vLLM: which vLLM the
metadata says is installed, the form the project's drafters take on each (vLLM 0.32-0.33's custom_class hook, 0.34's registered
method), how a server's reported config is recognised, and what `rollout serve` builds and checks for each. The
0.34 speculator itself runs in tests/test_vllm034_speculator.py, against vLLM 0.34's own modules."""

import importlib.metadata
import json
import sys

import pytest

from rollout import default_model_paths
from rollout.vllm_backend import plugin, versions
from rollout.vllm_backend.serve import build_command
from rollout.vllm_backend.wire import CONFIG_KEY, PROPOSER_CLASS
from spec import SpecConfig

HISTORY = {"method": "history", "num_speculative_tokens": 4, "history_max_tokens": 1000}


@pytest.fixture(autouse=True)
def fresh_generation():
    """generation() is chosen once per process: each test chooses anew, and leaves the real one behind."""
    versions.generation.cache_clear()
    yield
    versions.generation.cache_clear()


@pytest.fixture
def vllm_034(monkeypatch):
    monkeypatch.setattr(plugin, "installed_version", lambda: (0, 34))


def test_the_version_is_read_from_the_metadata_of_the_vllm_on_the_path(tmp_path, monkeypatch):
    if "vllm" in sys.modules:
        pytest.skip("vLLM is imported in this process: find_spec answers from it, not from the path")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('never imported')\n")
    info = tmp_path / "vllm-0.34.1.dev7+g1234.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.1.dev7+g1234\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert plugin.installed_version() == (0, 34) and isinstance(versions.generation(), versions.V2Speculator)
    assert plugin.major_minor("0.32.0+cpu") == (0, 32)


def test_before_034_the_drafters_go_through_custom_class_and_keep_the_schedule(monkeypatch):
    monkeypatch.setattr(plugin, "installed_version", lambda: (0, 33))
    config = SpecConfig.from_dict({**HISTORY, "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 2]],
                                   "enable_adaptive_verification": True})
    spec, additional = versions.drafter_speculative_config(config)
    assert spec == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 4}
    assert SpecConfig.from_dict(additional[CONFIG_KEY]) == config and versions.generation().reads_schedule
    assert versions.generation().server_imports(config) == [PROPOSER_CLASS]


def test_from_034_the_method_is_registered_and_vllm_gets_the_schedule_and_adaptive_verification(vllm_034):
    config = SpecConfig.from_dict({**HISTORY, "enable_adaptive_verification": True})
    spec, additional = versions.drafter_speculative_config(config)
    assert spec == {"method": "history", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size":
                    [[1, 1, 4]], "enable_adaptive_verification": True}  # a flat schedule: use_schedule can rewrite it
    assert SpecConfig.from_dict(additional[CONFIG_KEY]) == config and not versions.generation().reads_schedule
    scheduled = config.with_schedule([[1, 8, 4], [9, 64, 2]])
    assert versions.drafter_speculative_config(scheduled)[0]["num_speculative_tokens_per_batch_size"] == \
        [[1, 8, 4], [9, 64, 2]]
    with pytest.raises(NotImplementedError, match="point proposals"):
        versions.drafter_speculative_config(SpecConfig.from_dict({**HISTORY, "draft_sample_method": "probabilistic"}))


def test_a_servers_config_is_the_projects_in_either_form():
    assert versions.runs_project_drafter({"method": "custom_class", "model": PROPOSER_CLASS})  # 0.32-0.33
    assert versions.runs_project_drafter({"method": "history"})  # 0.34, as sent
    assert versions.runs_project_drafter({"method": "custom_class"})
    assert versions.runs_project_drafter({"method": None, "model": None, "custom_method": "custom_class"})  # reported
    assert not versions.runs_project_drafter({"method": "custom_class", "model": "users.VllmProposer"})
    assert not versions.runs_project_drafter({"method": "suffix"})
    assert not versions.runs_project_drafter({"method": "draft_model", "model": "/models/draft"})


def test_rollout_serve_on_034_sends_the_registered_method_and_needs_the_plugin_installed(vllm_034, monkeypatch):
    target = default_model_paths()["target"]
    argv = ["--model", target, "--max-num-seqs", "8", "--speculative-config", json.dumps(HISTORY)]
    entry = importlib.metadata.EntryPoint("spec_rollouts", plugin.PLUGIN, plugin.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [entry] if group == entry.group else [])
    args, _ = build_command(argv, is_cpu=False)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "history" and "model" not in spec
    assert json.loads(args[args.index("--additional-config") + 1])[CONFIG_KEY]["history_max_tokens"] == 1000
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    with pytest.raises(ValueError, match="entry point, which is not installed here; install the project"):
        build_command(argv, is_cpu=False)


def test_the_plugin_does_nothing_before_034(monkeypatch):
    monkeypatch.setattr(plugin, "installed_version", lambda: (0, 32))
    plugin.register_methods()  # would import vLLM 0.34's registry, absent here
    monkeypatch.setattr(plugin, "installed_version", lambda: None)
    plugin.register_methods()
    assert not plugin.has_suffix_decoding()


def test_the_worker_finds_the_drafter_under_either_runner():
    class Drafting(versions.RolloutDrafting):
        def __init__(self):  # no engine: only the type matters here
            pass

    drafting = Drafting()
    v1 = type("V1Runner", (), {"drafter": type("Proposer", (), {"drafting": drafting})()})()
    v2 = type("V2Runner", (), {"speculator": type("Speculator", (), {"drafting": drafting})()})()
    assert versions.find_drafting(v1) is drafting and versions.find_drafting(v2) is drafting
    assert versions.find_drafting(type("Other", (), {"drafter": object(), "speculator": None})()) is None


class _Proposer(versions.RolloutProposer):
    def __init__(self):  # no engine: the runner's hand-off is all that is checked
        self.model_runner = None


def test_the_proposer_is_handed_its_runner_and_another_runner_fails_the_start():
    """The worker extension calls attach_runner when vLLM sets the worker's model_runner (the runner has built the
    proposer by then; tests/test_vllm_proposer.py runs it inside vLLM): the custom_class proposer gets the runner,
    whose input batch it reads each step. A runner without such a batch (another vLLM) fails there, at start-up,
    naming the supported versions; other drafters are left alone."""
    v1 = versions.V1CustomClass()
    batch = type("InputBatch", (), {name: None for name in v1.BATCH_FIELDS})()
    runner = type("V1Runner", (), {"drafter": _Proposer(), "input_batch": batch, "requests": {}})()
    v1.attach_runner(runner)
    assert runner.drafter.model_runner is runner
    other = type("OtherRunner", (), {"drafter": _Proposer(), "input_batch": object(), "requests": {}})()
    with pytest.raises(RuntimeError, match=r"req_ids.*0\.32-0\.33 .* 0\.34\+"):
        v1.attach_runner(other)
    with pytest.raises(RuntimeError, match=r"\['requests'\] of vLLM's NoRequests"):
        v1.attach_runner(type("NoRequests", (), {"drafter": _Proposer(), "input_batch": batch})())
    v1.attach_runner(type("Runner", (), {"drafter": object()})())  # another drafter: nothing to hand over


def test_the_speculator_is_checked_against_the_runners_request_state_when_built():
    """Model Runner V2 builds the speculator with its request state: every field the speculator reads is checked
    there, before any step (tests/test_vllm034_speculator.py passes vLLM 0.34's own)."""
    from dataclasses import make_dataclass
    v2 = versions.V2Speculator()
    views = {view: None for view in ("gpu", "np")}
    states = type("RequestState", (), {name: type(name, (), views)() for name in v2.REQUEST_STATE_FIELDS})()
    batch_cls = make_dataclass("InputBatch", v2.BATCH_FIELDS)
    v2.check_speculator(states, batch_cls)
    del type(states).total_len
    with pytest.raises(RuntimeError, match=r"\['gpu'\] of vLLM's request state's total_len.*0\.34\+"):
        v2.check_speculator(states, batch_cls)
    states.total_len = type("total_len", (), views)()
    with pytest.raises(RuntimeError, match=r"\['idx_mapping_np'\] of vLLM's InputBatch"):
        v2.check_speculator(states, make_dataclass("InputBatch", v2.BATCH_FIELDS[:3]))
