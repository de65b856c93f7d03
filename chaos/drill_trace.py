"""Where a drill's trace load comes from: the file a ``load.trace`` name stands for, checked to be an Azure
LLM trace, and its arrival offsets, read once per file version (a scenario counts the requests of its
window from them each time it is resolved)."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path

from inference.bench.datasets import AZURE_TRACE, AZURE_TRACE_ENV, read_trace, trace_file


def resolve_trace(name: str, *, cwd: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The trace file ``name`` stands for, absolute: ``azure`` is ``$CONTROLPLANE_AZURE_TRACE`` when set,
    else the trace shipped with the package (``inference.bench.datasets.trace_file``); anything else is a
    path (relative to the working directory). ValueError (naming ``load.trace``) when there is no such file
    or it is not an Azure LLM trace."""
    here = cwd if cwd is not None else Path.cwd()
    env = os.environ if environ is None else environ
    if name != AZURE_TRACE:
        where = "the path given"
    elif env.get(AZURE_TRACE_ENV, "").strip():
        where = f"{AZURE_TRACE!r}: from ${AZURE_TRACE_ENV}"
    else:
        where = f"{AZURE_TRACE!r}: the trace shipped with the package"
    try:
        path = (here / trace_file(name, env)).resolve()
    except FileNotFoundError as exc:
        raise ValueError(f"load.trace: {exc} ({where})") from exc
    if not path.is_file():
        raise ValueError(f"load.trace: no trace file at {path} ({where})")
    try:
        trace_offsets(path)
    except (OSError, ValueError, KeyError, csv.Error) as exc:
        raise ValueError(f"load.trace: {exc}") from exc
    return path


_TRACES: dict[tuple[str, int, int], tuple[float, ...]] = {}


def trace_offsets(path: Path) -> tuple[float, ...]:
    """The arrival offsets of a trace file, read once per (path, size, mtime)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _TRACES:
        _TRACES.clear()  # one trace at a time is plenty; a changed file is read again
        _TRACES[key] = tuple(r.offset for r in read_trace(path))
    return _TRACES[key]
