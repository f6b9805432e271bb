"""Where time goes: py-spy over a served load (profile_server.py), one decode step's kernels at a
model's shape and tensor-parallel size, by name and by category (profile_step.py,
kernel_categories.py), the API process's cost per streamed event (bench_api_events.py)."""
