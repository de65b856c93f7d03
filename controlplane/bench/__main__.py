"""``python -m controlplane.bench``: the control plane's benchmarks (``gateway``, ``fleet``, ``soak``,
``sim-vs-live``)."""

from __future__ import annotations

import argparse
import logging
import sys

from controlplane.bench.fleet import FleetBenchError, add_fleet_arguments, fleet_main
from controlplane.bench.gateway import BenchError, add_gateway_arguments, gateway_main
from controlplane.bench.live_slice import SimVsLiveError
from controlplane.bench.sim_vs_live import add_sim_vs_live_arguments, sim_vs_live_main
from controlplane.bench.soak import SoakError, add_soak_arguments, soak_main
from controlplane.lab.network import LabError
from inference.launcher import unwind_on_sigterm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    gateway = sub.add_parser("gateway", help="the gateway's added TTFT and E2E against calling a replica")
    add_gateway_arguments(gateway)
    gateway.set_defaults(func=gateway_main)
    fleet = sub.add_parser("fleet", help="time to 3 ready replicas, per added replica and to heal a kill, "
                                         "per backend (local processes, Ray)")
    add_fleet_arguments(fleet)
    fleet.set_defaults(func=fleet_main)
    soak = sub.add_parser("soak", help="hours of steady load with faults, watched for leaks of memory, file "
                                       "descriptors, tasks, KV blocks, store rows and series")
    add_soak_arguments(soak)
    soak.set_defaults(func=soak_main)
    svl = sub.add_parser("sim-vs-live", help="the fleet simulator against a live autoscaled fleet on the "
                                             "same trace slice: attainment, P95 latencies, replica-seconds")
    add_sim_vs_live_arguments(svl)
    svl.set_defaults(func=sim_vs_live_main)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would load the client
    unwind_on_sigterm()
    try:
        return int(args.func(args))
    except (BenchError, FleetBenchError, LabError, SimVsLiveError, SoakError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the benchmark stopped what it started", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
