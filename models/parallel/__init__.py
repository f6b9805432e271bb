"""Tensor parallelism, the models' side: the group a model is built for and how its heads divide
over it (`group.py`), and the sharded layers the families build from (`layers.py`, imported by the
families themselves: it imports the kernels). The processes and what travels between them each
step are the worker's (server/worker/parallel/)."""

from models.parallel.group import (TensorParallel, built_as, close_tensor_parallel, init_tensor_parallel, kv_heads,
                                   shard_spec, tensor_parallel)

__all__ = ["TensorParallel", "built_as", "close_tensor_parallel", "init_tensor_parallel", "kv_heads", "shard_spec",
           "tensor_parallel"]
