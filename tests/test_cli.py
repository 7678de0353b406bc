"""The main job, end to end on the shipped default pair, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout import default_model_paths, default_prompts
from rollout.cli import K_LEGEND, build_parser, drain
from rollout.default_task import format_prompt, reward
from spec import SpecConfig
from spec.tuning import MIN_GAIN


ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd, python_flags=()):
    """`python -m rollout ...` as a user runs it, offline, on this checkout's code (PYTHONPATH: an editable install
    may point at another). The guard only stops a hung process: generous,
    and on expiry the failure shows what the command had printed."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, *python_flags, "-m", "rollout", *args], cwd=cwd,
                              capture_output=True, text=True, env=env, timeout=1800)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"python -m rollout {' '.join(args)} ran past 30 minutes; it printed:\n{e.stdout}\n{e.stderr}")


def test_generate_writes_jsonl_and_prints_the_summary(tmp_path):
    out = tmp_path / "samples.jsonl"
    result = _run("generate", "--num-prompts", "3", "--num-generations", "2", "--max-tokens", "48",
                  "--output", str(out), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6
    assert [(s["prompt_index"], s["sample_index"]) for s in lines] == [(i, j) for i in range(3) for j in range(2)]
    for sample in lines:
        assert len(sample["logprobs"]) == len(sample["completion_ids"]) > 0
        assert sample["finish_reason"] in ("stop", "length")
        assert {"num_draft_tokens", "acceptance_histogram", "k_per_step"} <= set(sample["acceptance"])
    assert sum(s["acceptance"]["num_draft_tokens"] for s in lines) > 0  # the default config speculates
    for name in ("tokens/s", "acceptance rate", "mean acceptance length", "K by batch size", K_LEGEND):
        assert name in result.stdout
    prompts = default_prompts(3, seed=0)
    scores = [reward(prompts[s["prompt_index"]], s["text"]) for s in lines]
    assert all(score in (0.0, 1.0) for score in scores)


def test_the_drain_shows_the_cap_and_the_drafts_verified_per_request_at_each_batch_size():
    k_per_batch_size = {64: {8: 3}, 40: {8: 1}, 2: {8: 4, 4: 1}, 1: {8: 10}}
    drafts = {64: 3 * 64 * 2, 40: 40 * 5, 2: 2 * 5 * 3, 1: 50}
    assert drain(k_per_batch_size, drafts) == ("33-64: K 8, 2.5 verified, 4 steps | 2: K 8, 3.0 verified, 5 steps | "
                                               "1: K 8, 5.0 verified, 10 steps")


def test_generate_with_a_user_config_and_no_speculation(tmp_path):
    out = tmp_path / "plain.jsonl"
    result = _run("generate", "--num-prompts", "2", "--num-generations", "1", "--max-tokens", "8",
                  "--speculative-config", "none", "--output", str(out), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(json.loads(line)["acceptance"]["num_draft_tokens"] == 0 for line in out.read_text().splitlines())
    ngram = _run("generate", "--num-prompts", "2", "--max-tokens", "8", "--output", str(out), "--no-progress",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', cwd=tmp_path)
    assert ngram.returncode == 0, ngram.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    result = _run("generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
                  "--output", str(tmp_path / "x.jsonl"), cwd=tmp_path)
    assert result.returncode == 2 and "num_speculative_tokens=0" in result.stderr
    result = _run("generate", "--speculative-config", "{not json", cwd=tmp_path)
    assert result.returncode == 2 and "not valid JSON" in result.stderr
    result = _run("generate", "--model", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert result.returncode == 2 and "expected a local model folder" in result.stderr


def test_default_pair_is_shipped():
    paths = default_model_paths()
    for path in paths.values():
        assert (Path(path) / "model.safetensors").is_file()


@pytest.mark.slow
def test_tune_prints_a_schedule_both_engines_accept(tmp_path):
    result = _run("tune", "--num-prompts", "4", "--num-generations", "2", "--max-tokens", "24", "--max-num-seqs", "8",
                  "--max-k", "4", "--repeats", "1", "--output", str(tmp_path / "tuned.json"), "--no-progress",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout.strip().splitlines()[-1])
    assert config == json.loads((tmp_path / "tuned.json").read_text())
    spec = SpecConfig.from_dict(config)  # the keys and rules of vLLM's --speculative-config
    ranges = config["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 8 and all(0 <= k <= 4 for *_, k in ranges)
    assert spec.num_speculative_tokens == max(1, max(k for *_, k in ranges))
    assert "acceptance per position" in result.stderr and "predicted K" in result.stderr
    assert "measured K" in result.stderr  # every K was timed at every batch size of the grid
    assert "accepted by: RolloutGenerator" in result.stderr and "not vllm serve: method 'history'" in result.stderr


@pytest.mark.parametrize("config, takers, not_taken", [
    ({"method": "history", "num_speculative_tokens": 4}, ["python -m rollout generate", "python -m rollout serve"],
     "not vllm serve: method 'history' is this project's drafter"),
    ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size":
      [[1, 8, 4], [9, 64, 1]]}, ["python -m rollout generate", "python -m rollout serve, vllm serve"], None),
    ({"method": "suffix", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 8, 4]]},
     ["python -m rollout generate"], "asserts one K"),
    ({"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}, ["python -m rollout serve, vllm serve"],
     "method='eagle3' runs only on vLLM"),
])
def test_tune_says_which_commands_accept_its_config(config, takers, not_taken):
    from rollout.tune import accepted_by

    line = accepted_by(config)
    assert all(taker in line for taker in takers), line
    assert (not_taken in line) if not_taken else ";" not in line, line
    assert ("vllm serve" in line.split(";")[0]) == (config["method"] in ("draft_model", "eagle3")), line


def test_tune_without_a_drafter_is_refused(tmp_path):
    result = _run("tune", "--speculative-config", "none", "--no-progress", cwd=tmp_path)
    assert result.returncode == 2 and "tune needs a speculative config" in result.stderr


# --- a CLI a user can trust ---------------------------------------------------------------------------------------

def _imports_torch(result) -> bool:
    """Whether a run under `python -X importtime` imported torch (its report lists every module, on stderr)."""
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in result.stderr.splitlines())


@pytest.mark.parametrize("args", [("--help",), ("generate", "--help"), ("tune", "--help")])
def test_help_answers_without_importing_torch(tmp_path, args):
    result = _run(*args, cwd=tmp_path, python_flags=("-X", "importtime"))
    assert result.returncode == 0 and "usage: python -m rollout" in result.stdout
    assert "import time:" in result.stderr and not _imports_torch(result)


def test_every_flag_has_help_with_its_default():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        if name == "serve":  # vLLM's own flags, passed through (tests/test_serve.py)
            continue
        text = " ".join(command.format_help().split())  # argparse wraps lines
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
        assert "(default: 128)" in text or "(default: 256)" in text  # --max-num-seqs, shown by the formatter
    assert parser.parse_args(["tune"]).min_gain == MIN_GAIN  # the literal kept so that --help skips torch


@pytest.mark.parametrize("output, message", [("missing/out.jsonl", "does not exist"), (".", "is a folder")])
def test_a_bad_output_fails_before_anything_loads(tmp_path, output, message):
    result = _run("generate", "--output", output, cwd=tmp_path, python_flags=("-X", "importtime"))
    assert result.returncode == 2 and f"error: --output {output}" in result.stderr and message in result.stderr
    assert not _imports_torch(result)  # nothing heavy was imported, let alone loaded


def test_a_bad_prompts_line_names_the_file_and_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"Q: 1+2\\nA:\\n"\n\n{"question": "1+2"}\n')
    result = _run("generate", "--prompts", str(prompts), cwd=tmp_path, python_flags=("-X", "importtime"))
    assert result.returncode == 2 and f"{prompts}, line 3: expected" in result.stderr
    assert '"prompt" key' in result.stderr and not _imports_torch(result)


def test_jsonl_prompts_to_stdout_with_a_draft_model_alone(tmp_path):
    """--draft-model alone means speculation with it; --output - keeps stdout pure JSONL."""
    lines = [json.dumps(format_prompt("3+4")), json.dumps([{"role": "user", "content": "5+8"}]),
             json.dumps({"prompt": format_prompt("7+1+3")}), json.dumps({"prompt": format_prompt("5+5")})]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    paths = default_model_paths()
    result = _run("generate", "--model", paths["target"], "--draft-model", paths["draft"], "--prompts",
                  "prompts.jsonl", "--num-prompts", "3", "--num-generations", "2", "--max-tokens", "24",
                  "--temperature", "0", "--output", "-", "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    samples = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(i, j) for i in range(3) for j in range(2)]
    assert samples[0]["text"] == samples[1]["text"] and "answer:" in samples[0]["text"]  # greedy: the same twice
    assert sum(s["acceptance"]["num_draft_tokens"] for s in samples) > 0
    assert "-> stdout" in result.stderr and "K by batch size" in result.stderr


def test_plain_text_prompts_and_a_saved_dataset(tmp_path):
    from datasets import Dataset

    from rollout.prompt_files import load_dataset_prompts, read_prompts
    (tmp_path / "prompts.txt").write_text("Q: 12+34\n\n{not json, just text}\n")
    assert read_prompts(str(tmp_path / "prompts.txt")) == ["Q: 12+34", "{not json, just text}"]
    Dataset.from_dict({"prompt": ["a", "b"], "answer": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    assert load_dataset_prompts(str(tmp_path / "ds")) == ["a", "b"]
    Dataset.from_dict({"question": ["a"]}).save_to_disk(str(tmp_path / "no_prompt"))
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        load_dataset_prompts(str(tmp_path / "no_prompt"))
    with pytest.raises(ValueError, match="no dataset saved there"):
        load_dataset_prompts(str(tmp_path / "nowhere"))


def test_generate_from_a_dataset_in_process(tmp_path, capsys):
    from datasets import Dataset

    from rollout.cli import main
    Dataset.from_dict({"prompt": [format_prompt("12+34"), format_prompt("5+6")]}).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--dataset", str(tmp_path / "ds"), "--num-generations", "1", "--max-tokens", "4",
                 "--speculative-config", "none", "--output", str(out), "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 2 and "K by batch size" in capsys.readouterr().out
    assert main(["generate", "--dataset", str(tmp_path / "ds"), "--num-prompts", "3", "--output", str(out)]) == 2
    assert "--num-prompts 3" in capsys.readouterr().err
