"""The control plane: fleet, gateway, telemetry, autoscaler, alerts, schedules, store, REST API and CLI."""

from importlib import metadata

try:
    __version__ = metadata.version("llm-sre-controlplane")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
