"""The verify report: human one-screen summary and the machine JSON form."""

import json
import os

from ..io import write_atomic

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


class VerifyReport:
    def __init__(self, path, kernel_version=None):
        self.path = path
        self.kernel_version = kernel_version
        self.findings = []
        self.tables = {}
        self.static_keys = None
        self.functions = 0
        self.instructions = 0
        self.seconds = 0.0
        self.extra = {}
        self.context = None      # the ImageContext the checks ran on
        self.coverage = None     # {"sections": [...], "unexplained": [...], ...}

    @property
    def errors(self):
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self):
        return [f for f in self.findings if f.severity == "warning"]

    def ok(self, strict=False):
        return not self.errors and not (strict and self.warnings)

    def as_dict(self, strict=False):
        d = {
            "ok": self.ok(strict),
            "image": os.path.abspath(self.path),
            "kernel_version": self.kernel_version,
            "functions": self.functions,
            "instructions": self.instructions,
            "findings": [f.as_dict() for f in sorted(
                self.findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.check, f.address or 0))],
            "static_keys": self.static_keys,
            "tables": self.tables,
        }
        if self.coverage is not None:
            d["coverage"] = self.coverage
        d.update(self.extra)
        return d

    def write_json(self, dest, strict=False):
        text = json.dumps(self.as_dict(strict), indent=2, sort_keys=False) + "\n"
        if dest == "-":
            import sys
            sys.stdout.write(text)
        else:
            write_atomic(dest, text.encode())

    def summary(self, strict=False):
        lines = [f"image:    {self.path}"]
        if self.kernel_version:
            lines.append(f"kernel:   {self.kernel_version[:100]}")
        lines.append(f"code:     {self.functions} functions, {self.instructions} instructions decoded")
        if self.coverage is not None:
            lines.append(f"coverage: {'section':22s} {'bytes':>10s} {'decoded':>10s} {'padding':>10s} "
                         f"{'data':>6s} {'unexplained':>11s}")
            for r in self.coverage["sections"]:
                lines.append(f"          {r['section']:22s} {r['bytes']:10d} {r['decoded']:10d} "
                             f"{r['padding']:10d} {r['data']:6d} {r['unexplained']:11d}")
        if self.static_keys:
            s = self.static_keys
            lines.append(f"static keys: {s['total']} sites = {s['nop2']} nop2 + {s['nop5']} nop5 + "
                         f"{s['jmp8']} jmp8 + {s['jmp32']} jmp32; {s['illegal']} illegal, "
                         f"{s['improvable']} improvable")
        if self.tables:
            lines.append("tables:")
            for name, t in self.tables.items():
                lines.append(f"  {name:22s} {t['entries']:8d} entries  {'ok' if t['ok'] else 'FAIL'}")
        bi = self.extra.get("boot_image")
        if bi:
            rel = ", ".join(f"{n:,} {g}" for g, n in bi["relocations"].items())
            lines.append(f"boot image: {bi['path']}: {bi['compression']} payload, "
                         f"{bi['segments_compared']} segments compared; relocations {rel}")
        for k, v in self.extra.items():
            if isinstance(v, (str, int, float)):
                lines.append(f"{k}: {v}")
        shown = sorted(self.findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.check))
        if shown:
            lines.append(f"findings: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
            for f in shown[:25]:
                lines.append(f"  {f.severity}: [{f.check}] {f.message}")
            if len(shown) > 25:
                lines.append(f"  ... {len(shown) - 25} more (see --json)")
        verdict = "OK" if self.ok(strict) else "FAILED"
        lines.append(f"result:   {verdict} ({self.seconds:.1f} s)")
        return "\n".join(lines)
