"""kernels/prefill_config.py check_config: a caller's own PrefillConfig (flash_prefill's _config) is
refused, naming the field, where it cannot run; the tables' own picks always pass it."""

import pytest
import torch

from kernels.prefill_config import PrefillConfig, _pick_config, check_config

GOOD = PrefillConfig(128, 64, 8, 3, pack=4)


@pytest.mark.parametrize("change,group,tma_ok,says", [
    (dict(pack=3), 4, True, "pack must divide"), (dict(pack=8), 4, True, "pack must divide"),
    (dict(tma=True), 4, False, "descriptors"), (dict(diag=2), 4, True, "diag"),
    (dict(order="rows"), 4, True, "order must be one of"), (dict(prefix_n=48), 4, True, "prefix_n"),
    (dict(prefix_n=8), 4, True, "prefix_n"), (dict(prefix_ids="ldg"), 4, True, "prefix_ids")])
def test_a_config_that_cannot_run_is_refused_by_its_field(change, group, tma_ok, says):
    check_config(GOOD, 4, True)
    with pytest.raises(ValueError, match=says):
        check_config(GOOD._replace(**change), group, tma_ok)


@pytest.mark.parametrize("head_dim,group,prefix,fp8", [(64, 1, False, False), (128, 4, True, False),
                                                         (128, 8, True, True), (64, 2, False, False)])
def test_the_tables_picks_pass(monkeypatch, head_dim, group, prefix, fp8):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for max_seqlen in (16, 2048, 20000):
        cfg = _pick_config(head_dim, max_seqlen, torch.device("cuda"), group, True, prefix, fp8=fp8)
        check_config(cfg, group, True)


def test_a_gathered_prefix_takes_the_long_prompts_tile(monkeypatch):
    """A gathered prefix (flash_prefill's prefix_starts) streams in 128x128 tiles, 3 stages, query
    tiles fastest, whatever the chunk's length; fp8 copies and tiles other than 128 rows of head 128
    keep the table's pick."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda")
    for max_seqlen in (600, 2048, 8192, 20000):
        cfg = _pick_config(128, max_seqlen, cuda, 4, True, False, gathered=True)
        assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.pack, cfg.tma) == (128, 128, 3, 4, True)
        assert cfg.order == "tiles_fastest" and cfg.maxnreg is None
        check_config(cfg, 4, True)
    for args, kw in (((128, 2048, cuda, 4, True, False), dict(fp8=True)), ((64, 2048, cuda, 2, True, False), {}),
                     ((128, 512, cuda, 1, True, False), {}), ((128, 2048, cuda, 4, False, False), {})):
        assert _pick_config(*args, **kw, gathered=True) == _pick_config(*args, **kw)
