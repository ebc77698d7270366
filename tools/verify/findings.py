"""Where the checks of ``verify --against`` put what they find.

Every check names its problems through ``add_findings``: the full count goes to a
counter (the report's ``equivalence_counts``), the first MAX_REPORT become
findings. Each registered check writes into a Sink of its own; the sinks are
added to the report in the registry's order, so a check that ran early or in a
child process still lands where the list puts it.
"""

from ..kernel.base import Finding

MAX_REPORT = 20


def add_findings(findings, severity, check, items, describe, counter):
    """Count ``items`` under ``check`` and add a Finding for the first MAX_REPORT of
    them; ``describe(item)`` gives (address or None, message)."""
    counter[check] = counter.get(check, 0) + len(items)
    for it in items[:MAX_REPORT]:
        addr, msg = describe(it)
        findings.append(Finding(severity, check, addr, msg))
    if len(items) > MAX_REPORT:
        findings.append(Finding(severity, check, None, f"{len(items) - MAX_REPORT} more ({len(items)} in all)"))


class Sink:
    """Findings, counts per check and report extras of one check. Passes for a
    report where a check wants one (``.extra``)."""

    def __init__(self):
        self.findings, self.counter, self.extra = [], {}, {}

    def add(self, check, items, describe, severity="error"):
        add_findings(self.findings, severity, check, items, describe, self.counter)

    def add_to(self, report, counter):
        """Append to ``report`` (findings, extras) and ``counter`` (counts)."""
        report.findings.extend(self.findings)
        for k, v in self.counter.items():
            counter[k] = counter.get(k, 0) + v
        report.extra.update(self.extra)
