"""Data files shipped with the control plane (the default replica profile, the evaluation set's traces)."""
