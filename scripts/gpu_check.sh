#!/usr/bin/env bash
# The GPU check for a lent GPU machine (scripts/gpu_check.py says what it measures).
#
#   scripts/gpu_check.sh --prepare     here, with network: the wheels the lent machine lacks
#                                      (grpcio-status, googleapis-common-protos, pure Python,
#                                      ~0.3 MiB) into .gpu_wheels/, which git ignores
#   scripts/gpu_check.sh OUT_DIR       there: OUT_DIR/gpu-check.json, about 8 minutes
#   scripts/gpu_check.sh --dry-run OUT_DIR   anywhere: the same steps on the CPU, small
#
# The device tool's call: command "bash scripts/gpu_check.sh $OUT", carry [".gpu_wheels"],
# timeout_s 600. PYTHON picks the interpreter (default python3, the one holding torch there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=.gpu_wheels
NEEDED="grpcio-status googleapis-common-protos"

if [ "${1:-}" = "--prepare" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # --no-deps: grpcio and protobuf are there already (the device page's package list).
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --dest "$WHEELS" $NEEDED
  du -sh "$WHEELS"
  exit 0
fi

dry=()
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); shift; fi
out=${1:?usage: scripts/gpu_check.sh [--dry-run] OUT_DIR | --prepare}
mkdir -p "$out"

if ! "$PYTHON" -c "import grpc_status, google.rpc.status_pb2" 2>/dev/null; then
  [ -d "$WHEELS" ] || { echo "missing $NEEDED: run scripts/gpu_check.sh --prepare first" >&2; exit 1; }
  deps=$(mktemp -d)
  "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$deps" "$WHEELS"/*.whl
  export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 560 "$PYTHON" scripts/gpu_check.py --out "$out/gpu-check.json" "${dry[@]}"
