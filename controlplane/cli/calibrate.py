"""``controlplane calibrate``: measure this host's replica and write the profile the control plane runs on.

controlplane calibrate                      # about two minutes; writes <state_dir>/replica_profile.json
controlplane calibrate --quick --out p.json
controlplane calibrate --config c.toml      # the replica as that file's [fleet] runs it (C++ decode kernel)

It starts one replica of the default model (as ``controlplane up`` does: its own process, one torch thread
by default), times its start, prefills and decode steps (:mod:`controlplane.autoscale.calibrate`), fits the
step-time model (:mod:`controlplane.autoscale.profile`) and prints every point measured against what the
fit predicts, calibration and held-out points apart. The profile goes to the state folder, where the
autoscaler and the what-if simulator of a control plane started afterwards find it. A fit whose error on
held-out points is over the bound (15%) is not installed there: it is written beside, as
``<out>.rejected``, and the command exits 1 (``--force`` installs it anyway).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from controlplane.autoscale.profile import CALIBRATED_PROFILE, HELD_OUT_BOUND, ProfilePoint, ReplicaProfile
from controlplane.cli.exits import UsageError

SUMMARY = "measure this host's replica (prefill, decode steps, KV capacity, start) and write its profile"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--config", default=None, help="the TOML file `controlplane up` runs with (its "
                                                    "state_dir receives the profile)")
    cmd.add_argument("--out", default=None, help=f"write the profile here (default: <state_dir>/"
                                                 f"{CALIBRATED_PROFILE})")
    cmd.add_argument("--threads", type=int, default=1, help="torch threads of the replica, as the fleet "
                                                            "runs it (default %(default)s)")
    cmd.add_argument("--cpu-decode-kernel", action=argparse.BooleanOptionalAction, default=None,
                     help="the replica decodes with the C++ kernel, or not (default: as the --config file's "
                          "[fleet] cpu_decode_kernel says, else on where it applies)")
    cmd.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                     help="the replica packs its linear weights (the C++ kernel's blocks, or oneDNN's), or "
                          "not (default: as the --config file's [fleet] packed_weights says, else on where "
                          "it applies)")
    cmd.add_argument("--cpu-limit", type=float, default=None, metavar="CORES",
                     help="measure the replica under this CPU limit, as the fleet runs it (default: as the "
                          "--config file's [fleet] replica_cpu_limit says, else none)")
    cmd.add_argument("--quick", action="store_true", help="fewer points, two rounds (about 30 s)")
    cmd.add_argument("--force", action="store_true", help=f"install the profile even if its held-out "
                                                          f"error is over {HELD_OUT_BOUND:.0%}%")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from controlplane.autoscale.calibrate import QUICK_PLAN, CalibrationPlan, calibrate_with_bar
    from controlplane.config import load_config
    from controlplane.store.files import private_dir

    if args.threads < 1:
        raise UsageError("calibrate: --threads must be >= 1")
    if args.cpu_limit is not None and not args.cpu_limit >= 0.1:
        raise UsageError("calibrate: --cpu-limit must be at least 0.1 (cores)")
    config = load_config(args.config)
    if args.out:
        out = Path(args.out)
    else:  # the state folder, made as `controlplane up` makes it when this runs first on a fresh host
        out = private_dir(config.state_path) / CALIBRATED_PROFILE
    if not out.parent.is_dir():
        raise UsageError(f"calibrate: {out.parent} is not a folder")
    plan = replace(QUICK_PLAN if args.quick else CalibrationPlan(), num_threads=args.threads,
                   cpu_decode_kernel=(config.fleet.cpu_decode_kernel if args.cpu_decode_kernel is None
                                      else args.cpu_decode_kernel),
                   packed_weights=(config.fleet.packed_weights if args.packed_weights is None
                                   else args.packed_weights),
                   cpu_limit=config.fleet.replica_cpu_limit if args.cpu_limit is None else args.cpu_limit,
                   fork=config.fleet.fork_replicas)
    started = time.monotonic()
    profile = calibrate_with_bar(plan)
    print(report(profile))
    error = profile.fit_error()
    rejected = error.over_bound and not args.force
    target = out.with_name(out.name + ".rejected") if rejected else out
    target.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    took = time.monotonic() - started
    if rejected:
        print(f"held-out error {error.held_out_max:.1%} is over the {HELD_OUT_BOUND:.0%} bound: "
              f"not installed; written to {target} (measured in {took:.0f}s; rerun when the host is quiet, "
              f"or --force)")
        return 1
    print(f"profile written to {target} (measured in {took:.0f}s); a control plane started now uses it")
    return 0


def report(profile: ReplicaProfile) -> str:
    """Every point, measured against predicted, then the model and its errors."""
    lines = [f"{'SET':<9} {'STEP':<28} {'MEASURED':>9} {'PREDICTED':>9} {'ERROR':>7}"]
    for kind, points in (("fit", profile.points), ("held-out", profile.held_out)):
        for p in points:
            lines.append(f"{kind:<9} {_what(p):<28} {p.seconds * 1e3:7.1f}ms "
                         f"{profile.predict(p) * 1e3:7.1f}ms {profile.relative_error(p):6.1%}")
    lines.append(
        f"step = {profile.step_base_s * 1e3:.2f} ms + {profile.per_seq_s * 1e3:.3f} ms/decoding seq + "
        f"{profile.per_prefill_token_s * 1e3:.4f} ms/prefill token + {profile.per_prefill_pair_s * 1e9:.2f} "
        f"ns/prefill attention pair + {profile.per_context_token_s * 1e6:.4f} us/context token")
    beside = "" if profile.busy_start_s is None else f", {profile.busy_start_s:.2f}s beside a busy replica"
    lines.append(f"start {profile.start_s:.2f}s alone{beside}; KV capacity {profile.kv_capacity_tokens:,} "
                 f"tokens; {profile.max_num_seqs} sequences, {profile.max_num_batched_tokens} tokens a step "
                 "at most")
    lines.append(f"fit error: {profile.fit_error().describe()} (bound {HELD_OUT_BOUND:.0%} held out)")
    return "\n".join(lines)


def _what(p: ProfilePoint) -> str:
    if p.num_decode == 0:
        return f"prefill {p.num_prefill_tokens} tokens"
    return f"decode {p.num_decode} seqs x {p.context_tokens // p.num_decode} ctx"
