"""Functions that never return, in one place.

A call to one ends its block (tools/image/cfg.py): what follows it is not its
fall-through. ``KERNEL_NORETURN`` is what relayout's CFG uses for every image
(gcc marks them noreturn; objtool keeps a longer list); ``PROGRAM_NORETURN``
adds the C, C++ and unwinder runtime's, which verify reads too
(tools/verify/split.py); ``RUST_NORETURN`` matches the Rust runtime's in
their mangled names (legacy ``_ZN4core9panicking5panic17h..E`` and v0
``_RNvNtCs.._4core9panicking5panic`` alike).

In a program, relayout's CFG ends a function at a trailing indirect call
(rustc's and clang's ``call *f@GOTPCREL(%rip)``) when the call's link
relocation names one of these (``indirect_noreturn_calls``): the evidence is
the relocation's symbol, as the PLT or GOT slot the call goes through names
no function of the image.
"""

import re

import numpy as np

from .disasm import RAW, skip_prefixes

KERNEL_NORETURN = ("__stack_chk_fail", "panic", "do_exit", "do_group_exit", "make_task_dead",
                   "rewind_stack_and_make_dead", "__module_put_and_kthread_exit", "kthread_exit",
                   "machine_real_restart", "usercopy_abort", "BUG_func",
                   "__ubsan_handle_builtin_unreachable", "cpu_bringup_and_idle",
                   "ex_handler_msr_mce", "stop_this_cpu", "snp_abort", "sev_es_terminate",
                   "hlt_play_dead", "play_dead", "__reiserfs_panic", "fortify_panic",
                   "mpt_halt_firmware", "nmi_panic_self_stop", "panic_smp_self_stop",
                   "kunit_try_catch_throw", "xen_start_kernel", "lbug_with_loc",
                   "arch_call_rest_init", "cpu_startup_entry", "do_task_dead", "start_kernel",
                   "x86_64_start_kernel", "x86_64_start_reservations", "__invalid_creds",
                   "__x64_sys_exit", "__x64_sys_exit_group", "ignore_signals")

PROGRAM_NORETURN = ("abort", "exit", "_exit", "_Exit", "quick_exit", "__assert_fail",
                    "__assert_perror_fail", "__stack_chk_fail", "__fortify_fail",
                    "__chk_fail", "err", "errx", "verr", "verrx", "longjmp", "_longjmp",
                    "siglongjmp", "__longjmp_chk", "pthread_exit", "__cxa_throw",
                    "__cxa_rethrow", "__cxa_bad_cast", "__cxa_bad_typeid",
                    "_Unwind_Resume", "_ZSt9terminatev")

# what verify --against takes as noreturn call targets (kernel and program names)
VERIFY_NORETURN = tuple(dict.fromkeys(KERNEL_NORETURN + PROGRAM_NORETURN))

# the Rust runtime's functions that return ``!`` (core, alloc, std), by their path's
# last segments as both manglings spell them (<len><ident>)
RUST_NORETURN = re.compile(
    r"4core9panicking\d+(?:panic|assert_failed|unreachable|const_panic)"
    r"|4core(?:6option|6result)13(?:unwrap|expect)_failed"
    r"|4core(?:5slice5index|3str)\d+(?:slice_\w*fail|str_index_overflow_fail)"
    r"|4core4cell\d+panic_already_(?:mutably_)?borrowed"
    r"|5alloc7raw_vec\d+(?:handle_error|capacity_overflow)"
    r"|5alloc5alloc18handle_alloc_error"
    r"|3std7process(?:5abort|4exit)|3std5panic13resume_unwind|\d+len_mismatch_fail"
    r"|3std9panicking\d+(?:begin_panic|rust_panic)"
    r"|^(?:rust_panic|__rust_start_panic|rust_begin_unwind)$")


def is_program_noreturn(name):
    """True for a C, C++ or Rust runtime function that never returns (by its symbol name)."""
    if not name:
        return False
    base = name.split("@", 1)[0]
    return base in _PROGRAM_SET or RUST_NORETURN.search(base) is not None


_PROGRAM_SET = frozenset(PROGRAM_NORETURN)


def call_site_names(image, addr, size):
    """Per instruction (``addr``, ``size`` arrays): the name of the symbol a link
    relocation (--emit-relocs) inside it names, "" where none does."""
    addr = np.asarray(addr, np.uint64)
    end = addr + np.asarray(size, np.uint64)
    out = [""] * len(addr)
    if not len(addr):
        return out
    try:
        names, _ = image.symbol_table()
    except Exception:                   # noqa: BLE001 - stripped: no evidence
        return out
    order = np.argsort(addr, kind="stable")
    sa, se = addr[order], end[order]
    for r in image.relocations.values():
        if r.target is None or not r.target.is_code or not len(r):
            continue
        off = r.offset.astype(np.uint64)
        j = np.searchsorted(sa, off, side="right").astype(np.int64) - 1
        hit = (j >= 0) & (off < se[np.maximum(j, 0)])
        for k, sym in zip(j[hit].tolist(), r.sym[hit].tolist()):
            if sym < len(names):
                out[int(order[k])] = names[sym]
    return out


def indirect_noreturn_calls(image, dis):
    """Indices of the instructions of ``dis`` that are indirect calls whose link
    relocation names a function that never returns (``is_program_noreturn``)."""
    idx = np.nonzero(indirect_calls(dis, np.arange(len(dis))))[0]
    if not len(idx):
        return idx
    names = call_site_names(image, dis.addr[idx], dis.size[idx])
    return idx[np.array([is_program_noreturn(n) for n in names], bool)]


def indirect_calls(dis, idx):
    """True where instruction ``idx`` of ``dis`` is an indirect call (ff /2, ff /3)."""
    idx = np.asarray(idx, np.int64)
    if not len(idx):
        return np.zeros(0, bool)
    raw = dis.raw[idx]
    skip, op, op2 = skip_prefixes(raw, (0x2E, 0x3E, 0xF2, 0xF3))
    rex = (op >= 0x40) & (op <= 0x4F)
    op_r = np.where(rex, op2, op)
    modrm = np.where(rex, raw[np.arange(len(idx)), np.minimum(skip + 2, RAW - 1)], op2)
    reg = (modrm >> 3) & 7
    return (op_r == 0xFF) & ((reg == 2) | (reg == 3))
