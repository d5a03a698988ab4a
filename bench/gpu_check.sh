#!/usr/bin/env bash
# The GPU checks in one command, on a CUDA machine whose Python already has a CUDA torch (no network needed):
#
#     bash bench/gpu_check.sh [OUT_DIR] [all|PART[,PART...]]     # PART: tests, jobs, tiers, persist
#
# `tests` runs the GPU tests and the checkpoint benchmark, `jobs` the two GPT-2-small runs, `tiers` the tiers
# benchmark (local tier on /dev/shm, durable on the disk): each part fits in ten minutes on one H100, where a lent
# machine's command is cut off; `tests,tiers` together in about seven. `persist` (not in `all`): what a background
# persist costs the training thread, the first step after each save call apart, and the interpreter time it takes
# from a launch-bound loop (bench/persist_interpreter.py), about two minutes.
# Installs the project beside that torch without touching it (--no-deps; falls back to running from the
# checkout): the other dependencies (typer, rich, psutil, pyyaml, xxhash, numpy, pytest) must be there already,
# and a missing one is named before anything runs. Prints the GPU, driver, torch, CUDA and NCCL versions, runs the GPU tests (tests/test_gpu.py), then
# the GPT-2-small job (jobs/gpu-small.yaml) under `resilient run` with two SIGKILLs (bench/gpu_small.py), in fp32
# and again in bf16 with an EMA and the stateful loader (the two step times printed), then the checkpoint
# benchmark on one GPU beside its floors (bench/checkpoint_save.py --device cuda).
# Everything it prints also lands in OUT_DIR (default bench/results/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results/gpu}}"
parts="${2:-all}"
case $out in  # `gpu_check.sh tests` (OUT left out) would have written its results into the repo's tests/
  all|tests|jobs|tiers|persist|*,*) echo "gpu_check.sh: '$out' is a part, not a folder: give OUT_DIR first (bash bench/gpu_check.sh OUT $out)" >&2; exit 2 ;;
esac
parts=${parts//all/tests,jobs,tiers}
for p in ${parts//,/ }; do
  case $p in tests|jobs|tiers|persist) ;; *) echo "gpu_check.sh: part '$p' is none of all, tests, jobs, tiers, persist" >&2; exit 2 ;; esac
done
has() { [[ ,$parts, == *,$1,* ]]; }
tests=0 small=0 bf16=0 saves=0 tiers=0 persist=0
missing=$(python3 -c "import importlib.util as u; print(' '.join(m for m in ('torch', 'typer', 'rich', 'psutil', 'yaml', 'xxhash', 'numpy', 'pytest') if u.find_spec(m) is None))")
if [[ -n $missing ]]; then
  echo "gpu_check.sh: this Python lacks $missing; install them (pip install --no-deps ...) or carry a venv" >&2
  exit 2
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh: torch sees no CUDA device here: these checks need a CUDA machine whose Python has a CUDA torch" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| NCCL', '.'.join(map(str, torch.cuda.nccl.version())), '| GPUs', torch.cuda.device_count())"
} 2>&1 | tee "$out/versions.txt"
if has tests; then
  # pyproject's addopts ask for pytest-xdist (-n 2): replaced, so the GPU tests run one at a time on the one GPU
  # and need no xdist on that machine
  python3 -m pytest -o addopts="--strict-markers" -m gpu -p no:cacheprovider -v -rs tests/test_gpu.py 2>&1 \
    | tee "$out/gpu_tests.txt"
  tests=${PIPESTATUS[0]}
  python3 bench/checkpoint_save.py --device cuda --ranks 1 --gb 2 --out "$out/checkpoint_save.json" 2>&1 \
      | tee "$out/checkpoint_save.txt"
  saves=${PIPESTATUS[0]}
fi
if has jobs; then
  # Two runs in this part, within a lent machine's ten minutes: fp32 600 steps at ~0.3 s, bf16 at ~0.08 s, each
  # with three starts and the steps redone after its two kills.
  python3 bench/gpu_small.py --out "$out" --timeout 370 2>&1 | tee "$out/gpu_small.txt"
  small=${PIPESTATUS[0]}
  # The same job in bf16 (FSDP2 MixedPrecisionPolicy) with a sharded EMA and the stateful loader: its step time
  # against fp32's above is the README's bf16 figure.
  python3 bench/gpu_small.py --out "$out/bf16" --timeout 200 --entry-args "--precision bf16 --ema 0.999 --loader stateful" \
    2>&1 | tee "$out/gpu_small_bf16.txt"
  bf16=${PIPESTATUS[0]}
  python3 -c "import json, sys; f, b = (json.load(open(p))['step_s_median'] for p in sys.argv[1:]); print(f'step time: fp32 {f} s, bf16 {b} s' + (f' ({f / b:.2f}x)' if f and b else ''))" \
    "$out/gpu_small.json" "$out/bf16/gpu_small.json" || true
fi
if has tiers; then
  # The local tier on tmpfs, the durable one on the disk; loads of the same checkpoint from each, the durable one
  # with the page cache dropped (root). No sustained phase: it needs a throttled disk to mean anything.
  python3 bench/tiers.py --device cuda --ranks 1 --gb 2 --saves 3 --loads 3 --copies 3 --sustained 0 \
      --local-tier /dev/shm --out "$out/tiers.json" 2>&1 | tee "$out/tiers.txt"
  tiers=${PIPESTATUS[0]}
fi
if has persist; then
  python3 bench/checkpoint_save.py --device cuda --ranks 1 --gb 2 --saves 4 --steps 10 --sample-ms 2 \
      --out "$out/checkpoint_save_sampled.json" 2>&1 | tee "$out/checkpoint_save_sampled.txt"
  persist=${PIPESTATUS[0]}
  python3 bench/persist_interpreter.py --device cuda --gb 2 --saves 10 2>&1 | tee "$out/persist_interpreter.txt"
  (( persist = persist || PIPESTATUS[0] ))
fi
echo "gpu tests: exit $tests; GPT-2-small job: exit $small; in bf16: exit $bf16; checkpoint bench: exit $saves; tiers bench: exit $tiers; persist: exit $persist"
exit $(( tests || small || bf16 || saves || tiers || persist ))
