"""CI's skip gate: fail when pytest skipped a test whose reason is not allowed.

    python3 tests/skip_gate.py JUNIT_XML ALLOW_LIST

JUNIT_XML is pytest's --junitxml report. ALLOW_LIST (tests/allowed-skips.txt) holds one
allowed reason a line: a skip is allowed when its message contains one of them. Blank
lines and lines starting with '#' are ignored; each entry should say why, in a comment
above it. Prints every skip (allowed or not); exit 1 when any is not allowed.
(Not collected by pytest: the name does not start with test_.)
"""

import sys
import xml.etree.ElementTree as ET


def read_allow_list(path):
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def skipped_tests(junit_path):
    """[(test id, reason)] of every skipped test case in a JUnit XML report."""
    out = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        for sk in case.findall("skipped"):
            msg, text = sk.get("message") or "", (sk.text or "").strip()
            # a module-level skip's message is only "collection skipped"; its reason is in the text
            reason = f"{msg}: {text}" if msg and text and msg not in text else (msg or text)
            out.append((f"{case.get('classname')}::{case.get('name')}", reason))
    return out


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    allowed = read_allow_list(argv[2])
    bad = 0
    for test, reason in skipped_tests(argv[1]):
        ok = any(a in reason for a in allowed)
        bad += not ok
        print(f"skip-gate: {'allowed' if ok else 'NOT ALLOWED'}: {test}: {reason}", file=sys.stderr)
    if bad:
        print(f"skip-gate: {bad} test(s) skipped for a reason not in {argv[2]}; "
              "CI fails (make the test run here, or add the reason with a comment why)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
