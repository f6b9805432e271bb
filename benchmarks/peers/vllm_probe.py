"""Does the carried vLLM import on every path the peer harness uses? Run with vLLM's site on the path:

  PYTHONPATH=/tmp/vllm-site python3 benchmarks/peers/vllm_probe.py            # the GPU machine
  PYTHONPATH=<site> python benchmarks/peers/vllm_probe.py --cpu-stub        # a CPU box (fetch_vllm.sh)

It imports the modules behind `vllm serve` (Llama/Qwen2/Qwen3, bf16 and fp8 KV cache, FP8, AWQ, GPTQ
and compressed-tensors checkpoints), `LLM.generate`, XGrammar structured outputs, prefix caching,
ngram speculation and `vllm bench serve`, then runs the two CLIs' --help. Each failure is sorted:
**missing** (a Python module that is not there: a dependency fetch_vllm.sh must carry) or **native**
(a compiled library that cannot load, which on a CPU box is expected). Exit 1 on any missing module.

On a machine without a GPU, vLLM's platform is forced to CUDA with a Hopper's capability (9.0), so
that the CUDA-only branches import as they do on the H100. `--cpu-stub` also builds a stand-in
`libcuda.so.1` (the three driver entry points vLLM's extensions link, each returning
CUDA_ERROR_NO_DEVICE) so the extensions load and register their ops on a box without a driver.
Standard library only; vLLM is imported after the platform is set.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# This file's folder holds modules named like others (run, report, engines): not on vLLM's path. The
# repository goes last, for benchmarks.peers (the serve flags), after vLLM and its dependencies.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(Path(__file__).resolve().parents[2]))

# What the harness's workloads reach, beyond `import vllm` (most of vLLM is imported lazily).
MODULES = [
    "vllm",
    "vllm.entrypoints.llm",  # vllm.LLM
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.models.serving",
    "vllm.entrypoints.generate.api_router",
    "vllm.entrypoints.scale_out.factories",
    "vllm.entrypoints.serve.instrumentator.metrics",  # /metrics: imported when the app is built
    "vllm.entrypoints.chat_utils",
    "vllm.renderers.online_renderer",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.benchmark.serve",
    "vllm.benchmarks.serve",
    "vllm.benchmarks.datasets",
    "vllm.benchmarks.lib.endpoint_request_func",
    "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.kv_cache_utils",  # prefix caching's block hashes
    "vllm.v1.attention.backends.flash_attn",  # FA3: Hopper's default, bf16 and fp8 KV cache
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.sample.sampler",
    "vllm.compilation.backends",  # torch.compile + CUDA graphs
    "vllm.compilation.cuda_graph",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.kernels.linear",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.kv_cache",
    "vllm.model_executor.layers.quantization.auto_awq",
    "vllm.model_executor.layers.quantization.auto_gptq",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.v1.structured_output",
    "vllm.v1.structured_output.backend_xgrammar",
    # SamplingParams imports every backend's validator for any structured request, whichever backend
    # is set; lm-format-enforcer's module evaluates a class annotation that loads the package itself
    "vllm.v1.structured_output.backend_lm_format_enforcer",
    "vllm.v1.structured_output.backend_outlines",
    "vllm.v1.structured_output.backend_guidance",
    "xgrammar",
    "vllm.v1.spec_decode.ngram_proposer",
    "vllm.tokenizers",
    "vllm.transformers_utils.config",
]
CLI = [["serve", "--help"], ["bench", "serve", "--help"]]
_STUB_SYMBOLS = ("cuGetProcAddress_v2", "cuPointerGetAttribute", "cuTensorMapEncodeTiled")


def build_libcuda_stub(directory: Path, symbols=_STUB_SYMBOLS) -> Path:
    """A `libcuda.so.1` whose entry points all return CUDA_ERROR_NO_DEVICE (100): enough for
    vLLM's extensions to be dlopened (and register their ops) where no driver is installed."""
    src = directory / "libcuda_stub.c"
    src.write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in symbols))
    out = directory / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)], check=True)
    return out


