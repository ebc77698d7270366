#!/usr/bin/env bash
# The test command: set up (idempotent), then run pytest. Extra args go to pytest.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/tools/setup.sh" || exit $?
cd "$here"
python3 -m pytest -q -ra "$@" tests
rc=$?
if [ $rc -eq 5 ]; then echo "run-tests: pytest collected no tests" >&2; exit 0; fi
exit $rc
