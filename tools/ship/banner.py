"""What a vmlinux's ``linux_banner`` says about the build that made it.

Debian 6.1 cloud, for example::

    Linux version 6.1.0-56-cloud-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian
    12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 SMP
    PREEMPT_DYNAMIC Debian 6.1.192-2 (2026-11-16)

The boot image embeds the same strings (the bzImage header's kernel version), so
the build that makes it gets them back through kbuild's KBUILD_BUILD_* variables:
that also makes the bzImage byte-reproducible (no build date in it).
"""

import re
from dataclasses import dataclass

from ..errors import BadInput

# Words scripts/mkcompile_h puts between "#N" and the timestamp, from the config.
_CONFIG_FLAGS = ("SMP", "PREEMPT", "PREEMPT_DYNAMIC", "PREEMPT_RT")
_BANNER_RE = re.compile(r"^Linux version (?P<release>\S+) \((?P<user>[^@()\s]+)@(?P<host>[^)\s]+)\) "
                        r"\(.*\) #(?P<number>\S+) (?P<rest>.*)$")


@dataclass(frozen=True)
class BuildInfo:
    release: str            # uname -r: 6.1.0-56-cloud-amd64
    version: tuple          # (6, 1, 192) when the banner names an upstream version
    user: str
    host: str
    number: str             # the "#1" build number
    timestamp: str          # what follows the config flags: "Debian 6.1.192-2 (2026-11-16)"
    debian_version: "str | None"   # "6.1.192-2" for a Debian build

    def kbuild_env(self):
        """KBUILD_BUILD_* values that make kbuild write this build's strings again."""
        return {"KBUILD_BUILD_USER": self.user, "KBUILD_BUILD_HOST": self.host,
                "KBUILD_BUILD_VERSION": self.number, "KBUILD_BUILD_TIMESTAMP": self.timestamp}


def parse_banner(text, path="vmlinux"):
    """BuildInfo of a ``Linux version ...`` banner; BadInput when it is not one."""
    m = _BANNER_RE.match((text or "").strip())
    if not m:
        raise BadInput(f"{path}: no Linux version banner (linux_banner): not a kernel vmlinux")
    words = m.group("rest").split()
    while words and words[0] in _CONFIG_FLAGS:
        words.pop(0)
    timestamp = " ".join(words)
    deb = re.match(r"Debian (\d+\.\d+\.\d+-\S+)", timestamp)
    debian_version = deb.group(1) if deb else None
    up = re.match(r"(\d+)\.(\d+)\.(\d+)", debian_version or "") or \
        re.match(r"(\d+)\.(\d+)\.(\d+)", m.group("release"))
    version = tuple(int(x) for x in up.groups()) if up else None
    return BuildInfo(release=m.group("release"), version=version, user=m.group("user"),
                     host=m.group("host"), number=m.group("number"), timestamp=timestamp,
                     debian_version=debian_version)


def build_info(image):
    """BuildInfo of an ElfImage (a kernel vmlinux)."""
    from ..kernel.base import kernel_version_of
    _, banner = kernel_version_of(image)
    return parse_banner(banner, image.path)
