"""A multi-host lab on one machine: one network namespace per zone, each a Ray node on a bridge of its own.

Where it sits: beside the control plane, not in it. Tests, the fleet benchmark and demos build a Ray
cluster here (``python -m controlplane.lab up``) and point ``controlplane up`` at it as a Ray Client
(``ray://10.199.0.2:10001``); the control plane runs no Ray process of its own. The lab also brings a
stopped host back and cuts or restores a host's link, which the chaos layer's node faults use to revert
(:mod:`controlplane.lab.lab`). It imports nothing of the control plane above the error tree, so ``app``,
``bench`` and ``cli`` may all use it.
"""
