"""The command's start-up objects are frozen out of the cyclic collector (cli.py
freeze_startup_objects) before the verb runs, once per process; what the verb
allocates is collected as before."""

import json
import subprocess
import sys


def test_startup_objects_frozen_once_before_the_verb_runs(tmp_path):
    code = (
        "import gc, sys, weakref\n"
        "from linepack import cli\n"
        "import linepack.commands.relayout\n"
        "seen = []\n"
        "def fake(args):\n"
        "    frozen = gc.get_freeze_count()\n"
        "    class C: pass\n"
        "    a = C(); a.me = a                      # a cycle made by the command\n"
        "    r = weakref.ref(a); del a\n"
        "    gc.collect()\n"
        "    seen.append((frozen, r() is None))\n"
        "    return 0\n"
        "cli.VERBS['relayout'][1].run = staticmethod(fake)\n"
        "argv = ['relayout', '/nonexistent', '-o', sys.argv[1]]\n"
        "assert cli.main(argv) == 0\n"
        "gc.unfreeze()\n"
        "assert cli.main(argv) == 0                # a second command in this process\n"
        "import json; print(json.dumps(seen))\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    first, second = json.loads(p.stdout)
    assert first[0] > 10_000                # start-up: modules, numpy, the verb's module
    assert first[1]                         # the command's cycle was collected
    assert second == [0, True]              # frozen once: the first command's objects not
