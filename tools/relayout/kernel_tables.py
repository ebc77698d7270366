"""Kernel tables after a relayout (placeholder until the table modules land)."""


def update_kernel_tables(rw, log):
    return {}
