"""``gpu.sh``'s first stage: is this Python's torch a CUDA build that sees a GPU, and are
the test and benchmark dependencies importable? Prints what it found; exit 0 when the
rest can run, 3 for a CPU-only torch wheel, 4 for a CUDA build that sees no GPU, 5 for
a missing module the benchmark needs (a missing test module is only reported: the test
stage then fails on its own).

Run: python benchmarks/gpu_env.py
"""

from __future__ import annotations

import importlib.util
import sys

NEEDED = ("torch", "optree", "einops", "cloudpickle", "shardfn")  # shardfn and its benchmarks
FOR_TESTS = ("pytest", "hypothesis")


def main() -> int:
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    untestable = [name for name in FOR_TESTS if importlib.util.find_spec(name) is None]
    if "torch" in missing:
        print(f"gpu.sh: {sys.executable} cannot import torch")
        return 5
    import torch

    print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, "
          f"CUDA build {torch.version.cuda}, GPUs visible {torch.cuda.device_count()}")
    if torch.version.cuda is None:
        print(f"gpu.sh: torch {torch.__version__} is the CPU-only wheel (torch.version.cuda is "
              "None): nothing here can run on the GPU. Use a Python whose torch is a CUDA "
              "build (PYTHON=...).")
        return 3
    if not torch.cuda.is_available():
        print(f"gpu.sh: torch {torch.__version__} is a CUDA {torch.version.cuda} build, but "
              "torch.cuda.is_available() is False: no GPU visible (driver, "
              "CUDA_VISIBLE_DEVICES?)")
        return 4
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB")
    if untestable:
        print(f"gpu.sh: missing test modules: {', '.join(untestable)} (the CUDA tests will "
              "fail; the benchmark still runs)")
    if missing:
        print(f"gpu.sh: missing modules: {', '.join(missing)} (the machine cannot install "
              "them)")
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
