"""Serving over HTTP: the load test (load_test.py: client, metrics, plots, report, sweep), compare.py
(flashpage against the naive transformers server, naive_server.py), the soak and the slow clients."""
