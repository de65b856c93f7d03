"""The registry of fault kinds: what can be injected here, and why the rest cannot.

A kind whose implementation reports ``available=False`` (or whose module failed to import) stays listed
with its reason, so a console can show it greyed out; :meth:`Catalogue.get` refuses it with
:class:`FaultUnavailable`. Optional families are modules exposing ``faults() -> Sequence[Fault]``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from chaos.faults.base import Fault, FaultKindInfo, FaultSpec, FaultUnavailable
from chaos.faults.cluster import ClusterControl, cluster_faults
from chaos.faults.link import LinkControl, link_faults
from chaos.faults.process import process_faults
from chaos.faults.replica import AdminTokens, replica_faults

logger = logging.getLogger(__name__)

OPTIONAL_MODULES: tuple[str, ...] = ("chaos.faults.partition", "chaos.faults.zone", "chaos.faults.stress")


class Catalogue:
    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self._faults: dict[str, Fault] = {}
        self._missing: dict[str, FaultKindInfo] = {}
        for fault in faults:
            self.register(fault)

    def register(self, fault: Fault) -> None:
        info = fault.describe()
        if info.kind in self._faults or info.kind in self._missing:
            raise ValueError(f"kind: {info.kind!r} is already registered")
        self._faults[info.kind] = fault

    def register_unavailable(self, kind: str, reason: str, *, family: str = "") -> None:
        """List a kind that has no usable implementation here (its module failed to load)."""
        if kind in self._faults or kind in self._missing:
            raise ValueError(f"kind: {kind!r} is already registered")
        self._missing[kind] = FaultKindInfo(kind=kind, family=family or kind, description="",
                                            available=False, unavailable_reason=reason)

    def describe(self) -> list[FaultKindInfo]:
        """Every kind, available or not, sorted by family then kind."""
        infos = [f.describe() for f in self._faults.values()] + list(self._missing.values())
        return sorted(infos, key=lambda i: (i.family, i.kind))

    def kinds(self) -> list[str]:
        return [i.kind for i in self.describe()]

    def info(self, kind: str) -> FaultKindInfo:
        if kind in self._missing:
            return self._missing[kind]
        return self._lookup(kind).describe()

    def get(self, kind: str) -> Fault:
        """The implementation of ``kind``; KeyError when unknown, FaultUnavailable when it cannot run."""
        info = self.info(kind)
        if not info.available:
            raise FaultUnavailable(f"unavailable: {info.unavailable_reason or 'no reason given'}")
        return self._faults[kind]

    def validate(self, spec: FaultSpec) -> Fault:
        """The implementation for ``spec`` once ``spec`` passed its validation."""
        fault = self.get(spec.kind)
        fault.validate(spec)
        return fault

    def _lookup(self, kind: str) -> Fault:
        try:
            return self._faults[kind]
        except KeyError:
            raise KeyError(f"kind: unknown fault kind {kind!r} (known: {', '.join(self.kinds())})") from None


def load_optional(catalogue: Catalogue, module_name: str, controls: Mapping[str, Any] | None = None) -> None:
    """Register the faults of ``module_name``, or list its family as unavailable with the reason. Its
    ``faults()`` factory gets those of ``controls`` (such as ``cluster``) that it names as parameters."""
    family = module_name.rsplit(".", 1)[-1]
    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, "faults", None)
        if not callable(factory):
            raise AttributeError("it defines no faults() factory")
        wanted = inspect.signature(factory).parameters
        found = list(factory(**{k: v for k, v in (controls or {}).items() if k in wanted}))
        strays = [f for f in found if not isinstance(f, Fault)]
        if strays:
            raise TypeError(f"{module_name}.faults() returned {strays[0]!r}, not a Fault")
    except Exception as exc:  # an optional family must never break the catalogue
        logger.warning("fault family %s unavailable: %s", family, exc)
        catalogue.register_unavailable(family, f"{module_name}: {exc}", family=family)
        return
    for fault in found:
        catalogue.register(fault)


def default_catalogue(*, admin_tokens: AdminTokens | None = None, link: LinkControl | None = None,
                      cluster: ClusterControl | None = None,
                      optional_modules: Sequence[str] = OPTIONAL_MODULES) -> Catalogue:
    """Every kind; ``link``: the gateway's toxics (without it the link kinds are listed unavailable);
    ``cluster``: the nodes replicas are placed on (without it the node kinds are listed unavailable)."""
    catalogue = Catalogue([*process_faults(), *replica_faults(admin_tokens=admin_tokens),
                           *link_faults(link), *cluster_faults(cluster)])
    for name in optional_modules:
        load_optional(catalogue, name, {"cluster": cluster})
    return catalogue
