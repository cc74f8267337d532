"""Build hook: generate the gRPC stubs from protos/ at build time.

Follows vllm-tgis-adapter's setup.py: a ``build_py`` subclass runs grpcio-tools' protoc
over ``protos/qwenvl/**.proto`` before the packages are collected, so imports read
``from qwenvl.encoder.v1 import encoder_service_pb2`` and no generated code is committed.
In an editable install the stubs are written next to the .proto files (git-ignored).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"


def compile_protos() -> None:
    """Run protoc (from grpcio-tools) over every .proto under protos/qwenvl."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("qwenvl/**/*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
    ]
    # Typed stubs (.pyi) when mypy-protobuf's plugins are installed (they are build requirements).
    bindir = Path(sys.executable).parent
    mypy_plugin = shutil.which("protoc-gen-mypy") or str(bindir / "protoc-gen-mypy")
    mypy_grpc_plugin = shutil.which("protoc-gen-mypy_grpc") or str(bindir / "protoc-gen-mypy_grpc")
    if Path(mypy_plugin).exists() and Path(mypy_grpc_plugin).exists():
        args += [
            f"--plugin=protoc-gen-mypy={mypy_plugin}",
            f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin}",
            f"--mypy_out={PROTO_ROOT}",
            f"--mypy_grpc_out={PROTO_ROOT}",
        ]
    rc = protoc.main([*args, *protos])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


class BuildPyWithProtos(build_py):
    """build_py that generates the protobuf/gRPC modules first."""

    def run(self) -> None:
        compile_protos()
        super().run()


packages = find_packages(
    include=[
        "splitvl",
        "splitvl.*",
        "splitvl_tools",
        "splitvl_tools.*",
        "vlcommon",
        "vlcommon.*",
        "encoder_service",
        "encoder_service.*",
        "cache_service",
        "cache_service.*",
        "decoder_service",
        "decoder_service.*",
        "gateway",
        "gateway.*",
    ]
)
proto_packages = find_packages(where="protos", include=["qwenvl", "qwenvl.*"])

setup(
    packages=packages + proto_packages,
    package_dir={"qwenvl": "protos/qwenvl"},
    cmdclass={"build_py": BuildPyWithProtos},
)
