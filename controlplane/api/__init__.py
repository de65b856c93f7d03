"""The REST API: the FastAPI app factory and one router module per area."""
