"""The Dash web console; it talks to the control plane through ``controlplane.client`` only."""
