"""LEB128, the variable-length integers of DWARF, .eh_frame and LSDAs: one codec.

Readers take (data, pos) and return (value, new pos); a value running past the
data raises ``exc("truncated <what>")``, so each format names itself in its own
error class (CfiError, EhFrameError, ...)."""


def read_uleb(data, pos, exc=IndexError, what="LEB128"):
    v = shift = 0
    n = len(data)
    while True:
        if pos >= n:
            raise exc(f"truncated {what}")
        b = data[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, pos


def read_sleb(data, pos, exc=IndexError, what="LEB128"):
    start = pos
    v, pos = read_uleb(data, pos, exc, what)
    bits = 7 * (pos - start)
    if v & (1 << (bits - 1)):
        v -= 1 << bits
    return v, pos


def uleb(v):
    """The shortest encoding of an unsigned ``v``."""
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def sleb(v):
    """The shortest encoding of a signed ``v``."""
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if (v == 0 and not b & 0x40) or (v == -1 and b & 0x40):
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def uleb_fixed(v, width, exc=ValueError):
    """``v`` as a uleb128 of exactly ``width`` bytes (non-minimal forms are valid),
    so a field can be rewritten in place."""
    out = bytearray()
    for i in range(width):
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if i < width - 1 else 0))
    if v:
        raise exc("value does not fit its uleb128 field")
    return bytes(out)
