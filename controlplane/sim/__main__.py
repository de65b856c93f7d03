"""``python -m controlplane.sim profile|bench``: measure a replica profile from one real replica, or run the
policy benchmark (ours against the HPA baseline on the Azure trace and a synthetic bursty one)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from controlplane.autoscale.profile import CalibrationPlan, calibrate
from controlplane.sim import bench as sim_bench


# ---- the module's commands --------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controlplane.sim", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    prof = sub.add_parser("profile", help="measure a replica profile from one real replica (about a minute)")
    prof.add_argument("--out", required=True, help="JSON file to write")
    prof.add_argument("--threads", type=int, default=1, help="torch threads of the replica")
    bench = sub.add_parser(
        "bench", help="ours vs the HPA baseline on the Azure trace and a synthetic bursty one"
    )
    sim_bench.add_arguments(bench)
    args = p.parse_args(argv)
    if args.command == "profile":
        return _profile(args)
    return sim_bench.run(args)


def _profile(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    profile = calibrate(replace(CalibrationPlan(), num_threads=args.threads), progress=print)
    with open(args.out, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
    print(
        f"step = {profile.step_base_s * 1e3:.2f} ms + {profile.per_seq_s * 1e3:.3f} ms/seq + "
        f"{profile.per_prefill_token_s * 1e3:.4f} ms/prefill token + {profile.per_context_token_s * 1e6:.4f} "
        f"us/context token; start {profile.start_s:.2f}s -> {args.out} "
        f"(measured in {time.perf_counter() - started:.0f}s)"
    )
    return 0



if __name__ == "__main__":
    sys.exit(main())
