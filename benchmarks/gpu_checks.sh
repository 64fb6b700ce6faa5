#!/usr/bin/env bash
# The checks only a GPU runs, in one go (about 5 minutes on one H100), from the project root
# with the wheels of .whl/ beside it (README, "GPU tests and benchmark"): the `-m gpu` tests,
# the many-tensors snapshot benchmark on the device, and the in-process recovery kill case on
# NCCL. Each part's output goes to $OUT (default /tmp/flashckpt-gpu) as soon as it is
# measured. Processes a test or the launcher starts run outside the repository root, where
# the in-tree flashckpt/ would shadow the installed package.
set -u
ROOT=$PWD
OUT=${OUT:-/tmp/flashckpt-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
  > "$OUT/install.txt" 2>&1 || { tail -20 "$OUT/install.txt"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" \
  | tee -a "$OUT/gpu.txt"
export FLASHCKPT_SHM_DIR=/dev/shm/flashckpt-gpu-checks
echo "== pytest -m gpu"
(cd tests && timeout "${TESTS_S:-240}" python3 -P -m pytest -q -m gpu -p no:cacheprovider . \
  > "$OUT/pytest.txt" 2>&1)
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
rm -rf /dev/shm/flashckpt-gpu-checks /dev/shm/flashckpt-*
if [ -z "${SKIP_MANY:-}" ]; then
echo "== benchmarks/snapshot.py --case many-tensors --device cuda"
(cd benchmarks && timeout "${MANY_S:-150}" python3 snapshot.py --case many-tensors --device cuda \
  --rounds 3 > "$OUT/many.txt" 2>&1); echo "many rc=$?"
grep -vE "Warning|return func" "$OUT/many.txt" | tail -24
rm -rf /dev/shm/flashckpt-*
fi
echo "== benchmarks/recovery.py --nccl"
mkdir -p "$OUT/tmp"  # a failed or stopped run's node logs come back from here
(cd /tmp && TMPDIR="$OUT/tmp" timeout "${RECOVERY_S:-150}" python3 -P -u \
  "$ROOT/benchmarks/recovery.py" --nccl --rounds "${RECOVERY_ROUNDS:-2}" --baseline-timeout 0 \
  > "$OUT/recovery.txt" 2>&1)
echo "recovery rc=$?"; tail -8 "$OUT/recovery.txt"
for f in "$OUT"/tmp/*/*.log; do [ -f "$f" ] && { echo "-- $f"; tail -15 "$f"; }; done
