"""The embedded checkpoints travel with the package: a pip-installed server finds the embedded model,
its speculative decoding draft (models/embedded-draft/) and EAGLE-3 head (models/embedded-eagle3/) by
their names."""

from fnmatch import fnmatch
from pathlib import Path

from models import EMBEDDED_DRAFT, EMBEDDED_EAGLE3, EMBEDDED_MODEL, is_eagle3_head, load_config, resolve_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_the_embedded_model_draft_and_head_are_package_data_found_by_their_names():
    from setuptools.config.pyprojecttoml import read_configuration

    globs = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]["models"]
    for folder in (EMBEDDED_MODEL, EMBEDDED_DRAFT, EMBEDDED_EAGLE3):
        files = [str(f.relative_to(ROOT / "models")) for f in folder.iterdir()]
        assert "model.safetensors" in {Path(f).name for f in files}
        missing = [f for f in files if not any(fnmatch(f, g) for g in globs)]
        assert not missing, f"not in the package data: {missing}"
    assert resolve_model_path("flashpage-embedded") == EMBEDDED_MODEL
    assert resolve_model_path("flashpage-embedded-draft") == EMBEDDED_DRAFT
    assert load_config(EMBEDDED_DRAFT).model_type == load_config(EMBEDDED_MODEL).model_type
    assert resolve_model_path("flashpage-embedded-eagle3") == EMBEDDED_EAGLE3 and is_eagle3_head(EMBEDDED_EAGLE3)
