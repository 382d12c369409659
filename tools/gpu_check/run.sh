#!/usr/bin/env bash
# The GPU check: run on a CUDA machine from a checkout of the project (no network needed).
#
#   tools/gpu_check/run.sh [--out DIR] [--cpu-dry-run] [--total-s SECONDS] [--only PART ...]
#
# Writes report.json and report.md into DIR (default: $OUT when set, else ./gpu-check-report),
# rewritten after each part, so a run stopped at its time limit keeps what finished. The whole
# check takes at most --total-s (default 400 s: runner.py's PARTS) plus the install. Packages the machine lacks come
# from the wheels tools/gpu_check/fetch_wheels.sh put into .whl/ (installed into a folder of their
# own, beside the machine's torch).
# --cpu-dry-run: every part at its smallest size on the CPU (the test suite runs it).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
out="${OUT:-$repo/gpu-check-report}"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
# the wheels only where the project's packages are missing (a machine with requirements.txt needs none)
if ! "$python" -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(name) is None for name in ('pydantic', 'diffusers', 'torchao', 'bitsandbytes', 'prodigyopt')))" \
        && ls "$repo"/.whl/*.whl > /dev/null 2>&1; then
    site="${GPU_CHECK_SITE:-/tmp/difftrainer-gpu-check-site}"
    if [ ! -e "$site/.installed" ]; then
        echo "[gpu check] installing $(ls "$repo"/.whl/*.whl | wc -l) wheels into $site"
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$repo"/.whl/*.whl || { echo "error: the wheels in .whl/ did not install" >&2; exit 1; }
        touch "$site/.installed"
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$repo" && exec "$python" -m tools.gpu_check.runner --out "$out" "${args[@]}"
