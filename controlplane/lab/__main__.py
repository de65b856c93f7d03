"""``python -m controlplane.lab up|down|status``: the multi-host lab (see :mod:`controlplane.lab.lab`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from controlplane.lab.lab import Lab, LabStatus
from controlplane.lab.network import LabError
from controlplane.lab.topology import LabConfig


def _print_status(status: LabStatus) -> None:
    print(f"ray address: {status.ray_address}  ({'up' if status.is_up else 'not up'}); "
          f"Ray's processes hold {status.rss_bytes / 2**20:.0f} MiB resident")
    print(f"{'HOST':<6} {'ZONE':<6} {'ADDRESS':<12} {'NETNS':<5} {'LINK':<5} {'RAY':<4} {'PROCS':>5} "
          f"{'RSS MiB':>8}")
    for h in status.hosts:
        print(f"{h.name:<6} {h.zone or '-':<6} {h.address:<12} {'yes' if h.namespace else 'no':<5} "
              f"{'up' if h.link_up else 'down':<5} {'yes' if h.raylet else 'no':<4} {h.processes:>5} "
              f"{h.rss_bytes / 2**20:>8.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m controlplane.lab",
        description="a Ray cluster on this machine: one network namespace per zone, on a bridge of its own")
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--zones", default="az-a,az-b,az-c", help="comma-separated zone names (up)")
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "up":
            lab = Lab(LabConfig(zones=tuple(z.strip() for z in args.zones.split(",") if z.strip())))
            status = lab.up()
        else:
            lab = Lab.find() or Lab()
            if args.command == "down":
                removed = lab.down()
                print(f"lab down: removed {len(removed)} namespaces and links" if removed else "no lab here")
                return 0
            status = lab.status()
    except (LabError, ValueError) as exc:
        print(f"controlplane.lab: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        _print_status(status)
    return 0 if status.is_up or args.command == "status" else 1


if __name__ == "__main__":
    sys.exit(main())
