"""Functions that never return, in one place.

A call to one ends its block (tools/image/cfg.py): what follows it is not its
fall-through. ``KERNEL_NORETURN`` is what relayout's CFG uses for every image
(gcc marks them noreturn; objtool keeps a longer list); ``PROGRAM_NORETURN``
adds the C, C++ and unwinder runtime's, which verify reads too
(tools/verify/split.py).
"""

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
