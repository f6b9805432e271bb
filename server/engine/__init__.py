"""The engine core: scheduler, sequences, the stop rule, detokenizer, outputs. Host-side state
only; the device work goes through the worker (server/worker/)."""

from server.engine.llm_engine import LLMEngine
from server.engine.outputs import EngineSnapshot, RequestOutput, merge_outputs
from server.engine.requests import EngineFatalError, RequestBounds, RequestError, validate_request

__all__ = ["LLMEngine", "EngineSnapshot", "RequestOutput", "merge_outputs", "EngineFatalError", "RequestBounds",
           "RequestError", "validate_request"]
