"""One query interface over replica metrics: the real Prometheus, or an in-process scraper."""
