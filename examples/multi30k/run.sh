#!/usr/bin/env bash
# Multi30k (task 1) German -> English with the Annotated Transformer, on the CPU or a GPU.
#
#   examples/multi30k/run.sh                      # downloads Multi30k (needs internet)
#   RAW_DIR=path/to/multi30k examples/multi30k/run.sh   # or raw files {train,valid,test2016}.{de,en}
#   ARCH=transformer examples/multi30k/run.sh     # the same recipe with fairseq's own transformer
#   SEED=2 examples/multi30k/run.sh               # another seed (its own checkpoint folder)
#   DEVICE=gpu EPOCHS=30 examples/multi30k/run.sh  # on a GPU: --fp16 and --max-tokens 8192
#
# Steps: prepare (sacremoses + 8k joint BPE) -> fairseq-train -> average the last 5 epoch
# checkpoints -> fairseq-generate --beam 5 -> detokenised sacreBLEU on test2016.
# Environment: ARCH (annotated_transformer), SEED (1), EPOCHS (20), LENPEN (1.6, chosen on valid),
# WORK (work/multi30k), THREADS (torch threads; default all cores), PYTHON (.venv/bin/python),
# BIN (where the fairseq-* and annotated-* commands are; default: beside PYTHON),
# DEVICE (cpu, or gpu: GPU 0, or the GPUs CUDA_VISIBLE_DEVICES names, in PRECISION, fp16 by
# default, or amp / fp32; fairseq 0.12's bf16 is for TPUs).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
BIN=${BIN:-$(dirname "$PYTHON")}
ARCH=${ARCH:-annotated_transformer}
EPOCHS=${EPOCHS:-20}
SEED=${SEED:-1}
LENPEN=${LENPEN:-1.6}
if ! [[ "$EPOCHS" =~ ^[0-9]+$ ]] || [ $((10#$EPOCHS)) -lt 1 ]; then
  echo "run.sh: error: EPOCHS=$EPOCHS; give a number of epochs >= 1" >&2; exit 2
fi
EPOCHS=$((10#$EPOCHS))  # 08 is 8, not an octal error later
if ! [[ "$SEED" =~ ^[0-9]+$ ]]; then
  echo "run.sh: error: SEED=$SEED; give a whole number (fairseq's --seed)" >&2; exit 2
fi
WORK=${WORK:-work/multi30k}
DATA=$WORK/data-bin
CKPT=$WORK/$ARCH-seed$SEED
[ -n "${THREADS:-}" ] && export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
case "${DEVICE:-cpu}" in
  cpu) DEVICE_FLAGS=(--max-tokens 4096 --cpu) ;;
  gpu) export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # fairseq takes every GPU it sees
       PRECISION=${PRECISION:-fp16}
       DEVICE_FLAGS=(--max-tokens 8192)
       case "$PRECISION" in
         fp16|amp) DEVICE_FLAGS+=("--$PRECISION") ;;
         fp32) ;;
         bf16) echo "run.sh: error: PRECISION=bf16: fairseq 0.12's --bf16 also switches on" \
                    "--tpu (fairseq-train then looks for a TPU); use PRECISION=fp16, amp or fp32" >&2
               exit 2 ;;
         *) echo "run.sh: error: PRECISION=$PRECISION; use PRECISION=fp16, amp or fp32" >&2
            exit 2 ;;
       esac ;;
  *) echo "run.sh: error: DEVICE=$DEVICE; use DEVICE=cpu or DEVICE=gpu" >&2; exit 2 ;;
esac

if [ ! -f "$DATA/prepare.json" ]; then  # --force: redo a preparation stopped half-way
  "$BIN/annotated-prepare" --corpus multi30k ${RAW_DIR:+--raw-dir "$RAW_DIR"} \
      --dest "$DATA" --bpe-merges 8000 --force
else
  echo "run.sh: reusing $DATA (prepared earlier; delete it to prepare again)"
fi

# One recipe for both architectures, the model code the only difference: d_model 256, 3+3
# layers, d_ff 512, 8 heads, pre-LN in both stacks (the notebook's; fairseq's transformer is
# post-LN unless told), dropout 0.3, weight decay 1e-4, all embeddings shared, Adam (0.9, 0.98),
# label smoothing 0.1, Noam (warmup 1000: peak lr 256^-0.5 * 1000^-0.5 = 1.98e-3), max-tokens
# 4096 (8192 on a GPU).
mkdir -p "$CKPT"
# unbuffered: through a pipe, fairseq-train's lines would otherwise come minutes late; the last
# filter adds the time left after each interval line
PYTHONUNBUFFERED=1 "$BIN/fairseq-train" "$DATA" --user-dir fairseq_plugin --arch "$ARCH" \
    --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 \
    --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 \
    --encoder-attention-heads 8 --decoder-attention-heads 8 \
    --encoder-normalize-before --decoder-normalize-before \
    --dropout 0.3 --weight-decay 1e-4 --share-all-embeddings \
    --criterion annotated_label_smoothing --label-smoothing 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-9 --clip-norm 0.0 \
    --lr-scheduler noam --warmup-updates 1000 --noam-factor 1 \
    "${DEVICE_FLAGS[@]}" --max-epoch "$EPOCHS" --seed "$SEED" \
    --save-dir "$CKPT" --keep-last-epochs 5 --log-format simple --log-interval 100 \
    2>&1 | tee -a "$CKPT/train.log" | "$PYTHON" -m fairseq_plugin.cli.follow --epochs "$EPOCHS"

LAST=$(( EPOCHS < 5 ? EPOCHS : 5 ))  # fairseq keeps the last 5 epoch checkpoints
"$BIN/annotated-average-checkpoints" --inputs "$CKPT" --num-epoch-checkpoints $LAST \
    --output "$CKPT/average_last$LAST.pt" --force
for ckpt in checkpoint_last.pt average_last$LAST.pt; do
  echo "== $ARCH seed $SEED $ckpt"
  "$BIN/annotated-evaluate-bleu" "$DATA" "$CKPT/$ckpt" --beam 5 --lenpen "$LENPEN" --examples 0 \
      --output "$CKPT/${ckpt%.pt}.test2016.en" | tee "$CKPT/${ckpt%.pt}.bleu"
done
