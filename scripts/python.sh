#!/usr/bin/env bash
# The Python package's checks (part of the test command): build the abi3
# wheel `hgca` with maturin into a fresh venv (.venv/py, from PyPI: maturin,
# numpy, pytest), install the wheel there, import it, run pytest over it
# (hgca-py/tests) and the engine-like example (examples/python).
#   scripts/python.sh          build, install, test
#   scripts/python.sh --wheel  build the wheel only (target/wheels/)
#   scripts/python.sh --deps   the venv and its packages only (gguf and numpy
#                              are also what scripts/gemma3_ref.py needs)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv/py
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.9,<2" "numpy>=1.21" "pytest>=7" "gguf>=0.10"
[ "${1:-}" = "--deps" ] && exit 0
rm -rf target/wheels
"$venv/bin/maturin" build --release --quiet -m hgca-py/Cargo.toml -o target/wheels -i "$venv/bin/python"
wheel=$(ls target/wheels/hgca-*.whl)
echo "wheel: $(basename "$wheel")"
case "$(basename "$wheel")" in
  *abi3*) ;;
  *) echo "the wheel is not abi3"; exit 1 ;;
esac
[ "${1:-}" = "--wheel" ] && exit 0
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"
# Import from the installed wheel, not the source tree.
(cd /tmp && "$OLDPWD/$venv/bin/python" -c "import hgca; print('hgca', hgca.__version__, 'from', hgca.__file__)")
"$venv/bin/python" -m pytest -q -s -p no:cacheprovider hgca-py/tests
"$venv/bin/python" examples/python/engine_decode.py --steps 8
