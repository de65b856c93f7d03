"""Alert rules, their engine and actions, and their delegation to Prometheus/Alertmanager."""
