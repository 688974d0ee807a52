"""The psgrad server: config, engine, model registry, broker, worker and api."""
