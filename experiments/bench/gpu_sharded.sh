#!/usr/bin/env bash
# Issue #30's GPU rows, one command on one GPU (docs/performance.md, "Against torch, compiled on both sides"):
# the single-device rows (eager, native, core.jit, torch.compile) and the sharded step on one rank (nccl) under
# Policy(compute=bf16), eager and jit=True, for zero3 and zero3+tp+sp, against NativeGpt + FSDP2
# (MixedPrecisionPolicy(bf16, fp32)) eager and with compiled blocks; gpt_650m, batch 8, seq 2048.
# Run from the repository root: bash experiments/bench/gpu_sharded.sh [extra bench.jit flags]
set -euo pipefail
python="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
exec "$python" -m experiments.bench.jit --device cuda --configs gpt_650m --sharded zero3 zero3+tp+sp \
    --steps 10 --warmup 3 --csv bench_jit_gpu.csv "$@"
