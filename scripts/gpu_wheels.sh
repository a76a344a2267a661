#!/usr/bin/env bash
# Fetch, here (where PyPI is reachable), the wheels that a device machine's image lacks, into
# .whl/ (git-ignored), for scripts/gpu_check.sh to install there offline. The image has
# Python 3.12 with torch, transformers, numpy, safetensors, pytest and most of mstar's needs;
# what it lacks is listed below (FlashInfer pinned to a release whose wheel is small enough to
# carry: 0.7's is 101 MB, over the 64 MiB a device call takes along).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
wheels=(
    "flashinfer-python==0.6.1" "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0" nvidia-cudnn-frontend
    pyzmq msgspec structlog gguf snac diffusers fastapi starlette pydantic pydantic-core annotated-types
    typing-inspection uvicorn python-multipart websockets soxr pytest-asyncio
)
rm -rf .whl && mkdir -p .whl
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl "${wheels[@]}"
du -sh .whl
