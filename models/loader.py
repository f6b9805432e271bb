"""Load checkpoints in Hugging Face format (any family in models/registry.py): a local directory or a hub id.

A directory holds `config.json`, weights as `model.safetensors` (optionally sharded with an index)
or `pytorch_model.bin`, and tokenizer files. A hub id is fetched into huggingface_hub's cache when
the network allows. With no model named, the checkpoint embedded in this package is used.

Safetensors are read one tensor at a time as the model takes them, so that loading holds one tensor
(not the checkpoint) in host memory beside the model; under tensor parallelism every rank reads
each tensor and keeps its part (models/parallel; a quantized tensor in its canonical layout, after
`convert`: models/quant/shards.py). `load_format="dummy"` (vLLM's name) reads no
weight files: random tensors at the checkpoint's names and shapes (from config.json alone), made on
the device, go through the same `load_weights` (`dummy_tensors`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from models import quant
from models.base import CausalLM
from models.kv_scales import is_attention_scale
from models.linear import storage_later
from models.parallel.group import TensorParallel, built_as
from models.registry import check_served, model_class

EMBEDDED_MODEL = Path(__file__).parent / "embedded"
EMBEDDED_DRAFT = Path(__file__).parent / "embedded-draft"  # its speculative decoding draft (tools/embedded/)
EMBEDDED_EAGLE3 = Path(__file__).parent / "embedded-eagle3"  # its EAGLE-3 head (tools/embedded/)
# what a pip-installed server names them by (package data: pyproject.toml); a directory of that name wins
EMBEDDED_NAMES = {"flashpage-embedded": EMBEDDED_MODEL, "flashpage-embedded-draft": EMBEDDED_DRAFT,
                  "flashpage-embedded-eagle3": EMBEDDED_EAGLE3}
_HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
              "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
              "generation_config.json"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return EMBEDDED_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model in EMBEDDED_NAMES:
        return EMBEDDED_NAMES[model]
    if path.exists() or model.startswith((".", "/")):
        raise FileNotFoundError(f"--model {model!r} is not a model directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=_HUB_FILES))
    except Exception as e:  # offline, unknown id, gated repo: say which
        raise FileNotFoundError(f"could not load {model!r} as a local directory or from the Hugging Face hub: {e}") from e


def load_config(path: Path) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(path)
    check_served(config.model_type)  # raises, naming the families served, for any other model
    return config


LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint's weight files; dummy: random weights, no files


class LazyTensors(Mapping):
    """A checkpoint's tensors by name, each read when it is asked for (`read(name)` reads tensor
    `name`); iterating yields the names in `names`' order. Mapping's own `get` (None for a missing
    name) stays: the quantization formats probe optional tensors with it."""

    def __init__(self, names: list[str], read) -> None:
        self.names, self._read, self._known = names, read, set(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@contextmanager
def _read_tensors(path: Path) -> Iterator[Mapping[str, torch.Tensor]]:
    """The checkpoint's tensors (safetensors read lazily, while the context lasts)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    elif (path / "pytorch_model.bin").exists():
        yield torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or pytorch_model.bin")
    with ExitStack() as stack:
        handles = {}
        for name in files:
            f = stack.enter_context(safe_open(path / name, framework="pt"))
            handles.update(dict.fromkeys(f.keys(), f))
        yield LazyTensors(list(handles), lambda k: handles[k].get_tensor(k))


