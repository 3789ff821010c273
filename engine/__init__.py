"""The engine: memory pool, weight store, workers, scheduler, runners, sampling."""
