"""The house's shape, checked from the source: dependencies point one way (trainers -> rollout -> spec), the spec core
never imports adaptive verification, trl and vllm stay in their rooms, and no source or docs file (packages, their C,
examples, tests, docs, README) outgrows 400 lines."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec", "rollout", "trainers")
SOURCES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
NATIVE = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.[ch]"))
TEXT_FILES = sorted([*SOURCES, *NATIVE, *ROOT.glob("*.md"), *ROOT.glob("*.toml"), *ROOT.glob("*.py"),
                     *(path for folder in ("examples", "tests", "docs") for path in (ROOT / folder).rglob("*")
                       if path.suffix in (".py", ".md", ".sh", ".yaml"))])
MAX_LINES = 400


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports_any(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(name for name in _imports(path) if name.split(".")[0] in prefixes or name.startswith(prefixes))


@pytest.mark.parametrize("path", SOURCES, ids=_module)
def test_dependencies_point_one_way(path):
    package = _module(path).split(".")[0]
    above = {"spec": ("rollout", "trainers"), "rollout": ("trainers",), "trainers": ()}[package]
    assert not _imports_any(path, above), f"{_module(path)} imports from a package that depends on it"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.parts[-2] != "adaptive" and "spec" in p.parts],
                         ids=_module)
def test_the_spec_core_never_imports_adaptive_verification(path):
    assert not [name for name in _imports(path) if name.startswith("spec.adaptive")]


@pytest.mark.parametrize("path", SOURCES, ids=_module)
def test_trl_stays_in_trainers_and_vllm_in_its_backend(path):
    module = _module(path)
    if not module.startswith("trainers"):
        assert not _imports_any(path, ("trl",)), f"{module} imports trl"
    if not module.startswith("rollout.vllm_backend."):
        assert not _imports_any(path, ("vllm",)), f"{module} imports vllm"


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_file_outgrows_400_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_importing_the_packages_does_not_import_vllm():
    """vllm is imported lazily: only building a vLLM engine or running `rollout serve` imports it."""
    code = ("import sys, rollout, rollout.server_backend.backend, rollout.vllm_backend, rollout.vllm_backend.serve; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("module", ["rollout.vllm_backend.guard", "rollout.vllm_backend.wire",
                                    "rollout.vllm_backend.plugin"])
def test_what_every_vllm_process_loads_imports_no_torch(module):
    """The API server's gate, the wire module and the plugin entry point (which vLLM runs in every process it starts)
    import the standard library and wire.py only: no torch, no transformers, no engine, no adaptive verification."""
    code = (f"import sys, {module}; heavy = ('torch', 'transformers', 'spec', 'numpy', 'rollout.generator'); "
            "print(sorted(m for m in sys.modules if m in heavy or m.startswith('spec.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def test_the_wire_names_the_projects_drafter_methods():
    from rollout.vllm_backend.wire import DRAFTER_METHODS
    from spec.config import PROTOCOL_METHODS
    assert DRAFTER_METHODS == tuple(PROTOCOL_METHODS)


OUTSIDE_ROLLOUT = sorted([*(ROOT / "trainers").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])


@pytest.mark.parametrize("path", OUTSIDE_ROLLOUT, ids=lambda p: str(p.relative_to(ROOT)))
def test_trainers_and_examples_use_the_generator_not_its_backend(path):
    """What trainers and examples need from a backend is a generator method: the backend is rollout's business."""
    lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if ".backend." in line]
    assert not lines, f"{path.name} reaches through the generator into its backend at lines {lines}"
