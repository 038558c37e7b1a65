"""The package builds as pip builds it, on a machine with only the build dependencies: its
build compiles libbie with CMake and ships it inside the wheel, and the installed package
loads that copy (no BIE_LIBRARY, no ldconfig, no repository build tree)."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[1]
REPO = PYTHON_DIR.parent


def _have(module):
    return subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_pip_wheel_ships_libbie_and_the_installed_package_loads_it(tmp_path):
    for module in ("setuptools", "wheel"):
        if not _have(module):
            pytest.skip(f"{sys.executable} has no {module} (python3-setuptools, python3-wheel)")
    # The package folder copied, so the build writes nothing into the checkout; the C
    # sources come from the repository (BIE_SOURCE_DIR). Offline: the PEP 517 backend that
    # pip calls (setuptools.build_meta, with setup.py's hook), then the wheel unpacked as
    # pip installs it.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(PYTHON_DIR / name, source / name)
    shutil.copytree(PYTHON_DIR / "bie", source / "bie",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {k: v for k, v in os.environ.items() if k != "BIE_LIBRARY"}
    env.update(BIE_SOURCE_DIR=str(REPO), BIE_CMAKE_ARGS="-DBIE_CUDA=OFF")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build = subprocess.run(
        [sys.executable, "-c", "import sys, setuptools.build_meta as b; "
         "print(b.build_wheel(sys.argv[1]))", str(wheels)],
        cwd=source, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("bie-*.whl")
    assert "linux" in wheel.name  # a platform wheel: it holds a native library
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    assert (site / "bie" / "libbie.so").is_file()
    check = ("import bie, torch\n"
             "print(bie.library_path())\n"
             "m = bie.BinaryLinearCutlass(16, 4)\n"
             "m.prepare_params()\n"
             "assert m(torch.randn(3, 16)).shape == (3, 4)\n")
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert pathlib.Path(run.stdout.strip()).resolve() == (site / "bie" / "libbie.so").resolve()
