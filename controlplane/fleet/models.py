"""The models a fleet serves: a bundled one by name (``default``, ``default-moe``: built on first use under
the state folder, see :mod:`inference.models.bundled`) or a Hugging Face folder.

The control plane builds a bundled model itself before it starts replicas of it (at ``up``, at a rollout
to it), so that replicas started together do not each wait on one build inside their start. A model
already built is found on the file system: the control plane imports torch only to build one.
"""

from __future__ import annotations

from pathlib import Path

from inference.models.bundled import BUNDLED_FOLDERS, built_folder


def is_bundled(model: str) -> bool:
    return model in BUNDLED_FOLDERS


def ensure_bundled_model(model: str, state_dir: Path) -> Path | None:
    """Build ``model`` under ``state_dir`` now when it is a bundled one not built yet, and answer its
    folder; None for a model folder (nothing to build)."""
    if not is_bundled(model):
        return None
    folder = built_folder(model, state_dir)
    if folder is not None:
        return folder
    from inference.engine import BUNDLED_MODELS  # torch: only to build one

    return BUNDLED_MODELS[model](state_dir)


def served_model_name(model: str) -> str:
    """The name a replica of ``model`` answers to by default: a bundled model's name, a folder's last part."""
    return model if is_bundled(model) else Path(model).name
