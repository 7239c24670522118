"""ament_python package oxygen_ros: installs with pip (this repo's README) or colcon (a ROS 2 workspace)."""
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "oxygen_ros"

# The Triton kernels live in the top-level kernels/ folder and install as oxygen_ros.kernels.
packages = find_packages(include=[PACKAGE, f"{PACKAGE}.*"]) + [f"{PACKAGE}.kernels"]

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=packages,
    package_dir={f"{PACKAGE}.kernels": "kernels"},
    package_data={f"{PACKAGE}.model": ["assets/*", "assets/demo/*", "assets/demo_rtc/*"], f"{PACKAGE}.sim": ["assets/*"],
                  f"{PACKAGE}.console": ["static/*"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml")),
    ],
    install_requires=["numpy", "safetensors", "sentencepiece", "transforms3d", "pyyaml"],
    zip_safe=False,
    maintainer="oxygen_ros maintainers",
    maintainer_email="oxygen-ros@example.com",
    description="pi0.5 VLA serving for ROS 2 with unified KV cache management (OxyGen).",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            f"oxygen_bringup = {PACKAGE}.bringup:main",
            f"oxygen_ctl = {PACKAGE}.ctl:main",
            f"oxygen_bench = {PACKAGE}.bench.__main__:main",
            f"oxygen_oracle = {PACKAGE}.tools.oracle:main",
            f"oxygen_replay = {PACKAGE}.record.replay:main",
            f"oxygen_serve = {PACKAGE}.serve.cli:main",
        ],
    },
)
