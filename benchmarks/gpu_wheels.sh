#!/usr/bin/env bash
# Wheels for a GPU machine that has torch + CUDA but neither torchtune nor this project, and no registry.
#
#   benchmarks/gpu_wheels.sh [OUT_DIR=.whl] [PYTHON_VERSION=3.12]     # here, with the registry and .venv
#   # copy the repository (with .whl/) to the GPU machine, then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 benchmarks/validate_device.py --phase assets        # then the other phases, see --help
#
# Which: every distribution a recipe run, the validation and `adaptive-batching estimate` import in .venv, at the
# versions there, less torch and its own requirements (the GPU machine has them) and matplotlib (only the PNG
# needs it); binary wheels for CPython $PYTHON_VERSION on manylinux x86_64, this project's by `pip wheel`.
# bitsandbytes' wheel is slimmed to the CUDA versions in BNB_CUDA (below).
# SKIP (default "numpy pandas pyarrow", which `datasets` imports: 81 of 101 MB, and the GPU image has them):
# left out; SKIP="" brings them (over a 64 MiB transfer: carry pyarrow's wheel in a call of its own).
set -euo pipefail
SKIP=${SKIP-numpy pandas pyarrow}
OUT=${1:-.whl}; PYVER=${2:-3.12}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV_PY=${VENV_PY:-$ROOT/.venv/bin/python}
[ -x "$VENV_PY" ] || { echo "error: $VENV_PY not found: run 'make install' first (or set VENV_PY)" >&2; exit 2; }
mkdir -p "$OUT"

# name==version of every imported distribution but torch's own (one a line).
REQS=$("$VENV_PY" - <<'EOF'
import warnings; warnings.simplefilter("ignore")
import importlib, importlib.metadata as md, sys
for module in ("torchtune._cli.tune", "torchtune._cli.run", "torchtune._cli.download", "torchtune.datasets",
               "torchtune.models.llama3", "torchtune.models.llama3_2", "torchtune.training", "torchtune.modules.loss",
               "adaptive_batching.cli", "adaptive_batching.training.trainer", "adaptive_batching.estimate.prediction",
               "adaptive_batching.assets.models", "adaptive_full_finetune", "adaptive_lora_finetune",
               "safetensors.torch", "bitsandbytes.optim"):
    importlib.import_module(module)
torch_own = {"torch", "triton", "filelock", "typing-extensions", "typing_extensions", "sympy", "mpmath", "networkx",
             "jinja2", "markupsafe", "fsspec", "setuptools", "adaptive-batching", "adaptive_batching"}
names = md.packages_distributions()
found = {d for m in list(sys.modules) for d in names.get(m.split(".")[0], [])}
for dist in sorted(found, key=str.lower):
    if dist.lower() not in torch_own and not dist.lower().startswith("nvidia-"):
        print(f"{dist}=={md.version(dist)}")
EOF
)
echo "distributions: $(echo "$REQS" | tr '\n' ' ')"

# Binary wheels for the target interpreter; a pure-Python package with only an sdist is built here.
for req in $REQS; do
  name=${req%%==*}
  if [[ " $SKIP " == *" $name "* ]]; then echo "skipped: $req (SKIP)"; continue; fi
  if ! "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$OUT" "$req"; then
    echo "no binary wheel for $req: building it (pure Python only)" >&2
    "$VENV_PY" -m pip wheel -q --no-deps -w "$OUT" "$req"
  fi
done
"$VENV_PY" -m pip wheel -q --no-deps -w "$OUT" "$ROOT"

# bitsandbytes (the optimizer_in_bwd row's PagedAdamW8bit, stock torchtune's 1B config) ships a library for every
# CUDA and ROCm version: 43 of its MB. Keep those of BNB_CUDA (default 130 132: the GPU image's torch is cu130) and
# the CPU one: about 5 MB, so the set stays inside a 64 MiB transfer.
BNB_CUDA=${BNB_CUDA-130 132}
for wheel in "$OUT"/bitsandbytes-*.whl; do
  [ -e "$wheel" ] && [ -n "$BNB_CUDA" ] || continue
  "$VENV_PY" - "$wheel" $BNB_CUDA <<'PY'
import re, sys, zipfile
from pathlib import Path

wheel, keep = Path(sys.argv[1]), {f"libbitsandbytes_cuda{v}.so" for v in sys.argv[2:]}


def dropped(name: str) -> bool:
    return bool(re.fullmatch(r"bitsandbytes/libbitsandbytes_(cuda|rocm|xpu)\w*\.so", name)) and \
        name.split("/")[-1] not in keep


tmp = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
    for item in src.infolist():
        if dropped(item.filename):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):  # the files pip installs
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not dropped(line.split(b",")[0].decode()))
        out.writestr(item, data)
tmp.replace(wheel)
print(f"bitsandbytes: kept {sorted(keep)}: {wheel.stat().st_size / 1e6:.1f} MB")
PY
done

echo "wheels in $OUT:"; ls -1sh "$OUT"/*.whl; du -ch "$OUT"/*.whl | tail -1
[ -z "$SKIP" ] || echo "left out (SKIP, the GPU machine must have them): $SKIP; check there with" \
  "python3 -c 'import numpy, pandas, pyarrow; print(pyarrow.__version__)' (datasets needs pyarrow >= 24)"
