"""vLLM beside flashpage: the same checkpoint directory, GPU, device call, flags, prompts and clients.

Here (network, no GPU):
  bash benchmarks/peers/fetch/fetch_vllm.sh                 # -> ./.vllm: parts, SHA256SUMS, MANIFEST.tsv
  PYTHONPATH=<site> python benchmarks/peers/vllm_probe.py --cpu-stub   # the import chain, before any GPU time

There (an H100, Python 3.12, torch 2.11.0+cu130, no network), from the repo root, the parts carried
one a call (`carry` names each part file; a warm machine keeps them between back-to-back calls):
  python3 -m benchmarks.peers.run --workloads offline --checkpoints-only     # with the first part: checkpoints
      (a quantized shape's copy, `llama-3.1-8b.awq`, needs the server's wheels: in that call first
      `bash benchmarks/gpu_session.sh none && export PYTHONPATH=/tmp/site:$PWD`, carrying .whl, or make
      it in the run's call, after unpack_vllm.sh)
  bash benchmarks/peers/fetch/unpack_vllm.sh --probe        # /tmp/vllm-site and /tmp/site; vLLM's version; imports
  export VLLM_SITE=/tmp/vllm-site PYTHONPATH=/tmp/site:$PWD
  timeout -s TERM 540 python3 -m benchmarks.peers.run --workloads offline:qwen2.5-0.5b structured --out-dir $OUT
  timeout -s TERM 540 python3 -m benchmarks.peers.run --workloads http prefix --out-dir $OUT
  ... (run.py --estimate prints the minutes a selection takes; keep each call under ten, and `timeout -s
  TERM` lets run.py stop its servers before the device's own limit ends the call)
Then commit the peers_*.json files that came back to benchmarks/results/ and run
`python -m benchmarks.make_report`.

Modules: fetch_vllm.sh, fatbin.py and fetch_manifest.py make the parts; unpack_vllm.sh and
vllm_probe.py bring vLLM up; engines.py (one `Flags` to both engines' commands), workloads.py,
offline.py (one engine's offline tasks in its own process), serving.py and vllm_bench.py (a server
under both clients), run.py (the command) and report.py (docs/benchmarks.md's tables). docs/architecture.md
has a row for each.
"""
