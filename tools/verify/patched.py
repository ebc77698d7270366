"""An image with some bytes changed in memory: the mutation test's views
(verify/mutation.py), which the block check's C scan reads as it reads an ElfImage
(verify/blocks.py)."""

import numpy as np


class PatchedImage:
    """An ElfImage with some bytes changed in memory (copy-on-write per section)."""

    def __init__(self, base):
        self.base = base
        self._copies = {}

    def __getattr__(self, name):
        return getattr(self.base, name)

    def _buf(self, sec):
        if sec.index not in self._copies:
            self._copies[sec.index] = np.array(self.base.section_bytes(sec), dtype=np.uint8)
        return self._copies[sec.index]

    def copies(self):
        """{section index: its patched copy} (verify/blocks.py's C scan reads them)."""
        return dict(self._copies)

    def section_bytes(self, sec):
        if sec.index in self._copies:
            return self._copies[sec.index]
        return self.base.section_bytes(sec)

    def read(self, addr, size):
        s = self.base.section_at(addr)
        if s is None or s.index not in self._copies:
            return self.base.read(addr, size)
        if addr + size > s.end:
            raise ValueError(f"address {addr:#x}+{size} is not file-backed")
        off = addr - s.addr
        return self._copies[s.index][off:off + size]

    def view(self, addr, count, dtype):
        dtype = np.dtype(dtype)
        return self.read(addr, count * dtype.itemsize).view(dtype)

    def patch(self, addr, data):
        """Write bytes at addr; returns the token that undoes it."""
        s = self.base.section_at(addr)
        buf = self._buf(s)
        off = addr - s.addr
        old = bytes(buf[off:off + len(data)])
        buf[off:off + len(data)] = np.frombuffer(bytes(data), np.uint8)
        return addr, old

    def undo(self, token):
        addr, old = token
        s = self.base.section_at(addr)
        off = addr - s.addr
        self._copies[s.index][off:off + len(old)] = np.frombuffer(old, np.uint8)
