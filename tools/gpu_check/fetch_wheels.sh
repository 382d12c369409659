#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels a bare CUDA box lacks for the GPU check
# (run.sh installs them there beside the box's own torch, transformers and numpy).
#
#   tools/gpu_check/fetch_wheels.sh [CUDA_LIB]     e.g. cuda130 (default) for a torch built for CUDA 13.0
#
# Into <repo>/.whl/ (ignored by git): Python 3.12 manylinux x86_64 wheels, no dependencies
# resolved (each one named here), in the versions requirements.txt pins where it pins them.
# bitsandbytes is re-packed with only the CUDA library the box's torch loads (CUDA_LIB), which
# takes it from ~70 MB to a few MB. Versions that matter for the box's torch 2.11: torchao 0.18
# is built for torch >= 2.11 (its own import check); bitsandbytes 0.50 asks torch >= 2.4.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cuda_lib="${1:-cuda130}"
python="${PYTHON:-python3}"
out="$repo/.whl"
rm -rf "$out" && mkdir -p "$out"

pinned() {  # the version requirements.txt pins for $1
    sed -n "s/^$1==\([^ ]*\).*/\1/p" "$repo/requirements.txt" "$repo/requirements-test.txt" | head -n 1
}
# The project's own pins, then what they need that such a box lacks (pip list of the box: KINDS.md
# of the workplace; a box with less needs more names here). huggingface-hub (>=1.32 for diffusers),
# safetensors, accelerate, numpy, pillow, regex, requests, filelock, einops, tqdm, psutil,
# tensorboard and pytest(-timeout) are taken from the box.
packages=(
    "pydantic==$(pinned pydantic)" pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    "diffusers==$(pinned diffusers)" importlib-metadata==10.2.0 zipp==4.1.2 lazy-importer==0.1.0
    "torchao==$(pinned torchao)" "bitsandbytes==$(pinned bitsandbytes)" "peft==$(pinned peft)"
    "prodigyopt==$(pinned prodigyopt)" "schedulefree==$(pinned schedulefree)"
    "lion-pytorch==$(pinned lion-pytorch)" "came-pytorch==$(pinned came-pytorch)"
    "lycoris-lora==$(pinned lycoris-lora)" toml==0.10.2
)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$out" "${packages[@]}"

"$python" "$here/repack_wheel.py" "$out"/bitsandbytes-*.whl --keep "libbitsandbytes_${cuda_lib}" --keep libbitsandbytes_cpu

ls -l "$out"
total=$(du -cb "$out"/*.whl | tail -n 1 | cut -f 1)
echo "total: $((total / 1024)) KiB in $(ls "$out"/*.whl | wc -l) wheels"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
    echo "error: the wheels come to more than 40 MB; the tree and wheels must fit in 64 MiB" >&2
    exit 1
fi
