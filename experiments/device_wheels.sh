#!/usr/bin/env bash
# Wheels the H200 image lacks, for its Python 3.12, into .whl/ (carry it: run's carry [".whl"]).
# The device has no package index; experiments/run_h200.sh installs .whl/*.whl into /tmp/site.
# Serving (bench_serving, ablate serving-load) needs the server's stack, the elementwise peers
# Liger-Kernel, structured output outlines-core. ~7 MB in all. The device needs these importable
# together: check with `python3 -c "import fastapi, uvicorn"` over /tmp/site before a serving run.
set -euo pipefail
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl fastapi starlette uvicorn h11 click anyio sniffio pydantic pydantic-core annotated-types \
  typing-inspection prometheus-client httpx httpcore certifi idna outlines-core liger-kernel \
  opentelemetry-api  # fastapi >= 0.16x imports it (fastapi.telemetry)
ls .whl
