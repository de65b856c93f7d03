"""What the eBPF faults need from the machine, and the two system libraries they drive.

Sits under :mod:`chaos.faults.network`: it answers whether eBPF faults can run here (root, kernel headers
for bcc's run-time compile, bcc, pyroute2) and imports bcc and pyroute2. Debian ships both in the system
``dist-packages`` (``python3-bpfcc``, ``python3-pyroute2``; the PyPI package named ``bcc`` is unrelated),
so that folder is put on the path for the import alone and *after* the venv's own folders.
``scripts/install-ebpf.sh`` installs the packages and links the headers.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

SYSTEM_PACKAGES = Path("/usr/lib/python3/dist-packages")
INSTALL_HINT = "run scripts/install-ebpf.sh as root"


def import_system(name: str) -> ModuleType:
    """Import ``name`` from the venv, else from Debian's dist-packages without shadowing venv packages."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    folder = str(SYSTEM_PACKAGES)
    added = folder not in sys.path
    if added:
        sys.path.append(folder)  # appended: anything the venv has still wins
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(folder)


def kernel_headers() -> Path:
    """Where bcc looks for the running kernel's headers."""
    return Path("/lib/modules") / os.uname().release / "build"


def availability() -> tuple[bool, str | None]:
    """``(True, None)`` when eBPF faults can run here, else ``(False, "unavailable: <reason>")``."""
    reason = _missing()
    return (True, None) if reason is None else (False, f"unavailable: {reason}")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root (loading BPF programs and changing qdiscs need CAP_NET_ADMIN and CAP_BPF)"
    if not kernel_headers().is_dir():
        return f"no kernel headers at {kernel_headers()} ({INSTALL_HINT})"
    for module, package in (("bcc", "python3-bpfcc"), ("pyroute2", "python3-pyroute2")):
        try:
            import_system(module)
        except (ImportError, OSError) as exc:  # OSError: bcc's Python side present, libbcc.so missing
            return f"cannot import {module} ({package}; {INSTALL_HINT}): {exc}"
    return None
