"""Paged decode attention on the CPU in C++, behind the engine's ``DecodeKernel`` hook (opt-in).

Where it sits: with ``EngineConfig.cpu_decode_kernel`` on a CPU device, the engine calls
:func:`load_cpu_decode_kernel` once and, when it returns a kernel, the model runner sets
``Attention.decode_kernel`` on every layer; Llama layers also take the extension's other calls
(:attr:`CpuDecodeKernel.layer_ops`: a pure decode step's whole layer in one call, and every other step's
RMSNorm and SiLU-and-multiply), and the engine packs the linear weights in the extension's own blocks
where it was built for the dtype (:attr:`CpuDecodeKernel.blocked_ops`, ``inference/packed_linear.py``).
Prefill attention and the cache writes of steps that prefill keep the plain-torch path in
``attention.py``.

Why: the torch path gathers each sequence's paged keys and values into one padded tensor
(``index_select``) and then runs two batched products over it, so every cached value crosses memory three
times; at this model's size the products are also too small for the BLAS to run well. The kernel
(``kernels/paged_decode.cpp``) reads keys and values in place from their blocks, once each, and keeps
scores, softmax and sums in float32 (float32 and bfloat16 caches). It is built with the compiler torch was
built for (``torch.utils.cpp_extension``, ``-O3 -march=native``) the first time it is asked for (about 20
to 40 s, with a log line saying so), then loaded from torch's extension cache
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, under a name that carries a hash of
the CPU's instruction sets, the source and the Python environment: :func:`build_signature`) in well
under a second. One process builds or loads at a time (:func:`builder_turn`), and none waits on a build
that a killed process left unfinished. Without a compiler, or when the build fails, the engine logs
``CPU decode kernel unavailable: <reason>`` and runs the torch path; nothing else changes.

Not covered (the torch path runs): the INT8 cache and multi-head latent attention.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from inference.attention import DecodeKernel
from inference.kv_quant import KVCacheStore
from inference.models.llama import FusedOps
from inference.packed_linear import BlockedOps

logger = logging.getLogger(__name__)

EXTENSION_NAME = "llmsre_paged_decode"
SOURCE = "paged_decode.cpp"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_loaded: tuple[Any, str | None] | None = None  # (module or None, why not) once tried in this process


class CpuDecodeKernel:
    """The ``DecodeKernel`` over the built extension: ``(q, cache, block_tables, context_lens, scale)``."""

    __slots__ = ("_module",)

    def __init__(self, module: Any) -> None:
        self._module = module

    def __call__(self, query: torch.Tensor, cache: KVCacheStore, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        out: torch.Tensor = self._module.paged_decode(query, cache.k, cache.v, block_tables, context_lens,
                                                       scale)
        return out

    @property
    def layer_ops(self) -> FusedOps:
        """The same extension's calls for Llama layers: ``llama_decode_layer`` (a decoder layer of a pure
        decode step in one call), and ``rms_norm`` and ``silu_mul`` where they are vectorized (see
        ``inference.models.llama.CausalLM.fuse_decode_layers``)."""
        m = self._module
        vectorized = self.vectorized
        return FusedOps(decode_layer=m.llama_decode_layer, rms_norm=m.rms_norm if vectorized else None,
                        silu_mul=m.silu_mul if vectorized else None)

    @property
    def blocked_ops(self) -> BlockedOps | None:
        """The extension's own linear (:class:`inference.packed_linear.BlockedLinear`), for the dtypes this
        build runs it for (float32 with AVX-512, bfloat16 with AVX512_BF16); None on a CPU with neither."""
        m = self._module
        names: list[str] = m.blocked_dtypes()
        dtypes = frozenset(d for d in KERNEL_DTYPES if str(d).removeprefix("torch.") in names)
        return BlockedOps(pack=m.pack_blocked, linear=m.blocked_linear, dtypes=dtypes) if dtypes else None

    @property
    def vectorized(self) -> bool:
        """Built with AVX-512 (the CPU has it): the norm and the activation then beat ATen's; without, the
        Llama layers keep ATen's for them."""
        return bool(getattr(self._module, "avx512", False))


def load_cpu_decode_kernel() -> tuple[DecodeKernel | None, str | None]:
    """The kernel, built on first use in this environment, or (None, why not). Tried once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        module, reason = _loaded
    return (None, reason) if module is None else (CpuDecodeKernel(module), None)


def cpu_signature() -> str:
    """A short hash of this CPU's instruction sets: part of the extension's name, so that a build made
    ``-march=native`` on one machine is never loaded on another whose CPU lacks its instructions (a home
    folder, and so torch's extension cache, may be shared between machines)."""
    flags = platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        flags = next((line for line in f if line.startswith("flags")), flags)
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_signature(source: Path) -> str:
    """A short hash of what one build is made from: this CPU (:func:`cpu_signature`), the kernel's source
    (its path and its text), the Python environment and torch's version. Part of the extension's name,
    so each checkout or environment on a machine keeps a build of its own: under one name, ninja rebuilt
    the kernel whenever another checkout's replica had loaded it last (its command line names the source
    and torch's headers), and a replica of the other waited 47 s for the compiler where it takes 2 s."""
    parts = [cpu_signature(), str(source.resolve()), hashlib.sha256(source.read_bytes()).hexdigest(),
             sys.prefix, torch.__version__]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]


def _build() -> tuple[Any, str | None]:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler on PATH (Debian: apt-get install g++)"
    if shutil.which("ninja") is None:
        return None, "no ninja on PATH, which torch's extension builder needs (Debian: ninja-build)"
    try:
        from torch.utils import cpp_extension

        with resources.as_file(resources.files("inference") / "kernels" / SOURCE) as source:
            logger.info("CPU decode kernel: building or loading %s (the first build takes 20-40 s)", SOURCE)
            name = f"{EXTENSION_NAME}_{build_signature(source)}"
            folder = build_folder(name)
            with builder_turn(folder):
                module = cpp_extension.load(name=name, sources=[str(source)], build_directory=str(folder),
                                            extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a compiler error, a missing header: say which, run the torch path
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"build failed: {first[:300]}"
    logger.info("CPU decode kernel: loaded")
    return module, None


def build_folder(name: str) -> Path:
    """Where extension ``name`` is built and kept: ``TORCH_EXTENSIONS_DIR``, else torch's default root
    (``~/.cache/torch_extensions``), then the name."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


@contextlib.contextmanager
def builder_turn(folder: Path) -> Iterator[None]:
    """Build or load in ``folder`` one process at a time, and never wait on a dead builder.

    torch's builder marks a build in progress with a ``lock`` file that it removes when it is done, and
    every other process waits, polling, for as long as that file exists. A process killed while it
    builds (a Ctrl-C at the first ``controlplane up``, a replica stopped during its start) leaves the file
    behind, and every replica after it would wait forever. Here a builder first takes an ``flock`` on
    ``builder.lock`` in the same folder, which the kernel drops when its holder exits however it exits:
    whoever holds it is the only builder, so a ``lock`` file found then was left by a dead one."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "builder.lock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # released at close, or when this process dies
        left = folder / "lock"
        if left.exists():
            logger.warning("CPU decode kernel: removing %s, left by a build that did not finish", left)
            left.unlink(missing_ok=True)
        yield
