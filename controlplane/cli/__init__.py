"""The ``controlplane`` command and one module per command group."""
