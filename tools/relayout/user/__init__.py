"""Userspace-only parts of relayout (the UserTarget of relayout/target.py): PIE
and PIC switch tables, .eh_frame/.eh_frame_hdr, CFI and LSDAs of split functions,
.dynsym, the CFG's jump-table leaders."""
