"""Supported Keras versions: a clear error for an unsupported Keras, and for
an optimizer the installed Keras lacks."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest
from helpers import parent_class

import accum_optimizers
from accum_optimizers import _keras_private
from accum_optimizers._keras_private import versions

ROOT = Path(__file__).resolve().parent.parent


def _python(code, env=None, path=()):
    """Runs `code` in a fresh interpreter from the checkout; returns it."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# Prints the ImportError that importing the package raises, or "imported".
IMPORT = """
try:
    import accum_optimizers
except ImportError as error:
    print(error)
else:
    print("imported")
"""


def _fake_keras(tmp_path, version):
    """A stand-in `keras` package that reports `version`."""
    package = tmp_path / "keras"
    package.mkdir()
    (package / "__init__.py").write_text(
        f"__version__ = {version!r}\n\ndef version():\n    return __version__\n"
    )
    return tmp_path


@pytest.mark.parametrize("version", ["3.9.2", "2.15.0", "4.0.0"])
def test_importing_under_an_unsupported_keras_names_it_and_the_range(
    tmp_path, version
):
    result = _python(IMPORT, path=[_fake_keras(tmp_path, version)])
    assert result.returncode == 0, result.stderr
    assert f"the installed Keras is {version}" in result.stdout
    assert "Keras >= 3.10, < 4" in result.stdout


def test_importing_with_tf_keras_routed_to_keras_2_is_refused():
    result = _python(IMPORT, env={"TF_USE_LEGACY_KERAS": "1"})
    assert result.returncode == 0, result.stderr
    assert "TF_USE_LEGACY_KERAS=1" in result.stdout
    assert f"The installed Keras 3 is {keras.version()}" in result.stdout
    assert "Keras >= 3.10, < 4" in result.stdout


@pytest.mark.parametrize(
    "version, release",
    [
        ("3.10.0", (3, 10, 0)),
        ("3.16.0.dev2026102704", (3, 16, 0)),
        ("3.13.2rc1", (3, 13, 2)),
        ("2.15.0", (2, 15, 0)),
    ],
)
def test_release_reads_the_numbers_of_a_version(version, release):
    assert versions._release(version) == release


def test_pyproject_accepts_every_supported_keras():
    pyproject = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = (.*)$", pyproject, re.M)
    assert '"keras>=3.10,<4"' in dependencies.group(1)
    assert versions.MINIMUM_KERAS == (3, 10)


def test_an_optimizer_keras_lacks_is_missing_and_names_the_keras_adding_it():
    # Keras 3.10-3.13 lack ScheduleFreeAdamW: remove it from any Keras.
    result = _python(
        """
        import keras
        if hasattr(keras.optimizers, "ScheduleFreeAdamW"):
            del keras.optimizers.ScheduleFreeAdamW
        import accum_optimizers
        name = "ScheduleFreeAdamWAccumulate"
        print(name in accum_optimizers.__all__)
        print(hasattr(accum_optimizers, name))
        try:
            getattr(accum_optimizers, name)
        except AttributeError as error:
            print("AttributeError:", error)
        try:
            exec(f"from accum_optimizers import {name}", {})
        except ImportError as error:
            print("ImportError:", error)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["False", "False"]
    for kind, line in zip(["AttributeError", "ImportError"], lines[2:]):
        assert line.startswith(f"{kind}: `ScheduleFreeAdamWAccumulate`")
        assert "Keras added in 3.14.0" in line
        assert f"the installed Keras is {keras.version()}" in line


def test_every_optimizer_the_installed_keras_ships_is_exported():
    shipped = _keras_private.keras_optimizer_classes()
    for name, parent in shipped.items():
        cls = getattr(accum_optimizers, f"{name}Accumulate")
        assert parent_class(cls) is parent
        assert f"{name}Accumulate" in accum_optimizers.__all__
    has_schedule_free = hasattr(keras.optimizers, "ScheduleFreeAdamW")
    assert ("ScheduleFreeAdamWAccumulate" in accum_optimizers.__all__) is (
        has_schedule_free
    )
