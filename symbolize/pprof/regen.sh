#!/usr/bin/env bash
# Regenerate profile_pb2.py (and its typing stub) from profile.proto with the protoc that
# grpcio-tools ships, in a throw-away virtualenv so the project's own environment is untouched.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet grpcio-tools
"$venv/bin/python" -m grpc_tools.protoc -I"$here" --python_out="$here" --pyi_out="$here" \
    "$here/profile.proto"
echo "regenerated $here/profile_pb2.py"
