"""pyproject.toml installs every package of the source tree: a package left out of ``[tool.setuptools] packages``
works in an editable install and is missing from a built wheel (``ppsim.job`` was, until a wheel carried to a GPU
failed ``calibrate --torchtitan-config`` with ModuleNotFoundError)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_with_an_init_is_a_listed_package() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            if "__pycache__" in rel:
                continue
            found.add(".".join((name, *rel)))
    assert found == set(setuptools["packages"]), (sorted(found - set(setuptools["packages"])),
                                                  sorted(set(setuptools["packages"]) - found))
