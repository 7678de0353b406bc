"""The Runner protocol (spec/runner.py): both runners implement every member it declares, and it declares exactly the
members that the packages use on a runner."""

import ast
import inspect
from pathlib import Path

import pytest

from conftest import tiny_llama
from spec import Runner
from spec.model_runner import PaddedRunner, RaggedRunner

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, object]:
    """Runner's members: annotated attributes (name -> type), methods and properties (name -> function, property)."""
    members = dict(Runner.__annotations__)
    members.update({name: value for name, value in vars(Runner).items() if not name.startswith("_")})
    return members


def _mismatches(runner) -> list[str]:
    """The declared members that `runner` lacks, holds with another type, or takes other parameters for."""
    bad = []
    for name, declared in _declared().items():
        value = getattr(runner, name, None)
        if isinstance(declared, property):
            is_ok = isinstance(value, inspect.signature(declared.fget).return_annotation)
        elif callable(declared) and not isinstance(declared, type):
            is_ok = callable(value) and (list(inspect.signature(value).parameters)
                                         == list(inspect.signature(declared).parameters)[1:])  # less self
        else:
            is_ok = isinstance(value, declared)
        if not is_ok:
            bad.append(name)
    return bad


@pytest.mark.parametrize("runner_cls", [RaggedRunner, PaddedRunner])
def test_both_runners_implement_every_member_of_the_protocol(runner_cls):
    assert _mismatches(runner_cls(tiny_llama(0), max_num_seqs=2, max_model_len=16)) == []


def test_a_runner_missing_a_member_or_taking_other_parameters_is_caught():
    runner = PaddedRunner(tiny_llama(0), max_num_seqs=2, max_model_len=16)
    runner.crop = lambda slot: None  # no length
    runner.device = "cpu"  # a str, not a torch.device
    del runner.model
    assert sorted(_mismatches(runner)) == ["crop", "device", "model"]


def _runner_uses(path: Path) -> set[str]:
    """Attributes read off anything named `runner` (self.runner.forward, runner.model, ...) in a source file."""
    uses = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if name == "runner":
                uses.add(node.attr)
    return uses


def test_the_protocol_declares_exactly_what_the_packages_use_on_a_runner():
    sources = [path for package in ("spec", "rollout", "trainers") for path in (ROOT / package).rglob("*.py")]
    used = set().union(*map(_runner_uses, sources))
    assert used == set(_declared())
