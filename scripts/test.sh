#!/usr/bin/env bash
# The test suite (after `bash scripts/install.sh --test`): every test file, split over one pytest
# process per core (at most 4; PDSERVE_TEST_SHARDS=N to choose) by scripts/test_shards.py, which
# prints each process's output and one total. With arguments: one pytest process over them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PDSERVE_TEST_CACHE=${PDSERVE_TEST_CACHE:-/tmp/pdserve-test-cache}
# the tree's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as in some images),
# every server process of the suite would otherwise compile pdserve's sources again at its start
python3 -m compileall -q -j 0 pdserve tests >/dev/null || true
if [ $# -gt 0 ]; then
  exec python3 -m pytest -q -p no:cacheprovider --timeout=900 --durations=40 "$@"
fi
exec python3 scripts/test_shards.py run
