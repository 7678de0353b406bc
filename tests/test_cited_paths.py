"""Every repo path cited in the code, tests, scripts and docs exists.

Cited: a token of path characters that contains '/' and ends in a known extension or starts with a top-level folder
(`rollout/vllm_backend/guard.py`, `docs/vllm.md`, `.ci/run`, `examples/results/`), or, in code and tests, a bare
source or doc file name (`wire.py`, `README.md`). A path resolves from the repository root, from the citing file's
top-level folder (`vllm_backend/proposer.py` in rollout/) or from its own folder; a bare name wherever a file of that
name is. Not cited (EXCLUDED): URLs and absolute paths (the token cannot start after ':', '/' or '~'), globs and
placeholders, metric keys (`spec/mean_k`), other projects' files (`vllm/...`, `trl/...`), the folder a script
writes its results to, docs/notes/ (dated records: they cite the paths of their day) and this file's made-up examples.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("spec", "rollout", "trainers", "examples", "tests", "docs", ".ci")
EXTENSIONS = (".py", ".md", ".sh", ".json", ".png", ".yaml", ".toml", ".c", ".h")
BARE_EXTENSIONS = (".py", ".md", ".sh", ".c", ".h")  # data files named bare are outputs a script writes
PATH = re.compile(r"(?<![\w./:~$*{}<>-])(?:\.ci|[\w*{}<>-][\w.*{}<>-]*)(?:/[\w.*{}<>-]*)+")
BARE = re.compile(r"(?<![\w./:~$*{}<>-])\w[\w.-]*(?:" + "|".join(map(re.escape, BARE_EXTENSIONS)) + r")(?![\w/-])")
EXCLUDED = (
    re.compile(r".*[*{}<>].*"),  # globs and placeholders: examples/results/bench_epochs*, spec/acceptance_rate_pos_{j}
    re.compile(r"(spec|rollout)/\w+"),  # slash-namespaced metric keys: spec/mean_k, rollout/steps
    re.compile(r"(vllm|trl)/.*"),  # upstream files: vllm/v1/core/sched/scheduler.py, trl/generation/...
    re.compile(r"examples/results/cuda"),  # examples/device_check.sh's output folder
)


def _files(folder: str, pattern: str) -> list[Path]:
    return sorted(path for path in (ROOT / folder).rglob(pattern) if "__pycache__" not in path.parts)


def _names() -> set[str]:
    """The names of the repository's files: hidden folders but .ci, build outputs and caches left out."""
    tops = [top for top in ROOT.iterdir() if top.name == ".ci"
            or not (top.name.startswith(".") or top.name == "build" or top.name.endswith(".egg-info"))]
    return {path.name for top in tops for path in ([top] if top.is_file() else top.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts}


PYTHON = [path for folder in ("spec", "rollout", "trainers", "examples", "tests") for path in _files(folder, "*.py")]
SCRIPTS = [*_files("examples", "*.sh"), *_files("examples", "*.yaml"),
           *(path for path in (ROOT / ".ci").iterdir() if path.is_file())]
CODE = sorted({*PYTHON, *_files("spec", "*.[ch]"), *SCRIPTS} - {Path(__file__).resolve()})
DOCS = sorted([*ROOT.glob("*.md"), *(path for path in _files("docs", "*.md") if "notes" not in path.parts)])
NAMES = _names()


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every repo path the text cites, bare names left out."""
    cited = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            token = match.group(0).rstrip(".")
            if not (token.endswith(EXTENSIONS) or token.split("/")[0] in TOP_FOLDERS):
                continue
            if not any(rule.fullmatch(token) for rule in EXCLUDED):
                cited.append((number, token))
    return cited


def cited_names(text: str) -> list[tuple[int, str]]:
    """(line number, name) of every bare source or doc file name the text cites."""
    return [(number, match.group(0)) for number, line in enumerate(text.splitlines(), 1)
            for match in BARE.finditer(line)]


def missing(path: Path, text: str, is_code: bool) -> list[str]:
    """'file:line: path' for each citation in `text` (the file at `path`) that names no file or folder; bare names
    count in code only."""
    relative = path.relative_to(ROOT)
    bases = (ROOT, ROOT / relative.parts[0], path.parent)
    broken = [(number, token) for number, token in cited_paths(text)
              if not any((base / token).exists() for base in bases)]
    if is_code:
        broken += [(number, name) for number, name in cited_names(text) if name not in NAMES]
    return [f"{relative}:{number}: {token}" for number, token in sorted(broken)]


def test_every_cited_path_exists():
    broken = [line for path in [*CODE, *DOCS] for line in missing(path, path.read_text(), path in CODE)]
    assert not broken, "cited paths that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("text, expected", [
    ("see rollout/vllm_backend/gone.py and tests/test_gone.py", ["rollout/vllm_backend/gone.py", "tests/test_gone.py"]),
    ("docs/gone.md, .ci/gone, examples/results/gone.json.", ["docs/gone.md", ".ci/gone", "examples/results/gone.json"]),
    ("(vllm_backend/gone.py) and `gone_module.py`", ["vllm_backend/gone.py", "gone_module.py"]),
    ("https://github.com/owner/repo/blob/main/x.py /tmp/a/b.json ~/c/d.md owner/repo", []),
    ("examples/results/bench_*.json rollout/default_models/{target}/ spec/acceptance_rate_pos_<j> spec/mean_k", []),
    ("vllm/v1/spec_decode/eagle.py trl/trainer/grpo_trainer.py", []),
])
def test_the_rule_finds_made_up_paths_and_skips_the_excluded(text, expected):
    found = missing(ROOT / "rollout" / "made_up.py", text, is_code=True)
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted(expected)
