#!/usr/bin/env bash
# The example tests (examples/**/test_*.py): torchtitan, transformers, accelerate and Lightning, each pinned, in a venv of
# their own (torchtitan's dependencies would downgrade fsspec in the main environment).
# Usage: bash dev/test_examples.sh [pytest args...]   (default: all of examples/)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HYPERDCP_EXAMPLES_VENV:-$PWD/.venvs/examples}"
PINS=(torch==2.13.0 torchtitan==0.3.0 transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 triton==3.9.0)  # torchtitan imports triton
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
# quiet and quick when the pins are already there
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --disable-pip-version-check "${PINS[@]}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "$#" -eq 0 ]; then set -- examples; fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
