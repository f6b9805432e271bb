"""docker/Dockerfile and docker/entrypoint.sh, without a Docker engine: hadolint, what the image
runs (its ENTRYPOINT, CMD, HEALTHCHECK, user, volume, pinned versions), and the exact command line the
entrypoint execs for a given environment, parsed by the server's own argument parser."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from server.cli import build_parser

REPO = Path(__file__).resolve().parents[2]

DOCKERFILE = REPO / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
LOCK = REPO / "docker" / "requirements.lock"


def instructions(path=DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, args = current.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    return out


def one(keyword: str) -> str:
    found = [args for kw, args in instructions() if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REPO / "docker" / "router.Dockerfile"], ids=lambda p: p.name)
def test_hadolint_passes(tool, dockerfile):
    hadolint = tool("hadolint")
    r = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_base_image_is_pytorch_cuda_pinned_to_the_tested_torch():
    image = one("FROM")
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", image)
    assert m, f"base image not a version-pinned pytorch CUDA runtime image: {image}"
    # The image's torch is the torch CI tests: .ci/run installs torch==X.
    ci_torch = re.search(r"torch==(\d+\.\d+\.\d+)", (REPO / ".ci" / "run").read_text()).group(1)
    assert m.group(1) == ci_torch, f"base image has torch {m.group(1)}, CI tests torch {ci_torch}"


def test_entrypoint_cmd_healthcheck_user_and_volume():
    entrypoint = json.loads(one("ENTRYPOINT"))
    assert entrypoint == ["/usr/local/bin/flashpage-entrypoint"]
    assert one("CMD") == "[]"  # arguments of `docker run IMAGE ...` go to the server
    copies = [args.split() for kw, args in instructions() if kw == "COPY"]
    assert ["docker/entrypoint.sh", entrypoint[0]] in copies
    assert os.access(ENTRYPOINT, os.X_OK), "docker/entrypoint.sh must be executable (git keeps the mode)"

    health = one("HEALTHCHECK")
    assert "/health" in health and "FLASHPAGE_PORT" in health and "127.0.0.1" in health
    assert "--start-period=" in health and health.split("CMD", 1)[1].strip().startswith("[")

    user = one("USER")
    assert user.split(":")[0] not in ("0", "root"), "the server must not run as root"
    env = " ".join(args for kw, args in instructions() if kw == "ENV")
    assert re.search(r"\bHF_HOME=/data/hf\b", env) and re.search(r"\bFLASHPAGE_HOST=0\.0\.0\.0\b", env)
    assert json.loads(one("VOLUME")) == ["/data"]
    assert one("EXPOSE") == "8000"


def test_dependencies_come_from_the_lock_with_exact_versions():
    runs = [args for kw, args in instructions() if kw == "RUN"]
    assert any("pip install --no-deps -r docker/requirements.lock" in r for r in runs)
    assert any("pip install --no-deps ." in r for r in runs)
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9.+!-]*)", line)
            assert m, f"not an exact pin: {line!r}"
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    assert "torch" not in pins, "torch comes from the base image"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower().replace("_", "-") for d in deps}
    wanted = (names - {"torch"}) | {"triton", "prometheus-client", "numpy", "fastapi", "uvicorn", "pydantic",
                                    "transformers", "tokenizers", "safetensors", "huggingface-hub"}
    assert wanted <= set(pins), f"not in docker/requirements.lock: {sorted(wanted - set(pins))}"


def test_dockerignore_sends_only_what_the_image_needs():
    lines = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert lines[0] == "*"
    for needed in ("pyproject.toml", "README.md", "server", "kernels", "kvcache", "models",
                   "docker/requirements.lock", "docker/entrypoint.sh"):
        assert f"!{needed}" in lines, needed
    copied = [args.split()[0] for kw, args in instructions() if kw == "COPY"]
    for src in copied:
        assert f"!{src}" in lines, f"COPY {src} is excluded by .dockerignore"


# --- the entrypoint -----------------------------------------------------------------------------------

def run_entrypoint(tmp_path, environment, env: dict, args=()):
    """Runs docker/entrypoint.sh as docker would, with a fake `python` first on PATH that records
    the argv it was exec'd with and its pid. Returns (argv after `python`, pid, entrypoint pid)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python").write_text('#!/bin/sh\necho $$ > "$RECORD.pid"\nprintf "%s\\0" "$@" > "$RECORD"\n')
    (fake / "python").chmod(0o755)
    record = tmp_path / "argv"
    full = environment(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", RECORD=str(record), **env)
    proc = subprocess.Popen([str(ENTRYPOINT), *args], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    argv = record.read_text().split("\0")[:-1]
    return argv, int((tmp_path / "argv.pid").read_text()), proc.pid


def parse(argv):
    assert argv[:2] == ["-m", "server"], argv
    return build_parser().parse_args(argv[2:])


def test_entrypoint_maps_the_environment_onto_the_cli(tmp_path, environment):
    argv, pid, entry_pid = run_entrypoint(tmp_path, environment, {
        "FLASHPAGE_MODEL": "gpt2-medium",
        "FLASHPAGE_DTYPE": "bfloat16",
        "FLASHPAGE_ATTENTION": "triton",
        "FLASHPAGE_GPU_MEMORY_UTILIZATION": "0.8",
        "FLASHPAGE_PORT": "9001",
        "FLASHPAGE_MAX_NUM_SEQS": "64",
        "FLASHPAGE_SERVED_MODEL_NAME": "my model",      # a value with a space stays one argument
        "FLASHPAGE_ENFORCE_EAGER": "true",
        "FLASHPAGE_ENABLE_PREFIX_CACHING": "false",
        "FLASHPAGE_DEVICE": "",                          # empty: not passed, the default stands
        "FLASHPAGE_API_KEY": "s3cret",
        "FLASHPAGE_EXTRA_ARGS": "--max-model-len 512  --seed 7",
    })
    assert pid == entry_pid, "the entrypoint must exec the server (same pid), so it gets docker's signals"
    a = parse(argv)
    assert (a.model, a.dtype, a.attention, a.gpu_memory_utilization) == ("gpt2-medium", "bfloat16", "triton", 0.8)
    assert (a.host, a.port, a.max_num_seqs, a.served_model_name) == ("0.0.0.0", 9001, 64, "my model")
    assert a.enforce_eager is True and a.enable_prefix_caching is False and a.device is None
    assert (a.max_model_len, a.seed) == (512, 7)
    # The API key reaches the server through its environment (it reads FLASHPAGE_API_KEY), never argv.
    assert "s3cret" not in argv and "--api-key" not in argv


def test_entrypoint_defaults_and_arguments_win(tmp_path, environment):
    argv, _, _ = run_entrypoint(tmp_path, environment, {}, [])
    a = parse(argv)
    defaults = build_parser().parse_args([])
    assert (a.host, a.port) == ("0.0.0.0", 8000)  # reachable from outside the container
    assert a.model is defaults.model and a.dtype == defaults.dtype
    # `docker run IMAGE --port 9 --model x` : arguments come last, so they override the environment.
    argv, _, _ = run_entrypoint(tmp_path, environment, {"FLASHPAGE_PORT": "8001", "FLASHPAGE_MODEL": "gpt2"},
                                ["--port", "9", "--model", "x"])
    a = parse(argv)
    assert (a.port, a.model) == (9, "x")


def test_every_cli_flag_has_its_variable(tmp_path, environment):
    """FLASHPAGE_<FLAG> works for every flag the server has, including ones added after this test
    (FLASHPAGE_DETERMINISTIC as the server reads it itself: the next test)."""
    flags = [s for action in build_parser()._actions for s in action.option_strings
             if s.startswith("--") and s not in ("--help", "--host", "--port", "--api-key", "--deterministic")
             and not s.startswith("--no-")]
    env = {"FLASHPAGE_" + f[2:].upper().replace("-", "_"): f"v{i}" for i, f in enumerate(flags)}
    argv, _, _ = run_entrypoint(tmp_path, environment, env)
    for i, flag in enumerate(flags):
        at = argv.index(flag)
        assert argv[at + 1] == f"v{i}", flag


def test_entrypoint_dry_run_and_other_commands(tmp_path, environment):
    r = subprocess.run([str(ENTRYPOINT)], env=environment(FLASHPAGE_DRY_RUN="1", FLASHPAGE_MODEL="/models/my ft"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    assert words[0] == "python" and parse(words[1:]).model == "/models/my ft"
    # A first argument that is not a flag is a command (docker run IMAGE bash -c ...).
    r = subprocess.run([str(ENTRYPOINT), "sh", "-c", "echo hello"], env=environment(), capture_output=True,
                       text=True, timeout=30)
    assert r.stdout == "hello\n"


def test_tensor_parallel_size_all_counts_the_gpus_the_container_sees(tmp_path, environment):
    """FLASHPAGE_TENSOR_PARALLEL_SIZE=all (compose's --profile tp): the GPUs nvidia-smi lists; with
    none visible the container stops, saying why, instead of starting a one-GPU server."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)\"; done\n")
    (fake / "nvidia-smi").chmod(0o755)
    argv, _, _ = run_entrypoint(tmp_path, environment, {"FLASHPAGE_TENSOR_PARALLEL_SIZE": "all"})
    assert parse(argv).tensor_parallel_size == 4
    argv, _, _ = run_entrypoint(tmp_path, environment, {"FLASHPAGE_TENSOR_PARALLEL_SIZE": "2"})
    assert parse(argv).tensor_parallel_size == 2
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    r = subprocess.run([str(ENTRYPOINT)], env=environment(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
                                                           FLASHPAGE_TENSOR_PARALLEL_SIZE="all"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "no GPU visible" in r.stderr


def test_every_variable_the_code_reads_starts_the_container(tmp_path, environment, monkeypatch):
    """A FLASHPAGE_* name that the server's modules read themselves (FLASHPAGE_GEMV16=0: cuBLAS at
    one row; FLASHPAGE_DETERMINISTIC=1, which `--deterministic` takes no value for) stays in the
    environment instead of becoming a flag the parser refuses, which would stop the container."""
    names = set()
    for folder in ("server", "models", "kernels", "kvcache"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r'"FLASHPAGE_([A-Z0-9_]+)"', path.read_text()))
    assert {"GEMV16", "DETERMINISTIC", "API_KEY"} <= names
    for value in ("0", "1"):
        argv, _, _ = run_entrypoint(tmp_path, environment, {f"FLASHPAGE_{n}": value for n in names})
        monkeypatch.setenv("FLASHPAGE_DETERMINISTIC", value)  # as the container's server sees it
        assert build_parser().parse_args(argv[2:]).deterministic == (value == "1")  # nothing refused
        assert not {"--gemv16", "--deterministic"} & set(argv)


def test_a_misspelt_variable_fails_loudly(tmp_path, environment):
    """FLASHPAGE_MODLE becomes --modle, which the server's parser rejects instead of ignoring."""
    argv, _, _ = run_entrypoint(tmp_path, environment, {"FLASHPAGE_MODLE": "gpt2"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv[2:])
