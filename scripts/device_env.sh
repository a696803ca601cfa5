# Sourced by the GPU scripts (`. scripts/device_env.sh DEFAULT_OUT`): the repository root as the
# working directory; $OUT (DEFAULT_OUT unless set) made; flash_mla from the carried wheel (.whl/,
# scripts/fetch_gpu_wheel.sh) installed into /tmp/site unless it imports already (a failing
# install ends the script); PYTHONPATH to /tmp/site and this tree. `want "$@"`: whether step $STEP
# was asked for (no steps named: all).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$1}
mkdir -p "$OUT"
if ! PYTHONPATH=/tmp/site python3 -c "import flash_mla" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
want() { [ $# -eq 0 ] || [[ " $* " == *" $STEP "* ]]; }
