#!/usr/bin/env bash
# The first run on a node of 8 GPUs (scripts/device_ep8.py says what each step does):
#   bash scripts/device_ep8.sh --part 1     build; EP 2/4/8 bitwise and the failure tests (one device call)
#   bash scripts/device_ep8.sh --part 2     links, the layer at EP 8, Megatron end to end (another call)
#   bash scripts/device_ep8.sh --dry-run    on any machine: the steps, their time bounds, the files they need
# Logs and JSON under $OUT; a table prints last. Carry megatron_mok/_C*.so from part 1's $OUT into
# part 2 to skip its build; wheels in .whl/ (megatron-core) are installed first, as device_check.sh does.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-/tmp/mok_ep8}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off everywhere (the machines' rule; the code never asks for it).
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
PYTHON=${PYTHON:-python3}
case " $* " in
  *" --dry-run "*) ;;
  *)
    mkdir -p "$OUT"
    if [ -d .whl ]; then
      $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi;;
esac
exec $PYTHON scripts/device_ep8.py "$@"
