#!/usr/bin/env bash
# The test suite (after `bash scripts/install.sh --test`).
set -euo pipefail
cd "$(dirname "$0")/.."
export PDSERVE_TEST_CACHE=${PDSERVE_TEST_CACHE:-/tmp/pdserve-test-cache}
exec python3 -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=40 "$@"
