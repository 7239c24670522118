"""scripts/setup.sh chooses PyPI's CUDA torch (about 2.7 GB with its NVIDIA wheels) only where nvidia-smi lists a
GPU: an nvidia-smi that is installed but finds no device, or no driver, means the CPU build. Runs the script's
own has_nvidia_gpu under fake nvidia-smi commands."""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO

FAKE_NVIDIA_SMI = {
    # nvidia-smi -L with a GPU (the format of the 535-570 drivers)
    "lists a GPU": ("echo 'GPU 0: NVIDIA H200 (UUID: GPU-0c7a5e2e-58f3-4a8b-9d38-6f1b1e0c2a11)'", True),
    # installed (a driver package, a container toolkit) but no device visible: exit 6, nothing listed
    "no device": ("echo 'No devices were found'; exit 6", False),
    # the driver is not loaded: exit 9
    "no driver": ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9",
                  False),
    # answers, exit 0, but lists no GPU (a MIG-less stub, a wrapper script)
    "lists nothing": ("exit 0", False),
}


def has_nvidia_gpu(tmp_path, fake: str | None) -> bool:
    """setup.sh's has_nvidia_gpu, run with only `fake` (or no nvidia-smi at all) on the PATH."""
    script = (REPO / "scripts" / "setup.sh").read_text()
    definition = re.search(r"^has_nvidia_gpu\(\) \{.*?\}$", script, re.MULTILINE | re.DOTALL)
    assert definition, "scripts/setup.sh defines no has_nvidia_gpu"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("grep", "head", "sed", "awk"):          # what a check may pipe through, nothing NVIDIA's
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    if fake is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\n{fake}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    r = subprocess.run(["/bin/bash", "-c", f"{definition.group(0)}\nhas_nvidia_gpu"],
                       env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30)
    return r.returncode == 0


@pytest.mark.parametrize("case", sorted(FAKE_NVIDIA_SMI))
def test_only_an_nvidia_smi_that_lists_a_gpu_means_cuda(tmp_path, case):
    fake, gpu = FAKE_NVIDIA_SMI[case]
    assert has_nvidia_gpu(tmp_path, fake) is gpu, case


def test_no_nvidia_smi_means_no_gpu(tmp_path):
    assert has_nvidia_gpu(tmp_path, None) is False
