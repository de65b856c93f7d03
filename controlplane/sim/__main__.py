"""``python -m controlplane.sim bench|evalset|capacity``: the policy benchmark (ours against the HPA
baseline on the Azure trace and a synthetic bursty one, or on the evaluation set), the evaluation set's
traces (checked against their recipes, or regenerated with ``--write``), or what a fixed fleet gives on a
recipe's requests at steady rates. A replica profile is measured by ``controlplane calibrate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from controlplane.sim import bench as sim_bench
from controlplane.sim import capacity, evalset


# ---- the module's commands --------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controlplane.sim", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench", help="ours vs the HPA baseline on the Azure trace and bursty ones, or the evaluation set"
    )
    sim_bench.add_arguments(bench)
    traces = sub.add_parser("evalset", help="the evaluation set's traces: summary and check, or --write")
    traces.add_argument("--write", action="store_true",
                        help="regenerate the kept files (controlplane/data/evalset/) from their recipes")
    fixed = sub.add_parser("capacity", help="what static:N gives on a recipe's requests at steady rates")
    capacity.add_arguments(fixed)
    args = p.parse_args(argv)
    if args.command == "evalset":
        return _evalset(write=args.write)
    if args.command == "capacity":
        return capacity.run(args)
    return sim_bench.run(args)


def _evalset(*, write: bool) -> int:
    """Print each trace's summary; with ``write`` regenerate the files, otherwise check them."""
    if write:
        sizes = evalset.write_evalset()
        print(f"wrote {len(sizes)} traces, {sum(sizes.values()) / 1e3:.0f} kB, to {evalset.data_folder()}")
    stale = []
    for name in evalset.NAMES:
        rows = evalset.evalset_rows(name)
        kept = evalset.kept_rows(name)
        stale += [] if kept == rows else [name]
        print(evalset.summary(name, rows) + ("" if kept == rows else "  (kept file differs from its recipe)"))
    if stale:
        print(f"stale: {', '.join(stale)}; regenerate with python -m controlplane.sim evalset --write")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