# What nn.Linear, nn.Embedding and nn.LayerNorm call to initialise their parameters.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's functions as no-ops while a model is built: its parameters stay as
    allocated (uninitialised), and load_weights fills them."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_model(path: Path, dtype: torch.dtype, device: torch.device | str, attention: str,
               deterministic: bool = False, quantization: str | None = None, load_format: str = "auto") -> CausalLM:
    """`deterministic`: batch-invariant GEMMs and attention (every family takes the flag).
    `quantization`: --quantization (models/quant: a quantized checkpoint's format is read from its
    config.json; "fp8" also quantizes a 16-bit checkpoint at load). `load_format`: one of
    LOAD_FORMATS. Under tensor parallelism (models/parallel) the model is this rank's shard."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    config = load_config(path)
    scheme = quant.detect(path, quantization)
    # Built on the device with its parameters left uninitialised, as on the meta device followed by
    # to_empty (which it replaces): random init of a meta tensor imports torch's Python meta kernels
    # and to_empty its symbolic shapes, ~1.5 s of CPU in every engine process, for weights that
    # load_weights overwrites. Quantized linears get their storage from their method instead.
    later = storage_later() if scheme is not None and not scheme.online else nullcontext()
    with torch.device(device), _no_init(), later:
        model = model_class(config.model_type)(config, attention, deterministic=deterministic)
    model = model.to(dtype)
    if load_format == "dummy" and scheme is not None and not scheme.online:
        raise ValueError("--load-format dummy makes a 16-bit checkpoint's tensors, not a quantized one's "
                         f"({scheme.name}): leave quantization_config out of config.json")
    source = nullcontext(dummy_tensors(config, dtype, device)) if load_format == "dummy" else _read_tensors(path)
    with source as tensors:
        # KV-cache scales are not weights: the worker reads them (models/kv_scales.py) for an fp8 cache
        tensors = LazyTensors([k for k in tensors if not is_attention_scale(k)], tensors.__getitem__)
        if scheme is not None:
            quant.attach(model, scheme, device, dtype, deterministic)
            tensors = quant.convert(tensors, scheme, device)
        model.load_weights(tensors)
    if scheme is not None:
        quant.finish(model)
        quant.bound_norm_inputs(model)
    return model.eval().requires_grad_(False)


def check_quantized_split(path: Path, quantization: str | None, size: int) -> None:
    """Refuse, naming the layer, a quantized checkpoint whose 128x128 blocks or 128-column groups a
    rank's share of `size` would cut (models/quant/shards.py), before any rank starts: rank 0's
    shard built on the meta device (no memory, no weight read) with its quantized storage attached.
    Every rank's shares are as long as rank 0's and start at multiples of them, so rank 0's decide."""
    scheme = quant.detect(path, quantization)
    if scheme is None or scheme.online or size == 1:
        return
    config = load_config(path)
    with built_as(TensorParallel(0, size)), torch.device("meta"), _no_init(), storage_later():
        model = model_class(config.model_type)(config, "sdpa")
        quant.attach(model, scheme, torch.device("meta"), torch.float16, deterministic=False)


def is_eagle3_head(path: Path) -> bool:
    """Does `path` hold an EAGLE-3 head (its config.json names an Eagle3 architecture)?"""
    file = path / "config.json"
    if not file.exists():
        return False
    return any("eagle3" in str(a).lower() for a in json.loads(file.read_text()).get("architectures") or [])


def dummy_tensors(config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str) -> LazyTensors:
    """A random checkpoint of `config`'s model, each tensor made on `device` when it is read: the
    names and shapes of transformers' own model class (built on the meta device: no memory), values
    as a fresh model has them (matrices normal(0, initializer_range), biases zero, norm weights one),
    each drawn from a generator seeded by its name, so every rank (and every tensor-parallel size)
    makes the same checkpoint and cuts its own part of it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    std = getattr(config, "initializer_range", 0.02)

    def make(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) == 1:
            fill = torch.zeros if name.endswith("bias") else torch.ones
            return fill(shape, dtype=dtype, device=device)
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        return torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(std)

    return LazyTensors(list(shapes), make)


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype the checkpoint's config names (`dtype`, formerly `torch_dtype`), if it is one we serve
    (a quantized checkpoint's: that of its activations and unquantized tensors)."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(name) if isinstance(name, str) else None


def eos_token_ids(path: Path) -> list[int]:
    """Every end-of-sequence id the checkpoint declares: generation_config.json's `eos_token_id`
    (Llama 3 lists several), then config.json's; each an int or a list."""
    found: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = path / name
        ids = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and i not in found:
                found.append(i)
    return found


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)
