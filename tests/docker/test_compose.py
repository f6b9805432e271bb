"""compose.yaml: validated and resolved by Docker Compose itself (`config` needs no engine), and kept
consistent with docker/nginx.conf (every replica nginx balances over is a GPU-pinned service)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
NGINX_CONF = REPO / "docker" / "nginx.conf"


@pytest.fixture(scope="module")
def compose(tool, tmp_path_factory, environment):
    """Runs `docker compose ... config` (the plugin) or `docker-compose ... config` (Debian's
    package) on compose.yaml with the given variables and profiles; returns the resolved YAML."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        base = [docker, "compose"]
    else:
        base = [tool("docker-compose")]
    empty = tmp_path_factory.mktemp("compose") / "empty.env"  # a developer's .env must not leak in
    empty.write_text("")

    def run(profiles=(), **variables):
        env = environment(**variables)
        for name in ("MODEL", "PORT", "NGINX_PORT", "HF_TOKEN", "ROUTER_PORT", "ROUTER_POLICY", "ROUTER_METRICS_PORT",
                     "TENSOR_PARALLEL_SIZE", "SHM_SIZE"):
            if name not in variables:
                env.pop(name, None)
        cmd = [*base, "--env-file", str(empty), "--project-directory", str(REPO), "-f", str(COMPOSE)]
        for p in profiles:
            cmd += ["--profile", p]
        r = subprocess.run([*cmd, "config"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return yaml.safe_load(r.stdout)

    return run


def test_default_service_reserves_a_gpu_and_serves_gpt2(compose):
    cfg = compose()
    svc = cfg["services"]["flashpage"]
    env = svc["environment"]
    assert env["FLASHPAGE_MODEL"] == "gpt2"
    assert env.get("HF_TOKEN") in (None, "")  # passed through only when the host has it
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
    assert any(int(p["target"]) == 8000 and int(p["published"]) == 8000 for p in _ports(svc))
    assert svc["restart"] == "unless-stopped"
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    assert any(str(v).startswith("flashpage-cache:/data") or (isinstance(v, dict) and v.get("target") == "/data")
               for v in svc["volumes"])
    assert "flashpage-cache" in cfg["volumes"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"


@pytest.mark.parametrize("model", ["distilgpt2", "Qwen/Qwen2.5-0.5B-Instruct", "/models/my-finetune"])
def test_variables_choose_model_port_and_pass_the_token(compose, model):
    cfg = compose(MODEL=model, PORT="9000", HF_TOKEN="hf_test_token")
    svc = cfg["services"]["flashpage"]
    assert svc["environment"]["FLASHPAGE_MODEL"] == model
    assert svc["environment"]["HF_TOKEN"] == "hf_test_token"
    assert any(int(p["published"]) == 9000 for p in _ports(svc))


def test_scale_nginx_profile_pins_one_replica_per_gpu_behind_nginx(compose):
    cfg = compose(profiles=["scale-nginx"], NGINX_PORT="8088")
    services = cfg["services"]
    nginx = services["nginx"]
    assert re.fullmatch(r"nginx:\d+\.\d+\.\d+(-alpine)?", nginx["image"])
    assert any(int(p["target"]) == 80 and int(p["published"]) == 8088 for p in _ports(nginx))
    assert any("nginx.conf" in str(v) for v in nginx["volumes"])
    upstreams = re.findall(r"^\s*server\s+([\w.-]+):8000\b", NGINX_CONF.read_text(), re.M)
    assert len(upstreams) >= 2 and len(set(upstreams)) == len(upstreams)
    gpus = []
    for name in upstreams:
        svc = services[name]  # every upstream is a service of the file...
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus.append(tuple(device.get("device_ids") or range(int(device["count"]))))
        deps = nginx["depends_on"]  # ...that nginx waits for until it is healthy
        assert (deps[name]["condition"] if isinstance(deps, dict) else None) == "service_healthy", name
        assert svc["environment"]["FLASHPAGE_MODEL"] == "gpt2"
    # count: 1 is GPU 0 (Docker hands out the first GPUs); the others are pinned by device_ids.
    flat = [str(g) for ids in gpus for g in ids]
    assert len(flat) == len(set(flat)) == len(upstreams), f"replicas share a GPU: {gpus}"


def test_compose_file_and_nginx_conf_agree_without_compose():
    """The same consistency from the files alone (no compose tool needed)."""
    raw = yaml.safe_load(COMPOSE.read_text())
    upstreams = re.findall(r"^\s*server\s+([\w.-]+):8000\b", NGINX_CONF.read_text(), re.M)
    scale = {n for n, s in raw["services"].items() if "scale-nginx" in s.get("profiles", [])}
    default = {n for n, s in raw["services"].items() if not s.get("profiles")}
    assert default == {"flashpage"}
    assert set(upstreams) == {"flashpage"} | (scale - {"nginx"})
    assert set(raw["services"]["nginx"]["depends_on"]) == set(upstreams)


def test_scale_profile_puts_vllm_router_in_front_of_every_replica(compose):
    """`--profile scale`: the router (its own pinned image) with the cache-aware policy unless
    ROUTER_POLICY says otherwise, one worker URL per replica of the profile (the same replicas
    nginx balances over), health checks on /health, retries, and its metrics port published."""
    cfg = compose(profiles=["scale"], ROUTER_PORT="8090")
    services = cfg["services"]
    router = services["router"]  # (Debian's docker-compose 1.29 lists every profile's services)
    assert router["build"]["dockerfile"] == "docker/router.Dockerfile"
    cmd = router["command"]
    urls = cmd[cmd.index("--worker-urls") + 1: cmd.index("--policy")]
    replicas = {n for n, svc in services.items()  # (1.29 lists the tp profile's server too: not a replica)
                if n.startswith("flashpage") and (not svc.get("profiles") or "scale" in svc["profiles"])}
    assert {u.removeprefix("http://").removesuffix(":8000") for u in urls} == replicas == {"flashpage", "flashpage-gpu1"}
    assert set(router["depends_on"]) == replicas
    assert all(router["depends_on"][n]["condition"] == "service_healthy" for n in replicas)
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert cmd[cmd.index("--health-check-endpoint") + 1] == "/health" and "--retry-max-retries" in cmd
    published = {int(p["target"]): int(p["published"]) for p in _ports(router)}
    assert published == {8080: 8090, 29000: 29000}
    assert compose(profiles=["scale"], ROUTER_POLICY="round_robin")["services"]["router"]["command"][
        cmd.index("--policy") + 1] == "round_robin"
    upstreams = re.findall(r"^\s*server\s+([\w.-]+):8000\b", NGINX_CONF.read_text(), re.M)
    assert set(upstreams) == replicas, "nginx and the router must balance over the same replicas"


def test_tp_profile_serves_one_model_over_every_gpu_in_place_of_the_one_gpu_server(compose):
    """`--profile tp`: one server with every GPU of the host and --tensor-parallel-size all (the
    entrypoint counts them), shared memory for NCCL, the one-GPU server's port (it replaces that one:
    started by name), and a start period for a 70B checkpoint."""
    cfg = compose(profiles=["tp"], MODEL="meta-llama/Llama-3.3-70B-Instruct")
    svc, one_gpu = cfg["services"]["flashpage-tp"], cfg["services"]["flashpage"]
    assert svc["profiles"] == ["tp"]
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == "all"
    env = svc["environment"]
    assert env["FLASHPAGE_TENSOR_PARALLEL_SIZE"] == "all" and env["FLASHPAGE_MODEL"] == "meta-llama/Llama-3.3-70B-Instruct"
    assert set(one_gpu["environment"]) < set(env)  # every setting of the one-GPU server, and the size
    assert str(svc["shm_size"]).lower() in ("16gb", str(16 * 2**30))
    assert {int(p["published"]) for p in _ports(svc)} == {int(p["published"]) for p in _ports(one_gpu)} == {8000}
    assert svc["image"] == one_gpu["image"] and "/health" in " ".join(svc["healthcheck"]["test"])
    sized = compose(profiles=["tp"], TENSOR_PARALLEL_SIZE="2", SHM_SIZE="32gb")["services"]["flashpage-tp"]
    assert sized["environment"]["FLASHPAGE_TENSOR_PARALLEL_SIZE"] == "2"
    assert str(sized["shm_size"]).lower() in ("32gb", str(32 * 2**30))


def test_router_image_pins_the_router_the_tests_run():
    import tomllib

    pin = re.search(r"vllm-router==([\d.]+)", (REPO / "docker" / "router.Dockerfile").read_text()).group(1)
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert f"vllm-router=={pin}" in dev


def _ports(svc):
    out = []
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            out.append(p)
        else:  # "published:target"
            published, target = str(p).rsplit(":", 1)
            out.append({"published": published.rsplit(":", 1)[-1], "target": target})
    return out
