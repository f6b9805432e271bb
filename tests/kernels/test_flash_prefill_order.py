"""flash_prefill's scheduling options (PrefillConfig.order, prefix_n, prefix_split, prefix_ids; issue
45's long prompt): each against prefill_attention_ref, and the ones that must not change a bit (the program
order, the prefix's unmasked whole tiles) bitwise against the default launch on the same inputs.
Under TRITON_INTERPRET=1 (conftest); the helpers and NaN-poisoned caches are test_flash_prefill's."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_flash_prefill import _padded_tile_map_case, _run_case, loops  # noqa: F401 (a fixture)

from tests.helpers import FP8_DTYPES

# Variants that must give the default launch's bits: the order of programs changes nothing inside
# one, the unmasked whole prefix tiles keep every key the masked ones keep, and the page ids read
# another way are the same ids (under the interpreter "asm" runs its clamped addressing through
# tl.load; on a GPU, the inline load itself).
ORDER, SPLIT, IDS = {"order": "tiles_fastest"}, {"prefix_split": True}, {"prefix_ids": "asm"}
SAME_BITS = {"new": [ORDER], "prefix": [ORDER, SPLIT, IDS], "mha": [{**ORDER, **SPLIT, **IDS}],
             "fp8": [{**SPLIT, **IDS}]}
# Prefixes: none, shorter than a prefix tile (32 keys here), exactly one and two tiles (no partial
# tile: the split's masked loop runs no trip), one tile and a partial one mid cache block, many.
PREFIX = [0, 17, 32, 64, 45, 300]
LENS = [1, 40, 9, 64, 75, 2]


def _outputs(seed: int, configs, *args, **kw) -> list[torch.Tensor]:
    """Each config's output on the same random inputs (each run also checked against the reference)."""
    return [_run_case(torch.Generator().manual_seed(seed), *args, config=c, **kw)[0] for c in configs]


@pytest.mark.parametrize("case", list(SAME_BITS))
def test_orders_and_prefix_split_give_the_same_bits(case):
    """Packed GQA tiles (group 4) with and without a paged prefix, MHA with one, an fp8 prefix (the
    split's unmasked tiles through the fp8 path)."""
    heads, kv_heads = (2, 2) if case == "mha" else (8, 2)
    kw = dict(prefix_lens=None if case == "new" else PREFIX, fp8=FP8_DTYPES[0] if case == "fp8" else None)
    outs = _outputs(45, [None, *SAME_BITS[case]], LENS, heads, kv_heads, 64, torch.bfloat16, **kw)
    for cfg, out in zip(SAME_BITS[case], outs[1:]):
        assert torch.equal(out, outs[0]), cfg


@pytest.mark.parametrize("prefix_n", [16, 64, 128])
def test_prefix_tile_widths(prefix_n):
    """Prefix tiles narrower and wider than BLOCK_N (32 under the interpreter, in 16-token blocks);
    at one width the split, the order and the id load change no bit."""
    configs = [{"prefix_n": prefix_n}, {"prefix_n": prefix_n, **ORDER, **SPLIT, **IDS}]
    a, b = _outputs(7, configs, LENS, 8, 2, 64, torch.float16, prefix_lens=PREFIX)
    assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("max_seqlen", [16, 2048, 8192, 20000])
def test_the_gpu_table_reads_a_16_bit_prefix_with_the_measured_loop(monkeypatch, head_dim, group, max_seqlen):
    """The GPU table's 128-row tiles over a 16-bit paged prefix take 128-key prefix tiles, the
    inline id load and the unmasked loop over whole tiles (measured faster on an H100:
    prefill_config._PREFIX_LOOP); no prefix, an fp8 prefix and other tiles keep tl.load's ids at
    the tile's width, in one masked loop."""
    from kernels.prefill_config import _pick_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda")
    for prefix, fp8 in ((False, False), (True, False), (True, True)):
        cfg = _pick_config(head_dim, max_seqlen, cuda, group, True, prefix, fp8=fp8)
        measured = prefix and not fp8 and cfg.block_m == 128
        assert (cfg.prefix_n, cfg.prefix_ids, cfg.prefix_split) == (
            (128, "asm", True) if measured else (None, "load", False)), (prefix, fp8, cfg)
    assert _pick_config(128, max_seqlen, cuda, 4, True, True).prefix_ids == "asm"  # the 8B shape's chunks


def test_orders_with_a_tile_map(loops):
    """The CUDA-graph form (tile map with idle tiles, NaN padding rows and sequences), both loop forms."""
    outs = [_padded_tile_map_case(torch.Generator().manual_seed(3), torch.bfloat16, 8, 2, c)
            for c in (None, {**ORDER, **SPLIT, **IDS})]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0, equal_nan=True)  # padding rows stay NaN


@pytest.mark.parametrize("bad", [{"order": "rows"}, {"prefix_n": 24}, {"prefix_n": 8}, {"prefix_ids": "tma"}])
def test_options_are_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _run_case(torch.Generator().manual_seed(0), [5], 2, 2, 64, torch.float16, prefix_lens=[3], config=bad)
