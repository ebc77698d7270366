"""The default profile source: boot the kernel under QEMU TCG with linepack's
plugin, run a workload as /init, and turn the per-block counts into a Profile.

Glue only: the runner (qemu.py), the plugin (plugin/ + plugin_build.py), its
reader (trace.py) and the model (model.py) do the work.
"""

import os

from ..errors import BadInput
from ..image.elf import ElfImage
from . import trace, workloads
from .model import Profile


def run_traced(kernel, workload="vfs-mix", loops=None, cache=None, edges=True, roi=True,
               icount=True, log=None, timeout=1800):
    """Boot ``kernel`` with ``workload`` under the plugin; returns (PluginTrace, QemuResult).

    roi=True restricts counting to the workload's measured loop (between its
    linepack_roi_begin/end markers); boot and shutdown are then left out.
    """
    from .runner import SYSTEM, Plugin, QemuJob, run_job
    start = stop = None
    if roi:
        try:
            start, stop = workloads.roi_addresses(workload)
        except BadInput:
            start = stop = None       # workload without markers: whole run
    if log:
        log(f"booting {os.path.basename(kernel)} with {workload} under QEMU TCG + plugin")
    cfg = trace.cache_config(cache) if isinstance(cache, str) else cache
    res = run_job(QemuJob(SYSTEM, kernel, [Plugin(cache=cfg, edges=edges, start=start, stop=stop)],
                          workload=workload, loops=loops, icount=icount, timeout=timeout))
    return res.traces[0], res


def _kernel_command_line(command):
    """The guest kernel's command line (QEMU's -append value) of a run."""
    return command[command.index("-append") + 1] if "-append" in command else ""


def record_qemu(kernel, workload="vfs-mix", loops=None, output=None, meta=None, log=None):
    """Profile ``kernel`` running ``workload``; returns the Profile (saved to output if given)."""
    image = ElfImage(kernel)
    tr, res = run_traced(kernel, workload=workload, loops=loops, edges=True, log=log)
    wl = workloads.load(workload)
    loops = wl.default_loops if loops is None else int(loops)
    m = dict(meta or {})
    m.update({"workload": workload, "loops": loops, "result_line": res.result_line,
              "command_line": _kernel_command_line(res.command),
              "roi": bool(tr.roi.get("started")) if tr.roi else False})
    # No wall time in the metadata: the same run must give the same profile bytes.
    if log:
        log(f"{tr.kernel_instructions:,} kernel instructions in {len(tr.tb_addr):,} blocks; "
            f"{len(tr.edge_src):,} edges ({res.wall:.1f} s)")
    prof = Profile.from_blocks(image, tr.tb_addr, tr.tb_size, tr.tb_insns, tr.tb_execs,
                               edge_src=tr.edge_src if tr.edges_recorded else None,
                               edge_dst=tr.edge_dst if tr.edges_recorded else None,
                               edge_count=tr.edge_count if tr.edges_recorded else None,
                               meta=m, block_first=tr.tb_first)
    if output:
        prof.save(output)
    return prof
