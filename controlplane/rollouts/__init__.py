"""Releases by traffic weight: the model-version registry, canary steps with their analysis, and slice
experiments (chaos on a coloured share of traffic against a control share of the same size)."""
