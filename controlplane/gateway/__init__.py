"""The data plane's entry point: the OpenAI-compatible gateway (handler, routing, admission, upstream pool,
liveness, health checks, toxics, response assembly, metrics) and its HTTP server."""
