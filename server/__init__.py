"""The serving layer: engine, scheduler, sampling, model runner, HTTP API, CLI."""
