# SPDX-License-Identifier: GPL-2.0
# linepack's kbuild hook: runs linepack on vmlinux inside the kernel build,
# after the final link and before the architecture's post-link step.
#
# Since Linux 6.5 x86's post-link step (arch/x86/Makefile.postlink) writes
# vmlinux.relocs from vmlinux's link relocations and then strips them from
# vmlinux. linepack needs those relocations to move code, so it must run
# between the two: kbuild calls ARCH_POSTLINK (`$(MAKE) -f $(ARCH_POSTLINK)
# vmlinux`) right after scripts/link-vmlinux.sh, and a command-line
# ARCH_POSTLINK replaces the architecture's file. This file does linepack's
# part and then hands over to the architecture's own Makefile.postlink, so the
# build's vmlinux.relocs, bzImage and everything after them see the optimized
# vmlinux. Use (`linepack kbuild --print-hook` prints this file's path):
#
#   make O=BUILD ARCH_POSTLINK=/path/linepack-postlink.mk \
#        LINEPACK_PROFILE=/path/profile [LINEPACK_STRATEGY=pack] bzImage modules
#
# Variables (make command line or environment):
#   LINEPACK_PROFILE   the profile (of this very build: profiles match by
#                      build-id); unset: nothing is rewritten, only the
#                      unstripped copy below is kept (to profile and verify)
#   LINEPACK_STRATEGY  relayout strategy (default: pack)
#   LINEPACK           the linepack command (default: linepack)
#   LINEPACK_FLAGS     extra relayout arguments
#
# Files it writes in the object tree, next to vmlinux:
#   vmlinux.linepack-orig      the link's own vmlinux, relocations kept (input
#                              of relayout and of `linepack verify --against`)
#   vmlinux.linepack           relayout's output, relocations kept (vmlinux is a
#                              copy, stripped by the architecture's step)
#   vmlinux.linepack-layout.tsv, vmlinux.linepack.json   relayout's map and report
#   System.map                 rewritten for the new addresses (link-vmlinux.sh
#                              wrote it before this step)
# A relayout failure fails the build (no silent fallback to the stock layout).
# Relinking after a change of profile: delete vmlinux (kbuild relinks when the
# link command, which names ARCH_POSTLINK, changes, not when the profile does).

PHONY := __linepack_postlink
__linepack_postlink:

LINEPACK ?= linepack
LINEPACK_STRATEGY ?= pack
LINEPACK_ARCH_POSTLINK ?= $(wildcard $(srctree)/arch/$(SRCARCH)/Makefile.postlink)

vmlinux: FORCE
	@echo '  LINEPACK $@.linepack-orig'
	rm -f $@.linepack $@.linepack-layout.tsv $@.linepack.json
	cp -f $@ $@.linepack-orig.tmp && mv -f $@.linepack-orig.tmp $@.linepack-orig
ifneq ($(LINEPACK_PROFILE),)
	@echo '  LINEPACK $@ ($(LINEPACK_STRATEGY), profile $(LINEPACK_PROFILE))'
	$(LINEPACK) relayout $@.linepack-orig --profile $(LINEPACK_PROFILE) \
		--strategy $(LINEPACK_STRATEGY) -o $@.linepack \
		--layout-map $@.linepack-layout.tsv --system-map System.map \
		--json $@.linepack.json $(LINEPACK_FLAGS)
	cp -f $@.linepack $@.linepack-tmp && mv -f $@.linepack-tmp $@
endif
ifneq ($(LINEPACK_ARCH_POSTLINK),)
	$(MAKE) -f $(LINEPACK_ARCH_POSTLINK) $@
endif

%.ko: FORCE
ifneq ($(LINEPACK_ARCH_POSTLINK),)
	$(MAKE) -f $(LINEPACK_ARCH_POSTLINK) $@
endif

clean:
	rm -f vmlinux.linepack-orig vmlinux.linepack-orig.tmp vmlinux.linepack vmlinux.linepack-tmp \
		vmlinux.linepack-layout.tsv vmlinux.linepack.json
ifneq ($(LINEPACK_ARCH_POSTLINK),)
	$(MAKE) -f $(LINEPACK_ARCH_POSTLINK) clean
endif

PHONY += FORCE clean
FORCE:

.PHONY: $(PHONY)
