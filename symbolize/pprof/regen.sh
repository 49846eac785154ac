#!/usr/bin/env bash
# Regenerate profile_pb2.py and profile_raw_pb2.py (and their typing stubs) from the .proto
# files with the protoc that grpcio-tools ships, in a throw-away virtualenv so the project's own
# environment is untouched. Compiled from the repository root, so that profile_raw_pb2 imports
# profile_pb2 as symbolize.pprof.profile_pb2.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet grpcio-tools
cd "$root"
"$venv/bin/python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
    symbolize/pprof/profile.proto symbolize/pprof/profile_raw.proto
echo "regenerated $here/profile_pb2.py and $here/profile_raw_pb2.py"
