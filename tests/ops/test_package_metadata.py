"""The package metadata: pyproject's license is an SPDX string, with the setuptools that reads it."""

import tomllib
from pathlib import Path


def test_pyproject_license_is_an_spdx_string():
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in meta["build-system"]["requires"]  # SPDX strings need setuptools 77
