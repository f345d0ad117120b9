"""Where `make venv` takes torch from: the CPU build on a machine without a GPU.

PyPI's torch for Linux x86_64 is the CUDA build (several GB with its nvidia packages).
Without ``--check`` this prints the pip options to use on stdout and why on stderr:

- ``FOREBAY_TORCH_INDEX=URL``: that index as an extra one (a CUDA index on a GPU
  machine, a mirror...); ``FOREBAY_TORCH_INDEX=none``: pip's configuration as it is;
- a GPU (``nvidia-smi -L`` lists one): pip's configuration as it is;
- no GPU: PyTorch's CPU index (``+cpu`` builds) when it answers within 5 s; otherwise
  pip's configuration, which takes a ``+cpu`` wheel if one is offered (a wheelhouse, as
  on the machines forebay is developed on) and else the CUDA build.

``--check`` runs after the install and warns (exit 0) when a CUDA build landed on a
machine without a GPU, with the command that replaces it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def choose() -> tuple[list[str], str]:
    env = os.environ.get("FOREBAY_TORCH_INDEX", "").strip()
    if env.lower() == "none":
        return [], "torch from pip's configuration (FOREBAY_TORCH_INDEX=none)"
    if env:
        return ["--extra-index-url", env], f"torch from {env} (FOREBAY_TORCH_INDEX)"
    if has_gpu():
        return [], "a GPU is present: torch from pip's configuration (PyPI's CUDA build)"
    if reachable(CPU_INDEX):
        return ["--extra-index-url", CPU_INDEX], f"no GPU: torch's CPU build from {CPU_INDEX}"
    return [], (f"no GPU, and {CPU_INDEX} does not answer: torch from pip's configuration "
                f"(a +cpu wheel if one is offered there, else PyPI's CUDA build; "
                f"FOREBAY_TORCH_INDEX=URL names another index)")


def check() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.version.cuda and not has_gpu():
        print(f"note: torch {torch.__version__} is a CUDA build on a machine without a GPU "
              f"(it works on the CPU, but it is several GB); for the CPU build: "
              f"{sys.executable} -m pip install --force-reinstall --no-deps "
              f"--index-url {CPU_INDEX} torch=={torch.__version__.split('+')[0]}",
              file=sys.stderr)


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        check()
        return
    opts, why = choose()
    print(f"make venv: {why}", file=sys.stderr)
    print(" ".join(opts))


if __name__ == "__main__":
    main()
