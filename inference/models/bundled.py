"""Where the bundled models live and how they get there, without torch.

A bundled model (``default``, ``default-moe``) is an ordinary Hugging Face folder built on first use under
``<state>/models/<folder>``, moved into place whole and marked complete last. Finding a built one needs
nothing but the file system, so a process that only names or checks models (the control plane at every
start and rollout) does not pay for importing torch; building one imports the recipe
(:mod:`inference.models.default`, :mod:`inference.models.default_moe`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

STATE_DIR_ENV = "LLMSRE_STATE_DIR"
COMPLETE_MARKER = ".complete"
DEFAULT_MODEL_NAME = "default-v2"
DEFAULT_MOE_MODEL_NAME = "default-moe-v1"
# The name a fleet or a replica is given -> the folder its recipe builds (a new recipe, a new folder).
BUNDLED_FOLDERS = {"default": DEFAULT_MODEL_NAME, "default-moe": DEFAULT_MOE_MODEL_NAME}


def default_state_dir() -> Path:
    """``$LLMSRE_STATE_DIR``, else ``~/.local/state/llm-sre``."""
    configured = os.environ.get(STATE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".local" / "state" / "llm-sre"


def bundled_folder(folder_name: str, state_dir: Path | None = None) -> Path:
    return (default_state_dir() if state_dir is None else Path(state_dir)) / "models" / folder_name


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def built_folder(model: str, state_dir: Path | None = None) -> Path | None:
    """A bundled model's folder when it is built and complete; None when it is not (or not bundled)."""
    name = BUNDLED_FOLDERS.get(model)
    if name is None:
        return None
    folder = bundled_folder(name, state_dir)
    return folder if is_complete(folder) else None


def ensure_bundled_model(name: str, build: Callable[[Path], None], state_dir: Path | None = None) -> Path:
    """``<state>/models/<name>``: ``build`` writes it into a staging folder, moved into place once whole;
    safe against crashes and concurrent builders."""
    folder = bundled_folder(name, state_dir)
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(folder.parent / f".{name}.lock"):
        if is_complete(folder):  # another process built it while we waited
            return folder
        logger.info("building the bundled model %s into %s", name, folder)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder.parent))
        try:
            build(staging)
            _install(staging, folder, name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _install(staging: Path, folder: Path, name: str) -> None:
    """Atomically move the built folder into place, first clearing a folder that lacks the marker."""
    if folder.exists():
        logger.warning("removing incomplete bundled model folder %s", folder)
        stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale.", dir=folder.parent))
        os.replace(folder, stale / folder.name)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(staging, folder)
