"""Phase timings for the long verbs (relayout, verify): ``LINEPACK_TIMINGS=1``.

Code marks where a phase starts (``phase("name")``); at exit the command
prints one table on stderr: per phase the wall time, the CPU time (this process
plus waited-for children such as the disassembler's fork pool), the peak
RSS reached by its end and the RSS left at its end. Off by default: ``phase`` then costs one test.
"""

import os
import resource
import sys
import time

_ENABLED = os.environ.get("LINEPACK_TIMINGS", "") not in ("", "0")
_rows = []          # [name, wall0, cpu0]
_ends = []          # [(wall, cpu, maxrss MiB)] at each phase's end


def enabled():
    return _ENABLED


def _cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _now_rss_mib():
    """Resident set now (what a phase leaves behind for the next), from /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1048576.0
    except (OSError, ValueError, IndexError):
        return 0.0


def phase(name):
    """End the current phase and start ``name``."""
    if not _ENABLED:
        return
    now, cpu = time.monotonic(), _cpu()
    if _rows:
        _ends.append((now, cpu, _rss_mib(), _now_rss_mib()))
    _rows.append((name, now, cpu))


def table():
    """The phase table (text), or '' when off or nothing was marked."""
    if not _ENABLED or not _rows:
        return ""
    ends = _ends + [(time.monotonic(), _cpu(), _rss_mib(), _now_rss_mib())][
        :len(_rows) - len(_ends)]
    lines = [f"{'phase':<34} {'wall s':>8} {'cpu s':>8} {'peak MiB':>9} {'at end':>7}"]
    tw = tc = 0.0
    for (name, w0, c0), (w1, c1, rss, now_rss) in zip(_rows, ends):
        tw += w1 - w0
        tc += c1 - c0
        lines.append(f"{name[:34]:<34} {w1 - w0:>8.2f} {c1 - c0:>8.2f} {rss:>9.0f} "
                     f"{now_rss:>7.0f}")
    lines.append(f"{'total':<34} {tw:>8.2f} {tc:>8.2f} {_rss_mib():>9.0f}")
    return "\n".join(lines)


def print_table(stream=None):
    t = table()
    if t:
        print("linepack timings:\n" + t, file=stream or sys.stderr, flush=True)
