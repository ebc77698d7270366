"""The ``linepack`` command: thin verbs over profile -> relayout -> verify -> evaluate.

Each verb parses its arguments, calls one function and prints. Expected
failures (LinepackError) become one line on stderr and a distinct exit status.
"""

import argparse
import os
import sys
import time

# numpy's OpenBLAS starts a thread pool when numpy is imported (about 0.04 s of CPU
# of every command here, a fifth of Python's and numpy's start); nothing linepack
# does calls BLAS (no float matrix products), so one thread (a user's setting wins).
# OpenBLAS reads the setting as numpy loads it; the programs linepack runs (profiled
# workloads, evaluate --program) get the environment as it was.
_SET_BLAS = "OPENBLAS_NUM_THREADS" not in os.environ
if _SET_BLAS:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
import numpy  # noqa: E402,F401  (loaded here for the setting above)
if _SET_BLAS:
    del os.environ["OPENBLAS_NUM_THREADS"]

from . import __version__, timings   # noqa: E402
from .errors import EXIT_USAGE, LinepackError   # noqa: E402
from .io import Interrupted, trap_signals   # noqa: E402

VERBS = {}
_IMPORTED = time.monotonic()


def wall_seconds():
    """Seconds since this process started (interpreter start-up and imports
    included): the time a user waited for the command."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def verb(name, help_text):
    """Register ``add_arguments(parser)`` / ``run(args)`` pair for a verb."""
    def wrap(cls):
        VERBS[name] = (help_text, cls)
        return cls
    return wrap


def _load_verbs(only=None):
    # Each module registers its verb(s) with @verb on import. A command line that names
    # its verb imports that verb's module alone: importing them all (evaluate's pull in
    # its tables and plots) cost each relayout or verify ~0.15 s of start-up.
    if only and not only.startswith("-"):
        import importlib
        import importlib.util
        mod = f"{__name__.rpartition('.')[0]}.commands.{only.replace('-', '_')}"
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            importlib.import_module(mod)
            if only in VERBS:
                return [only]
    from . import commands
    commands.load_all()
    return list(VERBS)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse's usage errors: one line, exit 2, like every other bad input.
        sys.stderr.write(f"linepack: error: {message} (see 'linepack {self.prog.split()[-1]} --help')\n"
                         if " " in self.prog else f"linepack: error: {message}\n")
        sys.exit(EXIT_USAGE)


def build_parser(verb_hint=None):
    """The parser of every verb, or of ``verb_hint`` alone when that is a verb."""
    names = _load_verbs(verb_hint)
    p = _Parser(prog="linepack", description="Post-link code layout for Linux kernels and "
                "x86-64 ELF binaries: profile -> relayout -> verify -> evaluate.")
    p.add_argument("--version", action="version", version=f"linepack {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for name in names:
        help_text, cls = VERBS[name]
        sp = sub.add_parser(name, help=help_text, description=help_text)
        cls.add_arguments(sp)
        sp.set_defaults(_run=cls.run)
    return p


def main(argv=None):
    from .native import tune_malloc
    tune_malloc()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    freeze_startup_objects()
    return run_handled(args._run, args)


_FROZEN = []


def freeze_startup_objects():
    """Move the objects start-up made (modules, functions, classes, numpy's and
    Capstone's tables: ~100,000, none of them garbage) out of the cyclic collector's
    generations (gc.freeze): its collections during the command then walk only what
    the command allocates, and a forked check (verify/forked.py) does not touch
    their pages (no copy on write). 0.04 s of wall time of a relayout or verify of
    zstd. What the command allocates afterwards is collected as before. Once per
    process: a later ``main`` in the same process (tests) freezes nothing more, so
    that a command's garbage is never kept."""
    if _FROZEN:
        return
    import gc
    gc.freeze()
    _FROZEN.append(True)


def run_handled(fn, args):
    """``fn(args)``'s exit status, every error as one line and its exit status."""
    try:
        # SIGINT/SIGTERM/SIGHUP become Interrupted: temp files are removed on the way out
        # and no declared output appears (tools/io.py, OutputSet).
        with trap_signals():
            try:
                return int(fn(args) or 0)
            finally:
                timings.print_table()
    except LinepackError as e:
        print(f"linepack: error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(f"linepack: interrupted by {e}; no output written", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("linepack: interrupted; no output written", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
