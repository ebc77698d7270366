"""The command's start-up objects are frozen out of the cyclic collector (cli.py
freeze_startup_objects) before the verb runs; what the verb allocates is collected
as before."""

import subprocess
import sys


def test_startup_objects_frozen_before_the_verb_runs(tmp_path):
    code = (
        "import gc, sys\n"
        "from linepack import cli\n"
        "seen = {}\n"
        "def fake(args):\n"
        "    seen['frozen'] = gc.get_freeze_count()\n"
        "    class C: pass\n"
        "    a = C(); a.me = a                      # a cycle made by the command\n"
        "    import weakref; r = weakref.ref(a); del a\n"
        "    gc.collect()\n"
        "    seen['collected'] = r() is None\n"
        "    return 0\n"
        "rc = cli.main(['relayout', '/nonexistent', '-o', sys.argv[1]])  # imports the verb\n"
        "before = gc.get_freeze_count()\n"
        "gc.unfreeze()\n"
        "cli.VERBS['relayout'][1].run = staticmethod(fake)\n"
        "cli.main(['relayout', '/nonexistent', '-o', sys.argv[1]])\n"
        "print(rc, before, seen['frozen'], seen['collected'])\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rc, before, frozen, collected = p.stdout.split()
    assert rc != "0"                        # no such image: one line, its exit status
    assert int(before) > 10_000             # start-up: modules, numpy, the verb's module
    assert int(frozen) > 10_000
    assert collected == "True"
