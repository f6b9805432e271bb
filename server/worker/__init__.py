"""The worker: the device side of the engine (input packing, the model runner, CUDA graphs, the
sampler, KV-cache sizing). It reads the engine's records only through the protocol in
server/worker/inputs.py and models only through their contract (models/base.py)."""

from server.worker.runner import ModelRunner
from server.worker.steps import StepHandle, StepResult
from server.worker.setup import Worker, start_worker

__all__ = ["ModelRunner", "StepHandle", "StepResult", "Worker", "start_worker"]
