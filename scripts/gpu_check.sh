#!/usr/bin/env bash
# The first device session's one script: set up, run the gpu-marked tests, then time the GPU
# routes against the torch baseline, within about 9 minutes. Writes into $OUT (default
# gpu-check/): gpu_check.md (the table), gpu_check.json, and logs.
#
#   scripts/gpu_wheels.sh                  # here, with PyPI: the wheels the image lacks -> .whl/
#   scripts/gpu_check.sh                   # there, carrying .whl (device: carry [".whl"])
#
# Where .whl/ is absent it installs mstar's cuda extra from the index instead. Each step has its
# own time limit and a failing step does not stop the next: the table says what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log="$out/gpu_check.log"
: > "$log"

step() {  # step NAME SECONDS COMMAND...: run it, log it, record its exit status
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    echo "== $name: $*" | tee -a "$log"
    timeout "$seconds" "$@" >> "$log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$out/steps.tsv"
}
: > "$out/steps.tsv"

if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    site=/tmp/mstar-site
    step install 240 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    step install 400 "$py" -m pip install -q -e ".[dev,cuda]"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt" 2>&1
"$py" -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" \
    >> "$out/device.txt" 2>&1

# The gpu-marked tests (CUDA graphs, FlashInfer at real head layouts, CUDA IPC lifetimes).
step gpu-tests 240 "$py" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --timeout 200 \
    --junitxml "$out/gpu_tests.xml" tests/engines/test_gpu.py tests/actors/test_cuda_ipc.py \
    tests/zoo/vjepa2/test_engine.py
# Decode steps: torch vs FlashInfer, eager vs CUDA graphs; CUDA IPC vs host shared memory.
step bench-gpu 150 "$py" scripts/bench_gpu.py --json "$out/bench_gpu.json" --markdown "$out/bench_gpu.md"
# The zoo's benchmarks on the device, c = 1 and 16, each against its own baseline.
step bench-llm 120 "$py" scripts/bench_llm.py --models tiny --concurrency 1,16 --new-tokens 64 \
    --waves 1 --device cuda --out "$out/llm"
step bench-orpheus 90 "$py" scripts/bench_orpheus.py --quick --concurrency 1,16 --device cuda --out "$out/orpheus"
step bench-pi05 60 "$py" scripts/bench_pi05.py --config pi05-small --concurrency 1,16 --device cuda --out "$out/pi05"
step bench-bagel 90 "$py" scripts/bench_bagel.py --concurrency 1,16 --timesteps 10 --num-requests 16 \
    --device cuda --out "$out/bagel"
step bench-qwen3-omni 90 "$py" scripts/bench_qwen3_omni.py --quick --concurrency 1,16 --device cuda \
    --out "$out/qwen3_omni"

"$py" - "$out" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
lines = ["# gpu_check", "", (out / "device.txt").read_text().strip(), "", "| step | exit | seconds |", "|---|---|---|"]
lines += [f"| {name} | {rc} | {secs} |" for name, rc, secs in steps]
tests = {}
if (out / "gpu_tests.xml").is_file():
    suite = ET.parse(out / "gpu_tests.xml").getroot().find("testsuite")
    if suite is not None:
        tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        lines += ["", "gpu tests: " + ", ".join(f"{k} {v}" for k, v in tests.items())]
if (out / "bench_gpu.md").is_file():
    lines += ["", (out / "bench_gpu.md").read_text().strip()]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
json.dump({"steps": steps, "tests": tests}, (out / "gpu_check.json").open("w"), indent=2)
print("\n".join(lines))
PY
