#!/usr/bin/env bash
# Finetune a pretrained BERT on MNLI (matched and mismatched dev) with the paper's Table 6 preset (mlm-finetune mnli).
#
#   CKPT=ckpts/bert336m DATA=glue_data PRESET=336m NPROC=8 TP=1 PP=1 bash examples/finetune/mnli.sh
#
# CKPT: our checkpoint directory (any TP/PP layout; or set HF_MODEL to a local HF BERT directory
# instead); DATA: the official MNLI (matched and mismatched dev) files; PRESET: 336m, 1.3b or 3.8b (batch size, learning rate,
# epochs of Table 6). Extra flags are passed on, e.g. --seeds 5 for the median of five runs.
set -euo pipefail
CKPT=${CKPT:-}
HF_MODEL=${HF_MODEL:-}
DATA=${DATA:-glue_data}
PRESET=${PRESET:-336m}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}
OUT=${OUT:-finetuned/mnli-$PRESET}
if [[ -n "$HF_MODEL" ]]; then SOURCE=(--hf-model "$HF_MODEL"); else SOURCE=(--ckpt "${CKPT:?set CKPT or HF_MODEL}"); fi
export HF_HUB_OFFLINE=1

torchrun --nproc-per-node "$NPROC" -m finetune.cli mnli "${SOURCE[@]}" --data-dir "$DATA" \
    --preset "$PRESET" --tp "$TP" --pp "$PP" --bf16 --save "$OUT/checkpoint" --results-dir "$OUT" "$@"
