"""The control plane's state: SQLite in WAL mode; what it acknowledged survives ``kill -9``."""