def force_hopper_platform() -> None:
    """Resolve vLLM's current_platform to its CUDA platform reporting an H100 (9.0), so the CUDA
    branches import here as they do on the GPU machine. Only used where no GPU is visible."""
    import vllm.platforms as platforms
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    class ProbeHopper(cuda.NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 (probe)"

    platforms.current_platform = ProbeHopper()


def classify(exc: BaseException) -> str:
    """'missing' for an absent Python module, 'native' for a compiled library that did not load."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith("vllm."):
        return "missing"
    if isinstance(exc, ModuleNotFoundError):  # vllm.<ext>: a slimmed or absent extension
        return "native"
    text = str(exc)
    if isinstance(exc, (ImportError, OSError)) and (".so" in text or "cannot open shared object" in text
                                                    or "undefined symbol" in text):
        return "native"
    if "CUDA" in text or "cuda" in text or "NVML" in text or "driver" in text:
        return "native"
    return "error"


def probe_imports(modules: list[str]) -> dict[str, tuple[str, str]]:
    """module -> (status, detail); status in ok / missing / native / error."""
    results = {}
    for name in modules:
        try:
            importlib.import_module(name)
            results[name] = ("ok", "")
        except BaseException as e:  # noqa: BLE001 -- every failure is reported, none stops the probe
            detail = f"{type(e).__name__}: {e}".splitlines()[0][:240]
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if "importlib" not in f.filename and not f.filename.startswith("<")]
            if frames:  # where the import that failed sits: the module that needs it
                detail += f" (at {frames[-1].filename}:{frames[-1].lineno})"
            if classify(e) == "error":
                detail += "\n" + "".join(traceback.format_exception(e)[-4:])
            results[name] = (classify(e), detail)
    return results


def probe_cli(env: dict) -> dict[str, tuple[str, str]]:
    """Each CLI's --help in a process of its own (through this file, which fakes the Hopper first
    where there is no GPU: `vllm serve --help` builds the engine's defaults for the device)."""
    results = {}
    for args in CLI:
        cmd = [sys.executable, __file__, "--cli", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        status = "ok" if p.returncode == 0 and "usage" in (p.stdout + p.stderr).lower() else "error"
        if status != "ok" and "No module named" in p.stderr:
            status = "missing"
        results["vllm " + " ".join(args)] = (status, " | ".join(tail)[:300])
    return results


def check_serve_flags(model_dir: str) -> dict:
    """The harness's `vllm serve` command line (benchmarks/peers/engines.py) through vLLM's own parser
    and start-up checks: every flag exists and every value is accepted."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from benchmarks.peers.engines import Flags, serve_cmd

    cmd = serve_cmd("vllm", model_dir, 8000, Flags(kv_cache_dtype="fp8", api_server_count=2))
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[4:])  # after `... cli.main serve`
    args.model = args.model_tag
    validate_parsed_serve_args(args)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    from vllm.entrypoints.openai.api_server import build_app

    build_app(args, supported_tasks=("generate",))  # every router the server attaches, and their imports
    return dict(model=engine_args.model, max_model_len=engine_args.max_model_len, block_size=engine_args.block_size,
                kv_cache_dtype=engine_args.kv_cache_dtype, max_num_seqs=engine_args.max_num_seqs,
                prefix_caching=engine_args.enable_prefix_caching,
                structured_backend=engine_args.structured_outputs_config.backend, api_servers=args.api_server_count)


def check_checkpoint(model_dir: str) -> dict:
    """What vLLM makes of a checkpoint directory of benchmarks/shared/checkpoint.py: its model config (the
    architecture, vocabulary, context, dtype), generation config and tokenizer (a round trip)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers import get_tokenizer

    config = EngineArgs(model=model_dir, max_model_len=4096, dtype="bfloat16").create_model_config()
    tokenizer = get_tokenizer(model_dir)
    text = "def f(x):\n    return x + 1"
    ids = tokenizer.encode(text)
    return dict(architectures=config.hf_config.architectures, vocab=config.get_vocab_size(), dtype=str(config.dtype),
                max_model_len=config.max_model_len, layers=config.hf_config.num_hidden_layers,
                generation_config=config.try_get_generation_config(), tokenizer=type(tokenizer).__name__,
                tokenizer_len=len(tokenizer), round_trip=tokenizer.decode(ids, skip_special_tokens=True) == text)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--cli"]:  # one CLI's --help (probe_cli)
        import torch

        if not torch.cuda.is_available():
            force_hopper_platform()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *argv[1:]]
        return vllm_main() or 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-stub", action="store_true",
                    help="build a stand-in libcuda.so.1 (needs gcc) and re-run under it: a CPU box's probe")
    ap.add_argument("--modules", nargs="*", default=None, help="probe these instead of the harness's list")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLIs' --help")
    ap.add_argument("--checkpoint", nargs="*", default=[], metavar="DIR",
                    help="also check what vLLM makes of these checkpoint directories, and the harness's serve flags")
    args = ap.parse_args(argv)
    if args.cpu_stub and not os.environ.get("PEERS_PROBE_STUB"):
        import shutil

        stub_dir = Path(tempfile.mkdtemp(prefix="libcuda-stub-"))
        try:
            build_libcuda_stub(stub_dir)
            env = dict(os.environ, PEERS_PROBE_STUB="1", LD_LIBRARY_PATH=os.pathsep.join(
                p for p in (str(stub_dir), os.environ.get("LD_LIBRARY_PATH")) if p))
            return subprocess.call([sys.executable, __file__, *[a for a in argv if a != "--cpu-stub"]], env=env)
        finally:
            shutil.rmtree(stub_dir, ignore_errors=True)

    import torch

    if not torch.cuda.is_available():
        force_hopper_platform()
    results = probe_imports(args.modules or MODULES)
    if not args.no_cli:
        results.update(probe_cli(dict(os.environ)))
    import vllm

    print(f"vllm {vllm.__version__} from {Path(vllm.__file__).parent}, torch {torch.__version__}")
    for name, (status, detail) in results.items():
        print(f"{status.upper():8s} {name}" + (f"  -- {detail}" if detail else ""))
    counts = {s: sum(1 for st, _ in results.values() if st == s) for s in ("ok", "missing", "native", "error")}
    for d in args.checkpoint:
        for label, check in (("serve flags", check_serve_flags), ("checkpoint", check_checkpoint)):
            try:
                print(f"OK       {label} {d}: {check(d)}")
            except Exception as e:  # noqa: BLE001 -- reported and counted
                counts["error"] += 1
                print(f"ERROR    {label} {d}: {type(e).__name__}: {e}")
    print("probe:", ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if counts["missing"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
