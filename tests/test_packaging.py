"""The wheel holds the library, its configs and recipes, and nothing else: built from a copy of the
whole checkout (the benchmarks, tests and docs are there to be left out), every file in it is under
lightning_pipe/ or its dist-info, every module of the library is in it, and its metadata says the
license and the dependencies the code imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
# what a build leaves behind or a run writes: a stale build/lib would leak into the wheel
LEFT_BEHIND = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "outputs", "multirun", "lightning_logs"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "checkout"
    shutil.copytree(ROOT, source, symlinks=True, ignore=LEFT_BEHIND)  # conf/recipe stays a link to ../recipes
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(source)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = (tmp / "dist").glob("lightning_pipe-*.whl")
    return zipfile.ZipFile(path)


def dist_info(wheel: zipfile.ZipFile) -> str:
    (name,) = {n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")}
    return name


def test_every_file_of_the_wheel_is_the_library_or_its_metadata(wheel):
    names = wheel.namelist()
    outside = [n for n in names if not n.startswith(("lightning_pipe/", dist_info(wheel) + "/"))]
    assert not outside, f"files outside lightning_pipe/ in the wheel: {outside[:20]}"
    tops = {n.split("/")[1] for n in names if n.startswith("lightning_pipe/") and n.count("/") > 1}
    assert not tops & {"bench", "benchmarks", "tests"}, sorted(tops)
    assert not [n for n in names if "/tests/" in n or n.split("/")[-1].startswith("test_")]


def test_the_wheel_has_every_library_module_the_configs_recipes_and_networks(wheel):
    names = set(wheel.namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_pipe").rglob("*.py") if "__pycache__" not in p.parts}
    assert not modules - names, f"library modules missing from the wheel: {sorted(modules - names)}"
    configs = {"lightning_pipe/conf/" + p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    recipes = {f"lightning_pipe/conf/recipe/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}
    assert "lightning_pipe/conf/config.yaml" in configs and recipes
    assert not (configs | recipes) - names, sorted((configs | recipes) - names)
    weights = {
        "lightning_pipe/adaptive/" + p.relative_to(ROOT / "lightning_pipe" / "adaptive").as_posix()
        for p in (ROOT / "lightning_pipe" / "adaptive" / "weights").iterdir()
    }
    assert weights and not weights - names, sorted(weights - names)


def test_the_metadata_names_the_license_and_what_the_code_imports(wheel):
    meta = Parser().parsestr(wheel.read(f"{dist_info(wheel)}/METADATA").decode())
    assert meta["License-Expression"] == "Apache-2.0"
    license_text = wheel.read(f"{dist_info(wheel)}/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    requires = meta.get_all("Requires-Dist")
    plain = {r.split(";")[0].strip() for r in requires if ";" not in r}
    names = {r.replace("_", "-").split("<")[0].split(">")[0].split("=")[0].lower() for r in plain}
    assert {"torch", "lightning", "torchmetrics", "typing-extensions"} <= names, sorted(names)
    assert "matplotlib" not in names, "matplotlib is an extra (plots): the strategy trains without it"
    assert any(r.startswith("matplotlib") and 'extra == "plots"' in r for r in requires), requires
    assert any("torchmetrics" in r and "<3" in r for r in plain), plain
