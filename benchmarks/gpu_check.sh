#!/usr/bin/env bash
# The GPU validation in a 15-minute device lease: two parts of one command each (docs/validation.md, "Next GPU run").
# validate_device.py's phases by worth, each cut at what is left of DEADLINE s and skipped below its minimum.
#   PART=1 (DEADLINE 450): the rows whose speed counts, one run at a time on the GPU, at the profiler's own budget:
#           full fine-tuning with the fresh-process truth, compile (full, LoRA), LoRA DPO, stock torchtune beside
#           ours (fine-tuning and DPO, compile off and on), QLoRA; `estimate` beside them (fake tensors).
#   PART=2 (DEADLINE 230): every other path in lanes side by side, each run at an explicit LANE_BUDGET (24GiB) so
#           that together they fit the GPU: KD and full DPO with the truth; LoRA with the truth, checkpointing on;
#           the planted OOM, SIGUSR1 and resume; PagedAdamW8bit in the backward, torchrun with NCCL; QAT, activation
#           offloading. Their tokens/s are no speeds (the lanes share the GPU).
# Options go to every validate_device.py run; .whl/ (gpu_wheels.sh) is installed first. OUT gets 5 files: env.txt,
# run.log, validation.json and .md (the lanes merged), logs.tgz (each lane's results and log, every run's log and
# profile).
T0=$(date +%s); PART=${PART:-1}; OUT=${OUT:-/tmp/gpu_check}; PY=${PY:-python3}; W=${WORKDIR:-/tmp/val}
DEADLINE=${DEADLINE:-$([ "$PART" = 2 ] && echo 230 || echo 450)}; LANE_BUDGET=${LANE_BUDGET:-24GiB}
mkdir -p "$OUT" "$W/lanes"; export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "$NO_WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 3
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; uname -r
  $PY -c 'import torch, datasets, torchtune, torchao; print("torch", torch.__version__, "cuda", torch.version.cuda,
"datasets", datasets.__version__, "torchao", torchao.__version__)
import bitsandbytes; print("bitsandbytes", bitsandbytes.__version__)'; } > "$OUT/env.txt" 2>&1
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
lane() {  # name, its options, then "minimum-seconds options" phases: run in order, each cut at the deadline
  local name=$1 extra=$2 need l seen; shift 2
  seen=$(cat "$W/lanes/$name.log" 2>/dev/null | wc -l)
  local V=("$PY" benchmarks/validate_device.py --workdir "$W/$name" --assets "$W/assets" --data-dir "$W/data"
           --json "$W/lanes/$name.json")
  for p in "$@"; do
    need=${p%% *}; l=$(left)
    if [ "$l" -lt "$need" ]; then echo "SKIP ($l s left) $name: ${p#* }" >> "$OUT/run.log"; continue; fi
    echo "=== $(date +%T) ($l s left) $name: ${p#* }" >> "$OUT/run.log"
    # shellcheck disable=SC2086
    timeout -k 5 "$l" "${V[@]}" $extra ${p#* } "${ARGS[@]}" >> "$W/lanes/$name.log" 2>&1
    [ $? -lt 124 ] || pkill -9 -f "validate_device.py --child $W/$name/" 2>/dev/null  # cut: its runs too
  done
  tail -n +$((seen + 1)) "$W/lanes/$name.log" 2>/dev/null | grep -E "^(phase|  [a-z])" | sed "s/^/$name: /" \
    >> "$OUT/run.log"
}
ARGS=("$@")
if [ "$PART" = 1 ]; then
  lane main "" "45 --phase assets" "85 --phase full --settings full/ac_off"
  cp "$W/lanes/main.json" "$W/lanes/estimate.json" 2>/dev/null
  lane estimate "--phase estimate --workdir $W/main" "25 " &  # full/ac_off's, beside the next runs
  lane main "" "100 --phase compile" "35 --phase dpo --settings lora_dpo/ac_off" "100 --phase stock" \
    "35 --phase qlora" "35 --phase full --settings full/ac_on"
  wait
  LANES=(main estimate)
else
  B="--budget $LANE_BUDGET --compile-budget $LANE_BUDGET"
  lane main "" "45 --phase assets"
  lane kd "$B" "70 --phase kd" "70 --phase dpo --settings full_dpo/ac_off" "25 --phase estimate" &
  lane memory "$B" "70 --phase lora --settings lora/ac_off" "25 --phase estimate" \
    "35 --phase lora --settings lora/ac_on" "35 --phase full --settings full/ac_on" &
  lane faults "$B" "60 --phase oom" "75 --phase preempt" &
  lane paths "$B" "40 --phase bwd" "45 --phase nccl" &
  lane qat "$B" "70 --phase qat" "40 --phase offload" &
  wait
  LANES=(main kd memory faults paths qat)
fi
MERGE=(); for name in "${LANES[@]}"; do [ -f "$W/lanes/$name.json" ] && MERGE+=("$W/lanes/$name.json"); done
if [ ${#MERGE[@]} -gt 0 ]; then
  "$PY" benchmarks/validate_device.py --json "$OUT/validation.json" --merge "${MERGE[@]}" > /dev/null 2>&1
  cat "$OUT/validation.md"
fi
(cd "$W" && tar czf "$OUT/logs.tgz" lanes ./*/logs $(ls ./*/runs/*/profile/profile.json 2>/dev/null)) 2>/dev/null
grep -E "^(===|SKIP|[a-z0-9]+: )" "$OUT/run.log"
echo "total $(( $(date +%s) - T0 )) s"
