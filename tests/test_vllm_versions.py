"""The seam between vLLM's generations (rollout/vllm_backend/versions.py), without vLLM: which vLLM the metadata says
is installed, the form the project's drafters take on each (vLLM 0.32-0.33's custom_class hook, 0.34's registered
method), how a server's reported config is recognised, and what `rollout serve` builds and checks for each. The
0.34 speculator itself runs in tests/test_vllm034_speculator.py, against vLLM 0.34's own modules."""

import importlib.metadata
import json
import sys

import pytest

from rollout import default_model_paths
from rollout.vllm_backend import versions
from rollout.vllm_backend.serve import build_command
from rollout.vllm_common import CONFIG_KEY, PROPOSER_CLASS
from spec import SpecConfig

HISTORY = {"method": "history", "num_speculative_tokens": 4, "history_max_tokens": 1000}


@pytest.fixture
def vllm_034(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda: (0, 34))


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
    assert versions.installed_version() == (0, 34) and versions.uses_registered_methods()
    assert versions.major_minor("0.32.0+cpu") == (0, 32)


def test_before_034_the_drafters_go_through_custom_class_and_keep_the_schedule(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda: (0, 33))
    config = SpecConfig.from_dict({**HISTORY, "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 2]],
                                   "enable_adaptive_verification": True})
    spec, additional = versions.drafter_speculative_config(config)
    assert spec == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 4}
    assert SpecConfig.from_dict(additional[CONFIG_KEY]) == config and versions.drafter_reads_schedule()
    assert versions.check_server_drafter(config) == [PROPOSER_CLASS]


def test_from_034_the_method_is_registered_and_vllm_gets_the_schedule_and_adaptive_verification(vllm_034):
    config = SpecConfig.from_dict({**HISTORY, "enable_adaptive_verification": True})
    spec, additional = versions.drafter_speculative_config(config)
    assert spec == {"method": "history", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size":
                    [[1, 1, 4]], "enable_adaptive_verification": True}  # a flat schedule: use_schedule can rewrite it
    assert SpecConfig.from_dict(additional[CONFIG_KEY]) == config and not versions.drafter_reads_schedule()
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
    plugin = importlib.metadata.EntryPoint("spec_rollouts", versions.PLUGIN, versions.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [plugin] if group == plugin.group else [])
    args, _ = build_command(argv, is_cpu=False)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "history" and "model" not in spec
    assert json.loads(args[args.index("--additional-config") + 1])[CONFIG_KEY]["history_max_tokens"] == 1000
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    with pytest.raises(ValueError, match="entry point, which is not installed here; install the project"):
        build_command(argv, is_cpu=False)


def test_the_plugin_does_nothing_before_034(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda: (0, 32))
    versions.register_methods()  # would import vLLM 0.34's registry, absent here
    monkeypatch.setattr(versions, "installed_version", lambda: None)
    versions.register_methods()
    assert not versions.has_suffix_decoding()


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
    batch = type("InputBatch", (), {name: None for name in versions.V1_BATCH_FIELDS})()
    runner = type("V1Runner", (), {"drafter": _Proposer(), "input_batch": batch})()
    versions.attach_runner(runner)
    assert runner.drafter.model_runner is runner
    other = type("OtherRunner", (), {"drafter": _Proposer(), "input_batch": object()})()
    with pytest.raises(RuntimeError, match=r"req_ids.*0\.32-0\.33 .* 0\.34\+"):
        versions.attach_runner(other)
    versions.attach_runner(type("Runner", (), {"drafter": object()})())  # another drafter: nothing to hand over
