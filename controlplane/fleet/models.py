"""The models a fleet serves: a bundled one by name (``default``, ``default-moe``: built on first use under
the state folder, see :data:`inference.engine.BUNDLED_MODELS`) or a Hugging Face folder.

The control plane builds a bundled model itself before it starts replicas of it (at ``up``, at a rollout
to it), so that replicas started together do not each wait on one build inside their start.
"""

from __future__ import annotations

from pathlib import Path


def bundled_models() -> tuple[str, ...]:
    """The bundled models' names."""
    from inference.engine import BUNDLED_MODELS  # torch: only where a model is built or named

    return tuple(BUNDLED_MODELS)


def is_bundled(model: str) -> bool:
    return model in bundled_models()


def ensure_bundled_model(model: str, state_dir: Path) -> Path | None:
    """Build ``model`` under ``state_dir`` now when it is a bundled one, and answer its folder; None for a
    model folder (nothing to build)."""
    from inference.engine import BUNDLED_MODELS

    ensure = BUNDLED_MODELS.get(model)
    return None if ensure is None else ensure(state_dir)


def served_model_name(model: str) -> str:
    """The name a replica of ``model`` answers to by default: a bundled model's name, a folder's last part."""
    return model if is_bundled(model) else Path(model).name
