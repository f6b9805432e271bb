"""kernels/pdl.py: programmatic dependent launch is off unless enabled, and then only on a CUDA GPU
of compute capability 9.0+ outside the interpreter; off, the kernels compile without it (their
PTX with it: tests/benchmarks/test_gemv_ir.py)."""

import torch

from kernels import pdl


def test_off_by_default_and_never_on_the_cpu():
    assert not pdl.active(torch.device("cpu")) and pdl.launch_options(torch.device("cpu")) == {}
    try:
        pdl.enable(True)
        assert not pdl.active(torch.device("cpu")) and pdl.launch_options(torch.device("cpu")) == {}
    finally:
        pdl.enable(False)


def test_the_engine_config_turns_it_on_in_the_worker(monkeypatch):
    """bring_up passes EngineConfig.enable_pdl on before anything compiles (a CUDA device of compute
    capability 9.0 would then launch the GEMVs with it)."""
    import server.worker.setup as setup
    from server.config import EngineConfig

    seen = []
    monkeypatch.setattr(pdl, "enable", seen.append)
    monkeypatch.setattr(setup, "tensor_parallel", lambda: (_ for _ in ()).throw(RuntimeError("stop here")))
    for on in (True, False):
        try:
            setup.bring_up(EngineConfig(model="unused", enable_pdl=on), None, torch.device("cpu"))
        except RuntimeError as e:
            assert "stop here" in str(e)
    assert seen == [True, False]
