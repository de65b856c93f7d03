"""The autoscaler: the live loop (observe, decide, apply once, record), its pure policies, cron windows,
the anomaly source and the replica profile that sizes the fleet."""
