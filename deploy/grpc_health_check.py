#!/usr/bin/env python3
"""Exit 0 when a gRPC server answers grpc.health.v1 ``Check`` with SERVING, else 1.

Used by the compose file's health checks (Kubernetes uses its built-in ``grpc:`` probe).
A Python script rather than the grpc-health-probe binary: the image already holds grpcio and
grpcio-health-checking, and a binary download would be one more thing to pin and verify.

Usage: ``grpc-health-check [HOST:PORT] [SERVICE]`` (default ``127.0.0.1:$PORT`` taken from
``GRPC_HEALTH_PORT``, and the server's overall status, service ``""``).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else f"127.0.0.1:{os.environ['GRPC_HEALTH_PORT']}"
    service = argv[2] if len(argv) > 2 else ""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
