"""The control plane: fleet, gateway, telemetry, autoscaler, alerts, schedules, store, REST API and CLI."""
