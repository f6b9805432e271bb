"""server/config.py spells the CLI's choices without importing torch: they must stay what the
models package serves."""

import subprocess
import sys

from models import BACKENDS, DTYPES, LOAD_FORMATS, QUANTIZATION_METHODS
from server.config import ATTENTION_BACKENDS, DTYPE_NAMES, engine_threads
from server.config import LOAD_FORMATS as CLI_LOAD_FORMATS
from server.config import QUANTIZATION_METHODS as QUANTIZATION_NAMES


def test_cli_choices_match_the_models_package():
    assert tuple(ATTENTION_BACKENDS) == tuple(BACKENDS)
    assert DTYPE_NAMES[0] == "auto" and all(name in DTYPES for name in DTYPE_NAMES[1:])
    assert tuple(CLI_LOAD_FORMATS) == tuple(LOAD_FORMATS)
    assert tuple(QUANTIZATION_NAMES) == tuple(QUANTIZATION_METHODS)


def test_help_does_not_import_torch():
    code = "import sys, server.cli as c; c.build_parser().format_help(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_server_step_budget_fits_the_largest_prefill_graph():
    """The server's default budget is there so that every prefill step replays a captured graph
    (short steps beside hundreds of decodes); were the graph ladder to shrink, steps past it would
    run eagerly again. Offline engines keep the larger EngineConfig budget."""
    from server.cli import build_parser
    from server.config import SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig
    from server.worker.cuda_graphs import PREFILL_GRAPH_MAX_TOKENS

    assert SERVE_MAX_NUM_BATCHED_TOKENS == PREFILL_GRAPH_MAX_TOKENS
    assert build_parser().parse_args([]).max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig().max_num_batched_tokens > SERVE_MAX_NUM_BATCHED_TOKENS


def test_the_engine_leaves_a_core_to_each_api_process():
    """A CPU engine's OpenMP team beside the API processes' event loops on the same cores stepped
    30x slower on a loaded 2-core host (server/config.py): it takes what they leave, at least one."""
    assert [engine_threads(1, cores) for cores in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert [engine_threads(api, 16) for api in (2, 4, 16)] == [14, 12, 1]
    assert engine_threads(1) >= 1  # this host's cores
