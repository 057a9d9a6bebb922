#!/usr/bin/env bash
# Download the server's wheels for the GPU machine (Python 3.12, no network there) into .whl/, at
# constraints.txt's versions: what `pagedkv serve` imports beyond that machine's image (FastAPI and what it
# needs, uvicorn with httptools and uvloop). serve_lib.sh's `install_wheels` unpacks them there. Ray and what
# Ray Serve needs travel apart, as .ray/ (benchmarks/tools/ray_carry.sh).
#
#   bash benchmarks/tools/server_wheels.sh      # then carry ".whl" (about 9 MB)
set -eu
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}; DIR=${DIR:-.whl}
PACKAGES=(fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection anyio sniffio h11
          uvicorn httptools uvloop opentelemetry-api)  # fastapi >= 0.16x imports opentelemetry (its telemetry module)
pins=()
for name in "${PACKAGES[@]}"; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt) || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "${pins[@]}"
ls "$DIR"
