#!/usr/bin/env bash
# Issue 29's GPU measurements as ONE command for a lent GPU machine (its lease is 15 minutes in all), each part
# under its own time limit so that a hang costs that part only; every output goes to OUT (default gpu-session).
#   carry: .whl (make gpu-bench-wheels) and .official (make official-src); then, on the GPU machine:
#   bash bench/gpu_session.sh "$OUT" [parts]      # parts: "profile bench input check" (default, ~590 s,
#                                                 # inside one device call's 600 s limit); "levers" on request
# 1. kernel time per step by the CPU estimate's categories (bench/gpu_profile_step.py, issue 39): ViT-S/14 b=64
#    dinopipe eager, the official step (xformers if importable), dinopipe compiled -- checks bench/gpu_proxy.py;
#    (levers: bench/gpu_step_levers.py, the step with one part changed at a time, not in the default);
# 2. make gpu-bench: dinopipe vs the official step, ViT-S/14 b=64 and ViT-L/14 b=32, then end to end from JPEG
#    shards with CPU and GPU augmentation;
# 3. bench/bench_input.py --device cuda: the GPU augmentation path's device side;
# 4. make gpu-check (every check).
set -uo pipefail
out=${1:-gpu-session}
parts=${2:-profile bench input check}
want() { [[ " $parts " == *" $1 "* ]]; }
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/.official/dinov2${PYTHONPATH:+:$PYTHONPATH} OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
t0=$SECONDS
if want profile; then
  timeout 160 python3 -W ignore bench/gpu_profile_step.py "$out/profile" --budget-s 60 \
    --cases vit_s14:64:eager,vit_s14:64:official,vit_s14:64:compile 2>&1 | grep -v "USDT\|profiler_st" | tee "$out/profile.log"
  echo "profile: $((SECONDS - t0)) s"
fi
if want levers; then
  timeout 150 python3 -W ignore bench/gpu_step_levers.py "$out/levers" --budget-s 120 \
    --variants fsdp-eager,fsdp-eager-stockopt,fsdp-eager-noopt,fsdp-eager-dp0,single-eager,official,fsdp-compile \
    2>&1 | grep -v "USDT\|profiler_st" | tee "$out/levers.log"
  echo "levers: $((SECONDS - t0)) s"
fi
if want bench; then
  timeout 230 python3 bench/gpu_bench.py --out "$out/bench" --budget-s 200 --cases vit_s14:64,vit_l14:32 --no-fp16-extra \
    2>&1 | grep -v "    step " | tee "$out/bench.log"
  echo "bench: $((SECONDS - t0)) s"
fi
if want input; then
  timeout 45 python3 bench/bench_input.py --dinov2 .official/dinov2 --rounds 2 --seconds 3 --device cuda 2>&1 | tee "$out/input.log"
  echo "input: $((SECONDS - t0)) s"
fi
if want check; then
  timeout 150 python3 -m dinopipe.app.gpu_check --out "$out/check" 2>&1 | tail -40 | tee "$out/check.log"
  echo "check: $((SECONDS - t0)) s"
fi
