#!/usr/bin/env bash
# The pure-python wheels bench/gpu_bench.py's official side needs on a GPU machine that has torch, timm,
# numpy, pillow, pyyaml, tqdm but no registry: omegaconf (dinov2's config), fvcore (dinov2.fsdp imports its
# Checkpointer) and fvcore's own imports. fvcore publishes only an sdist: it is built into a py3-none-any wheel
# here. Into DIR (default .whl, git-ignored); carry it, then on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dir=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dir"
for spec in "omegaconf>=2.4" iopath yacs tabulate termcolor portalocker; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "$spec"
done
"$py" -m pip wheel -q --no-deps -w "$dir" fvcore
ls "$dir"; du -sh "$dir"
