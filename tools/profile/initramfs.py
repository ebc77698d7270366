"""Deterministic initramfs images: a newc cpio writer (and reader) in plain Python.

The image packs a workload binary as ``/init`` plus optional extra files (e.g.
kernel modules under ``/lib/modules/...``). Same inputs give the same bytes:
entries sorted by path, every mtime 0, uid/gid 0, inode numbers assigned in
order, gzip header with mtime 0 and no file name. Built images are cached by
content hash under ``<cache>/initramfs/`` and written atomically.

    >>> path = build_initramfs("/path/to/vfs-mix")            # /init = vfs-mix
    >>> path = build_initramfs(init, extra_files={"lib/modules/x.ko": "/host/x.ko"})
"""

import gzip
import hashlib
import io
import os
import stat
from dataclasses import dataclass

from ..errors import BadInput
from ..io import write_atomic as _write_atomic

NEWC_MAGIC = b"070701"
TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class Entry:
    """One archive member. ``path`` has no leading slash; ``mode`` includes the type bits."""

    path: str
    mode: int
    data: bytes = b""
    rdevmajor: int = 0
    rdevminor: int = 0


def directory(path, perm=0o755):
    return Entry(_norm(path), stat.S_IFDIR | perm)


def regular(path, data, perm=0o755):
    return Entry(_norm(path), stat.S_IFREG | perm, bytes(data))


def chardev(path, major, minor, perm=0o600):
    return Entry(_norm(path), stat.S_IFCHR | perm, b"", major, minor)


def symlink(path, target):
    return Entry(_norm(path), stat.S_IFLNK | 0o777, target.encode())


def _norm(path):
    p = os.path.normpath("/" + str(path)).lstrip("/")
    if not p or p == ".":
        raise BadInput(f"initramfs: bad member path {path!r}")
    return p


def _pad4(n):
    return (4 - n % 4) % 4


def _with_parents(entries):
    """Entries plus any missing parent directories, sorted, duplicates rejected."""
    by_path = {}
    for e in entries:
        if e.path in by_path and by_path[e.path] != e:
            raise BadInput(f"initramfs: two different members named /{e.path}")
        by_path[e.path] = e
    for p in list(by_path):
        parent = os.path.dirname(p)
        while parent:
            by_path.setdefault(parent, directory(parent))
            if not stat.S_ISDIR(by_path[parent].mode):
                raise BadInput(f"initramfs: /{parent} is a parent directory and a file")
            parent = os.path.dirname(parent)
    # Sorting by path puts every directory before its contents.
    return [by_path[p] for p in sorted(by_path)]


def write_newc(entries):
    """The uncompressed newc cpio archive of ``entries`` (bytes)."""
    out = io.BytesIO()

    def header(ino, e, namesize, filesize):
        nlink = 2 if stat.S_ISDIR(e.mode) else 1
        fields = (ino, e.mode, 0, 0, nlink, 0, filesize, 0, 0, e.rdevmajor, e.rdevminor,
                  namesize, 0)
        return NEWC_MAGIC + b"".join(b"%08X" % f for f in fields)

    def member(ino, e, name):
        name_b = name.encode() + b"\0"
        h = header(ino, e, len(name_b), len(e.data))
        out.write(h + name_b + b"\0" * _pad4(len(h) + len(name_b)))
        out.write(e.data + b"\0" * _pad4(len(e.data)))

    for ino, e in enumerate(_with_parents(entries), start=1):
        member(ino, e, e.path)
    member(0, Entry(TRAILER, 0), TRAILER)
    return out.getvalue()


def parse_newc(data):
    """Members of a newc archive (gzip-compressed or not) as a list of Entry, in order."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    entries, off = [], 0
    while True:
        if data[off:off + 6] != NEWC_MAGIC:
            raise BadInput(f"initramfs: no newc header at offset {off}")
        f = [int(data[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        mode, filesize, rmaj, rmin, namesize = f[1], f[6], f[9], f[10], f[11]
        name_off = off + 110
        name = data[name_off:name_off + namesize - 1].decode()
        off = name_off + namesize
        off += _pad4(off)
        body = data[off:off + filesize]
        off += filesize
        off += _pad4(off)
        if name == TRAILER:
            return entries
        entries.append(Entry(name, mode, body, rmaj, rmin))


def gzip_bytes(raw, level=6):
    """gzip with a fixed header (mtime 0, no name): reproducible bytes."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=level, mtime=0) as gz:
        gz.write(raw)
    return buf.getvalue()


def base_entries():
    """What every image holds besides /init: /dev/console for the first stdio, mount points."""
    return [directory("dev"), chardev("dev/console", 5, 1), directory("proc"), directory("sys"),
            directory("tmp", 0o1777), directory("root", 0o700)]


def image_entries(init, extra_files=()):
    """Entries of a workload image: ``init`` (path or bytes) as /init plus ``extra_files``.

    ``extra_files`` is a mapping or iterable of (archive path, host path or bytes).
    """
    entries = base_entries()
    entries.append(regular("init", _content(init, "/init"), 0o755))
    items = extra_files.items() if hasattr(extra_files, "items") else extra_files
    for arc, src in items:
        perm = 0o755 if not isinstance(src, (bytes, bytearray)) and os.access(src, os.X_OK) else 0o644
        entries.append(regular(arc, _content(src, arc), perm))
    return entries


def _content(src, what):
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    try:
        with open(src, "rb") as f:
            return f.read()
    except OSError as e:
        raise BadInput(f"initramfs: cannot read {src} for {what}: {e.strerror}") from None


def write_atomic(dest, data):
    """linepack.io.write_atomic, creating the directory first (cache paths)."""
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    _write_atomic(dest, data)


def build_initramfs(init, extra_files=(), dest=None, cache=True):
    """Path of a gzip'd newc image with ``init`` as /init (built once per content).

    Without ``dest`` the image lands in ``<cache>/initramfs/<sha256>.cpio.gz`` and is
    reused when the same contents are asked for again.
    """
    raw = write_newc(image_entries(init, extra_files))
    if dest is None:
        from ..targets import cache_dir
        digest = hashlib.sha256(raw).hexdigest()[:24]
        dest = os.path.join(cache_dir(), "initramfs", f"{digest}.cpio.gz")
        if cache and os.path.exists(dest):
            return dest
    write_atomic(dest, gzip_bytes(raw))
    return dest


__all__ = ["Entry", "directory", "regular", "chardev", "symlink", "write_newc", "parse_newc",
           "gzip_bytes", "base_entries", "image_entries", "build_initramfs", "write_atomic"]
