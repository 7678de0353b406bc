"""The embedded default pair: a small Llama target and a much smaller draft sharing its tokenizer, trained by
examples/train_default_pair.py on the long-tailed task of rollout/default_task.py and shipped in float16."""

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "default_models"


def default_model_paths() -> dict[str, str]:
    """{"target": path, "draft": path} of the shipped pair (local folders, loadable offline)."""
    return {name: str(MODELS_DIR / name) for name in ("target", "draft")}
