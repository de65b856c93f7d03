"""The fleet: desired replicas per zone reconciled through a replica backend (local processes today)."""
