#!/usr/bin/env bash
# The test command: set up (idempotent), then run pytest. Extra args go to pytest.
# Fails when a test is skipped for a reason not listed in tests/allowed-skips.txt.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/tools/setup.sh" || exit $?
cd "$here"
junit="$(mktemp --suffix=.xml)"
trap 'rm -f "$junit"' EXIT
# Tests marked kbuild build a whole kernel (README "Kernels that strip their relocations"):
# deselected here, run by: LINEPACK_KBUILD=1 bash tools/run-tests.sh -m kbuild (a later -m wins)
python3 -m pytest -q -ra --junitxml="$junit" -m "not kbuild" "$@" tests
rc=$?
if [ $rc -eq 5 ]; then echo "run-tests: pytest collected no tests" >&2; exit 0; fi
if [ -s "$junit" ]; then
  python3 tests/skip_gate.py "$junit" tests/allowed-skips.txt || { [ $rc -eq 0 ] && rc=1; }
fi
exit $rc
