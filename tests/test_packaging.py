"""A wheel, installed without the source tree, carries its TOML files and starts."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvchat.native import kernels

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.packaging, pytest.mark.slow]
HANG = 1800  # seconds after which a step is taken to hang, far past a slow machine's time


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=HANG, env={**os.environ, **env}
    )


def test_the_wheel_carries_its_data_files_and_runs_without_the_source(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT / "kvchat", source / "kvchat", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."],
        source,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (source / "dist").glob("kvchat-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {"kvchat/configs/default.toml", "kvchat/configs/models.toml"}
    data |= {f"kvchat/native/{name}" for name in kernels.SOURCES}
    assert data <= names

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what pip install puts in site-packages
    code = (
        "import sys, importlib.resources as r, kvchat.config as c, kvchat.models.sources as s\n"
        "assert c.__file__.startswith(sys.argv[1]), c.__file__\n"
        "assert r.files('kvchat.native').joinpath('quantized_linear.cpp').is_file()\n"
        "print(c.load_settings().model.model, s.load_aliases()['smollm2-135m'].hub_id)\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run([sys.executable, "-c", code, str(site)], elsewhere, PYTHONPATH=str(site), KVCHAT_CONFIG="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    helped = run([sys.executable, "-m", "kvchat", "run", "--help"], elsewhere, PYTHONPATH=str(site))
    assert helped.returncode == 0 and "--kv-memory" in helped.stdout
