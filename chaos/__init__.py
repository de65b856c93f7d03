"""Faults with guaranteed revert, Chaos Toolkit-format experiments and RTO/RPO drills.

Sits between the control plane and the inference replicas: it may import ``inference`` but never
``controlplane`` or ``dashboards``.
"""
