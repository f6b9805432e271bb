"""Tensor parallelism, the worker's side: one process per rank (GPU), rank 0 the engine's.

- `peers.py` (rank 0): starts the other ranks' processes and the group, and sends each forward's
  packed inputs to them; a rank that dies stops the engine.
- `follower.py` (ranks 1..N-1): brings up the same runner over its shard (server/worker/setup.py),
  then runs every forward rank 0 sends, in order.
- `messages.py`: what travels from rank 0 to the others.

The sharded layers and the group's collectives are the models' (models/parallel/). This package's
__init__ imports nothing, so that its modules can be imported one by one without cycles.
"""
