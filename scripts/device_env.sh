# Sourced by the device scripts: $OUT (the device tool's output folder; ./device-out
# elsewhere), and the carried wheels (.whl/, ../shared/tools/device-wheels.sh) installed to
# /tmp/site and put on PYTHONPATH with this checkout.
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
