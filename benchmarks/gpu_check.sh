#!/usr/bin/env bash
# The GPU validation in a short device lease: validate_device.py's phases by worth, each cut at what is left of
# DEADLINE s and skipped below its minimum. Options go to validate_device.py; .whl/ (gpu_wheels.sh) is installed
# first. Writes OUT/env.txt, run.log, validation.json and .md, table.md and logs.tgz (every log and profile).
T0=$(date +%s); DEADLINE=${DEADLINE:-515}; OUT=${OUT:-/tmp/gpu_check}; PY=${PY:-python3}; W=${WORKDIR:-/tmp/val}
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "$NO_WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 3
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; uname -r
  $PY -c 'import torch, datasets, torchtune, torchao; print("torch", torch.__version__, "cuda", torch.version.cuda,
"datasets", datasets.__version__, "torchao", torchao.__version__)'; } > "$OUT/env.txt" 2>&1
V=("$PY" benchmarks/validate_device.py --workdir "$W" --assets "$W/assets" --json "$OUT/validation.json" "$@")
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
phase() {  # minimum seconds, then validate_device.py options
  local need=$1 l; shift; l=$(left)
  if [ "$l" -lt "$need" ]; then echo "SKIP ($l s left): $*" >> "$OUT/run.log"; return; fi
  echo "=== $(date +%T) ($l s left): $*" >> "$OUT/run.log"
  timeout -k 5 "$l" "${V[@]}" "$@" >> "$OUT/run.log" 2>&1
  pkill -9 -f "validate_device.py --child" 2>/dev/null
  [ -d "$W/logs" ] && (cd "$W" && tar czf "$OUT/logs.tgz" logs $(ls runs/*/profile/profile.json 2>/dev/null))
}
for p in "60 --phase assets" "120 --phase full --settings full/ac_off" "100 --phase lora --settings lora/ac_off" \
  "100 --phase qlora --settings qlora/ac_off" "60 --phase estimate" "100 --phase full --settings full/ac_on" \
  "60 --phase tokens" "100 --phase lora --settings lora/ac_on" "150 --phase compile"; do phase $p; done  # by worth
if [ -f "$OUT/validation.json" ]; then "${V[@]}" --table > "$OUT/table.md" 2>&1; cat "$OUT/table.md"; fi
grep -E "^(===|SKIP|  [a-z])" "$OUT/run.log"
echo "total $(( $(date +%s) - T0 )) s"
