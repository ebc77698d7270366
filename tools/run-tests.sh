#!/usr/bin/env bash
# The test command: set up (idempotent), then run pytest. Arguments go to pytest unchanged
# (with no file or directory among them pytest runs tests/, setup.cfg's testpaths).
# The skip gate always runs on pytest's JUnit report: the run fails when a test was skipped
# for a reason not listed in tests/allowed-skips.txt. Exit status: pytest's, or 1 when the
# gate fails; 0 when pytest collected no tests (5) and the gate passed.
# LINEPACK_SKIP_SETUP=1 leaves out tools/setup.sh (tests/test_skip_gate.py runs this script so).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A first full run fills the cache (kernels, their -dbg packages, two kernel source trees:
# about 8 GB) and writes about 1.5 GB of test outputs at a time: say so up front when the
# disk is short, rather than let tests die of ENOSPC half-way.
cache="${LINEPACK_CACHE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/linepack}"
for d in "$cache" "${TMPDIR:-/tmp}"; do
  while [ ! -d "$d" ]; do d="$(dirname "$d")"; done
  free_kb="$(df -P -k "$d" 2>/dev/null | awk 'NR==2 {print $4}')"
  case "$free_kb" in ''|*[!0-9]*) continue ;; esac     # no answer: no warning, no stop
  free_gb=$(( free_kb / 1048576 ))
  if [ "$free_gb" -lt 12 ]; then
    echo "run-tests: warning: only $free_gb GB free on the disk of $d; a first full run needs about 12 GB (docs/testing.md)" >&2
  fi
done
if [ "${LINEPACK_SKIP_SETUP:-}" != 1 ]; then
  bash "$here/tools/setup.sh" || exit $?
fi
cd "$here"
junit="$(mktemp --suffix=.xml)"
trap 'rm -f "$junit"' EXIT
python3 -m pytest -q -ra --durations=25 --junitxml="$junit" "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "run-tests: pytest collected no tests" >&2
  rc=0
fi
if [ -s "$junit" ]; then
  python3 "$here/tests/skip_gate.py" "$junit" "$here/tests/allowed-skips.txt" || { [ $rc -eq 0 ] && rc=1; }
elif [ $rc -eq 0 ]; then
  echo "run-tests: pytest wrote no JUnit report, so the skip gate cannot run" >&2
  rc=1
fi
exit $rc
