#!/bin/sh
# attnviz's GPU checks and benchmarks in one run, on a GPU machine without network (docs/gpu.md):
#   sh bench/gpu_check.sh [OUT_DIR]            every step
#   STEPS="tests stats" sh bench/gpu_check.sh  some of: tests sweep stats profile routes scan lab labstep doctor
# Needs the default model's config and tokenizer in .gpu/smol (a loaded model's config.save_pretrained and
# tokenizer.save_pretrained), from which bench/random_model.py makes a random-weight model of its shape. Writes
# gpu.log (the card, the CUDA tests, every bench line), sweep.log (bench/kernel_sweep.py) and profile.log.
# Each step has its own time limit, so one that hangs leaves the others' lines. The limits add up past one call's
# ten minutes: split the steps, e.g. STEPS="tests doctor", then STEPS="stats routes scan", then STEPS="lab" (LAB_SEEDS
# picks seeds), then STEPS="sweep profile".
set -u
out=${1:-${OUT:-/tmp/attnviz-gpu}}
steps=" ${STEPS:-tests sweep stats profile routes scan lab labstep doctor} "
mkdir -p "$out"
log=$out/gpu.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { echo "## $(date -u +%H:%M:%S) $*" >>"$log"; }
wanted() { case "$steps" in *" $1 "*) return 0;; esac; return 1; }
step card; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$log" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >>"$log" 2>&1
if wanted tests; then
  # every file with tests marked cuda (the others import Streamlit, Ray or a browser, which the machine lacks)
  step tests; timeout "${TESTS_S:-200}" python3 -m pytest -m cuda $(grep -l 'mark\.cuda' tests/test_*.py) -q -n 8 \
    -p no:cacheprovider 2>&1 | tail -25 >>"$log"
fi
best=
if wanted sweep; then
  # stages 2 with 128 registers: four programs an SM on Hopper, where the default holds three (docs/gpu.md)
  step sweep; timeout "${SWEEP_S:-180}" python3 bench/kernel_sweep.py --tiles 64x64 128x64 --warps 4 --stages 2 3 \
    --groups 1 4 --registers 0 128 >"$out/sweep.log" 2>&1
  tail -3 "$out/sweep.log" >>"$log"
  num='\([0-9]*\)'
  best=$(sed -n "s/^best tile=\([0-9x]*\) warps=$num stages=$num groups=$num registers=$num.*/\1:\2:\3:\4:\5/p" \
    "$out/sweep.log")
fi
if wanted stats; then
  step "stats (best launch: ${best:-not swept})"
  timeout "${STATS_S:-110}" python3 bench/gpu.py --case llama8b:32768 --case llama8b:4096 --case smollm2:4096 \
    --skip-eager --repeat 3 ${best:+--launch $best} >>"$log" 2>&1
fi
if wanted profile; then
  step profile; timeout 40 python3 bench/gpu.py --case smollm2:4096 --skip-eager --repeat 1 --profile >"$out/profile.log" 2>&1
  timeout 50 python3 bench/gpu.py --case llama8b:32768 --skip-eager --repeat 1 --profile >>"$out/profile.log" 2>&1
fi
if wanted routes || wanted scan || wanted doctor; then
  step model; python3 bench/random_model.py .gpu/smol /tmp/smol --dtype float32 >>"$log" 2>&1
fi
if wanted routes; then
  for dtype in float32 bfloat16; do
    step "routes $dtype"; timeout 35 python3 bench/routes.py --model /tmp/smol --device cuda --dtype $dtype --repeat 3 \
      2>&1 | grep -E '^routes|Error' | tail -3 >>"$log"
  done
  step "routes dense"; timeout 40 python3 bench/routes.py --model /tmp/smol --device cuda --dtype float32 --repeat 3 \
    --dense --profile >"$out/routes_profile.log" 2>&1; grep -E '^routes|Error' "$out/routes_profile.log" | tail -2 >>"$log"
fi
if wanted scan; then
  step scan; timeout 45 python3 bench/scan.py --model /tmp/smol --device cuda --repeat 3 --patching 64 2>&1 \
    | grep -E '^(scan|patching)|Error' | tail -4 >>"$log"
fi
if wanted doctor; then
  # the doctor's checks on CUDA in bfloat16, on the default model's shape with random weights (no weights here)
  step doctor; timeout "${DOCTOR_S:-120}" python3 -m attnviz doctor --device cuda --model /tmp/smol --tokens 1024 \
    >"$out/doctor.log" 2>&1; echo "doctor exit $?" >>"$log"; grep -E '^(PASS|FAIL|SKIP|TIME)|checks' \
    "$out/doctor.log" | tail -30 >>"$log"
fi
if wanted lab; then
  # the lab's default run on the GPU, three seeds: where the sink forms, against the CPU's steps (docs/gpu.md)
  for seed in ${LAB_SEEDS:-0 1 2}; do
    step "lab seed $seed"; timeout "${LAB_S:-150}" python3 bench/lab_sink.py --device cuda --seed "$seed" 2>&1 \
      | grep -E '^lab_sink|Error' | tail -2 >>"$log"
  done
fi
if wanted labstep; then
  # every kind's lab step against its family's stock loop and the stock softmax loop, on the GPU (docs/benchmarks.md)
  step labstep; timeout "${LABSTEP_S:-120}" python3 bench/lab_step.py --device cuda --steps 100 2>&1 \
    | grep -E '^lab_step|^#|Error' >>"$log"
fi
step done
