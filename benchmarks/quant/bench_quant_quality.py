"""Quality of each quantized format: perplexity of the embedded model's held-out documents (Python
standard-library docstrings, comments and help topics the model never trained on), 16-bit against
the same model quantized each way (benchmarks/quant/quant_checkpoint.py, and --quantization fp8 at load),
scored through the engine's prompt_logprobs.

The held-out split is tools/embedded/prepare_data.py's (documents shuffled with seed 1234, the
first 5% held out) of the corpus tools/embedded/build_corpus.py extracts from this interpreter's
standard library (the model was trained on Python 3.11.7's). Documents are cut to the model's
1024-token context. On the CPU the weights are dequantized at load, so the figure is the weights'
quantization alone; on a GPU (--device cuda) the FP8 formats also quantize activations (w8a8).
Goals (issue 47): FP8 within 1% of 16-bit, 4-bit within 5%.

    python -m benchmarks.quant.bench_quant_quality [--device cpu] [--max-docs N] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from benchmarks.shared.common import gpu_slug  # noqa: E402
from benchmarks.quant.quant_checkpoint import FORMATS, quantize_checkpoint  # noqa: E402

GOALS = {"fp8": 1.01, "int4": 1.05}  # perplexity ratio to 16-bit
WEIGHTS = {"fp8-dynamic": "fp8", "fp8-static": "fp8", "fp8-block": "fp8", "online-fp8": "fp8"}


def held_out_documents(max_docs: int | None) -> list[str]:
    spec = importlib.util.spec_from_file_location("build_corpus", REPO / "tools" / "embedded" / "build_corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    root = Path(__import__("sysconfig").get_paths()["stdlib"])
    docs = corpus.build(root, with_comments=True, min_words=3, min_comment_words=6)
    docs = docs[0] if isinstance(docs, tuple) else docs
    order = list(range(len(docs)))
    random.Random(1234).shuffle(order)  # prepare_data.py's split
    val = [docs[i] for i in order[:max(1, round(len(docs) * 0.05))]]
    return val[:max_docs] if max_docs else val


def perplexity(path: Path, device: str, prompts: list[list[int]], quantization: str | None) -> dict:
    from server.config import EngineConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), device=device, quantization=quantization,
                                    enable_prefix_caching=False))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    total = sum(lp for out in outs for (_, lp), *_ in out.prompt_logprobs)
    count = sum(len(out.prompt_logprobs) for out in outs)
    return dict(ppl=math.exp(-total / count), tokens=count, seconds=round(time.perf_counter() - t0, 2),
                quantization=engine.quantization, weight_bytes=engine.weight_bytes)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-docs", type=int, default=None, help="score only the first N held-out documents")
    ap.add_argument("--formats", nargs="+", default=[*FORMATS, "online-fp8"])
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import torch
    import transformers
    import triton

    from models import EMBEDDED_MODEL, load_tokenizer

    tok = load_tokenizer(EMBEDDED_MODEL)
    docs = held_out_documents(args.max_docs)
    prompts = [ids[:1024] for ids in (tok(d)["input_ids"] for d in docs) if len(ids) >= 2]
    rows = [dict(impl="16-bit", format="16-bit", **perplexity(EMBEDDED_MODEL, args.device, prompts, None))]
    base = rows[0]["ppl"]
    print(f"16-bit: perplexity {base:.4f} over {rows[0]['tokens']} tokens of {len(prompts)} documents", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            if fmt == "online-fp8":
                row = perplexity(EMBEDDED_MODEL, args.device, prompts, "fp8")
            else:
                quantize_checkpoint(EMBEDDED_MODEL, Path(tmp) / fmt, fmt)
                row = perplexity(Path(tmp) / fmt, args.device, prompts, None)
            ratio = row["ppl"] / base
            goal = GOALS[WEIGHTS.get(fmt, "int4")]
            rows.append(dict(impl=fmt, format=fmt, **row, ratio=round(ratio, 5), goal=goal, meets_goal=ratio <= goal))
            print(f"{fmt:>14}: perplexity {row['ppl']:.4f} = {ratio:.4f}x 16-bit (goal <= {goal})", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = dict(benchmark="quant_quality", device=device_name, torch=torch.__version__.split("+")[0],
                  triton=triton.__version__, transformers=transformers.__version__,
                  date=datetime.date.today().isoformat(),
                  command="python -m benchmarks.quant.bench_quant_quality "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
                  model="embedded (GPT-2, 7.1M parameters)", documents=len(prompts),
                  split="tools/embedded: 5% of documents held out, seed 1234", rows=rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = "cpu" if device_name == "cpu" else gpu_slug(device_name)
    (out / f"quant_quality_{slug}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
