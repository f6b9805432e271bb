"""Where time goes: py-spy over a served load (profile_server.py), one decode step's kernels
(profile_step.py), the API process's cost per streamed event (bench_api_events.py)."""
