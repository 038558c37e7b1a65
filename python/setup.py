"""Build hook of the bie package: ``pip install ./python`` compiles libbie with CMake and ships
it inside the package (``bie/libbie.so``), so the installed package needs no ``ldconfig``,
``BIE_LIBRARY`` or separate ``cmake --install``.

The C sources are those of the repository this folder belongs to (``..``), or of the folder
named by ``BIE_SOURCE_DIR``. ``BIE_CMAKE_ARGS`` adds CMake arguments (e.g. ``-DBIE_CUDA=OFF``
to skip the CUDA backend where nvcc is installed, or ``-DCMAKE_CUDA_ARCHITECTURES=90``);
``BIE_BUILD_JOBS`` sets the parallel build jobs (default: all cores). The metadata is in
pyproject.toml.
"""

import os
import pathlib
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = pathlib.Path(__file__).resolve().parent


def _source_dir():
    root = pathlib.Path(os.environ.get("BIE_SOURCE_DIR") or HERE.parent).resolve()
    if not (root / "CMakeLists.txt").is_file() or not (root / "include" / "bie.h").is_file():
        raise SystemExit(f"bie: the C sources of libbie are not in {root} (install from the "
                         "repository's python/ folder, or set BIE_SOURCE_DIR to the "
                         "repository)")
    return root


def build_libbie(build_dir):
    """Configure and build the shared library in build_dir; returns the real file's path."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("bie: building libbie needs CMake >= 3.25 and a C compiler "
                         "(Debian: scripts/setup-deps, or apt-get install cmake "
                         "build-essential libopenblas-openmp-dev pkg-config)")
    build_dir = pathlib.Path(build_dir)
    configure = [cmake, "-S", str(_source_dir()), "-B", str(build_dir),
                 "-DCMAKE_BUILD_TYPE=Release", "-DBIE_BUILD_TESTS=OFF",
                 "-DBIE_BUILD_BENCH=OFF", "-DBIE_BUILD_TOOLS=OFF",
                 "-DBIE_CUDA=ON"]  # (the CUDA backend where nvcc is found; never a stale cache)
    configure += shlex.split(os.environ.get("BIE_CMAKE_ARGS", ""))
    jobs = os.environ.get("BIE_BUILD_JOBS") or str(os.cpu_count() or 2)
    subprocess.run(configure, check=True)
    subprocess.run([cmake, "--build", str(build_dir), "--target", "bie", "-j", jobs],
                   check=True)
    return (build_dir / "libbie.so").resolve()  # the versioned file behind the symlinks


class BuildPyWithLibbie(build_py):
    """build_py that also builds libbie and puts it at bie/libbie.so in the package."""

    def run(self):
        super().run()
        build_temp = self.get_finalized_command("build").build_temp
        library = build_libbie(pathlib.Path(build_temp) / "libbie")
        target = pathlib.Path(self.build_lib) / "bie" / "libbie.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, target)
        os.chmod(target, 0o755)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [
            str(pathlib.Path(self.build_lib) / "bie" / "libbie.so")]


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tagged for this platform, not "any"."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibbie}, distclass=BinaryDistribution)
