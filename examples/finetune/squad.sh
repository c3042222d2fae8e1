#!/usr/bin/env bash
# Finetune a pretrained BERT on SQuAD 1.1 with the paper's Table 6 preset (mlm-finetune squad).
#
#   CKPT=ckpts/bert336m DATA=squad PRESET=336m NPROC=8 TP=1 PP=1 bash examples/finetune/squad.sh
#
# CKPT: our checkpoint directory (any TP/PP layout; or set HF_MODEL to a local HF BERT directory
# instead); DATA: the official SQuAD 1.1 files; PRESET: 336m, 1.3b or 3.8b (batch size, learning rate,
# epochs of Table 6). Extra flags are passed on, e.g. --seeds 5 for the median of five runs.
set -euo pipefail
CKPT=${CKPT:-}
HF_MODEL=${HF_MODEL:-}
DATA=${DATA:-squad}
PRESET=${PRESET:-336m}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}
OUT=${OUT:-finetuned/squad-$PRESET}
if [[ -n "$HF_MODEL" ]]; then SOURCE=(--hf-model "$HF_MODEL"); else SOURCE=(--ckpt "${CKPT:?set CKPT or HF_MODEL}"); fi
export HF_HUB_OFFLINE=1

torchrun --nproc-per-node "$NPROC" -m finetune.cli squad "${SOURCE[@]}" --data-dir "$DATA" \
    --preset "$PRESET" --tp "$TP" --pp "$PP" --seq-length 384 --doc-stride 128 --bf16 --save "$OUT/checkpoint" --results-dir "$OUT" "$@"
