"""Fault kinds: every kind exposes the same verbs (validate, inject, revert, describe).

``base`` holds the shared vocabulary, one module per family holds the kinds (``process``, ``replica``,
``network``); :mod:`chaos.catalogue` gathers them.
"""
