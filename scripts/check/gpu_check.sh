#!/usr/bin/env bash
# One prepared GPU check (issue 44): every step a CUDA run of nanokv should pass, in one go,
# within ~8 minutes on one H200, downloading nothing (torch, triton and transformers installed).
#
#   scripts/check/gpu_check.sh          # on a CUDA machine
#   scripts/check/gpu_check.sh --dry    # the same steps on CPU, Triton's kernels under its
#                                       # interpreter, at tiny shapes (CI keeps the script working)
#
# Steps:
#   1. nanokv doctor (which attention back end a CUDA run uses, and why);
#   2. greedy parity with transformers, tiny Llama and Qwen3, float32 and bfloat16, and the
#      answer staying the same alone, batched and after cache hits (scripts/check/gpu_parity.py);
#   3. nano-vllm's benchmark (256 sequences, 100-1024 prompt and output tokens, Qwen3-0.6B
#      architecture with random weights, bfloat16) with nanokv eager, then with CUDA graphs
#      against transformers' continuous batching (generate_batch), and the fraction of the
#      bandwidth bound each reaches (scripts/bench/throughput.py);
#   4. nanokv generate with its live view, captured from a terminal (tmux).
# Exit status: the number of steps that failed.
set -uo pipefail

cd "$(dirname "$0")/../.."
DRY=0
if [[ "${1:-}" == "--dry" ]]; then
    DRY=1
elif [[ $# -gt 0 ]]; then
    echo "usage: scripts/check/gpu_check.sh [--dry]" >&2
    exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [[ $DRY == 1 ]]; then
    export TRITON_INTERPRET=1
    DEVICE=(--device cpu --attention-backend triton)
    PARITY=(--dtypes float32,bfloat16 --block-sizes 16 --new-tokens 6)
    BENCH=(--random-weights qwen3-tiny --dtype float32 --modes none --num-seqs 4 --min-input 20
        --max-input 60 --min-output 4 --max-output 8 --block-size 16 --hf-dtypes float32
        --threads 1)
    LIVE=(--max-tokens 24 --ignore-eos --threads 1)
else
    DEVICE=(--device cuda)
    PARITY=()
    BENCH=(--random-weights qwen3-0.6b --dtype bfloat16 --modes none)
    LIVE=(--max-tokens 1000 --ignore-eos)
fi

FAILED=0
step() {
    local name=$1
    shift
    echo
    echo "== $name"
    local start=$SECONDS
    if "$@"; then
        echo "-- $name: ok ($((SECONDS - start)) s)"
    else
        echo "-- $name: FAILED ($((SECONDS - start)) s)"
        FAILED=$((FAILED + 1))
    fi
}

live_view() {
    # nanokv generate in a 120x40 terminal; the screen as it stands when the run ends.
    if ! command -v tmux > /dev/null; then
        echo "tmux is not installed: no terminal to capture the live view from"
        return 1
    fi
    local sock="nanokv-gpu-check-$$" cmd
    cmd="env TRITON_INTERPRET=${TRITON_INTERPRET:-0} nanokv generate --live"
    cmd+=" --model $WORK/models/qwen3 ${DEVICE[*]} ${LIVE[*]} --block-size 16"
    cmd+=" 'The capital of France is' 'Paged attention stores keys' 'Hello world'"
    tmux -L "$sock" new-session -d -s live -x 120 -y 40 "$cmd; echo EXIT=\$?; sleep 600"
    # A frame while it runs (the view is replaced by the answers when the run ends), then the
    # screen at the end.
    local screen="" frame="" polls=0
    while ((polls < 1500)); do
        screen=$(tmux -L "$sock" capture-pane -p -t live)
        [[ $screen == *EXIT=* ]] && break
        [[ $screen == *"nanokv generate ·"* ]] && frame=$screen # the view's title
        sleep 0.2
        polls=$((polls + 1))
    done
    tmux -L "$sock" kill-server 2> /dev/null
    [[ -n $frame ]] || echo "no frame of the live view was captured"
    echo "-- the live view, while the run went on:"
    echo "$frame" | sed -e '/^$/N;/^\n$/D'
    echo "-- the screen when it ended:"
    echo "$screen" | sed -e '/^$/N;/^\n$/D'
    [[ $screen == *EXIT=0* && -n $frame ]]
}

step "doctor" nanokv doctor
step "parity and invariance" python scripts/check/gpu_parity.py "${DEVICE[@]}" "${PARITY[@]}" \
    --models "$WORK/models"
step "benchmark, eager (nanokv only)" python scripts/bench/throughput.py "${DEVICE[@]}" \
    "${BENCH[@]}" --enforce-eager --skip-hf
step "benchmark, CUDA graphs, against transformers' continuous batching" \
    python scripts/bench/throughput.py "${DEVICE[@]}" "${BENCH[@]}" --hf-continuous
step "live view" live_view

echo
echo "gpu_check: $FAILED step(s) failed$([[ $DRY == 1 ]] && echo ' (dry: CPU, interpreter)')"
exit $FAILED
