/*
 * vdso: getcpu and clock_gettime through the vDSO, in a loop.
 *
 * glibc's sched_getcpu() reads the rseq area since 2.35 and never enters the
 * vDSO, so the vDSO's own __vdso_getcpu / __vdso_clock_gettime are looked up
 * in the image the kernel maps (AT_SYSINFO_EHDR) and called directly. When the
 * clocksource cannot be read from user space (e.g. some QEMU set-ups) the
 * vDSO itself falls back to the clock_gettime syscall.
 *
 * The result line holds only counts and invariants (calls that succeeded,
 * clock going backwards never), never times or CPU numbers.
 *
 * Usage: vdso [LOOPS]   (env: loops=N)
 */
#include <elf.h>
#include <sys/auxv.h>
#include <sys/syscall.h>
#include "linepack.h"

typedef long (*getcpu_fn)(unsigned *cpu, unsigned *node, void *cache);
typedef int (*clock_gettime_fn)(clockid_t clk, struct timespec *ts);

/* Minimal vDSO symbol lookup through PT_DYNAMIC (DT_HASH/DT_GNU_HASH). */
static void *vdso_sym(const char *want)
{
	uintptr_t base = getauxval(AT_SYSINFO_EHDR);
	const Elf64_Ehdr *eh = (const Elf64_Ehdr *)base;
	const Elf64_Phdr *ph;
	const Elf64_Dyn *dyn = NULL;
	const Elf64_Sym *sym = NULL;
	const char *str = NULL;
	const uint32_t *hash = NULL, *gnu = NULL;
	uintptr_t load = 0;
	int have_load = 0;
	uint32_t nsym = 0;

	if (!base || memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0)
		return NULL;
	ph = (const Elf64_Phdr *)(base + eh->e_phoff);
	for (int i = 0; i < eh->e_phnum; i++) {
		if (ph[i].p_type == PT_LOAD && !have_load) {
			load = base + ph[i].p_offset - ph[i].p_vaddr;
			have_load = 1;
		} else if (ph[i].p_type == PT_DYNAMIC) {
			dyn = (const Elf64_Dyn *)(base + ph[i].p_offset);
		}
	}
	if (!have_load || !dyn)
		return NULL;
	for (; dyn->d_tag != DT_NULL; dyn++) {
		switch (dyn->d_tag) {
		case DT_SYMTAB: sym = (const Elf64_Sym *)(load + dyn->d_un.d_ptr); break;
		case DT_STRTAB: str = (const char *)(load + dyn->d_un.d_ptr); break;
		case DT_HASH: hash = (const uint32_t *)(load + dyn->d_un.d_ptr); break;
		case DT_GNU_HASH: gnu = (const uint32_t *)(load + dyn->d_un.d_ptr); break;
		}
	}
	if (!sym || !str)
		return NULL;
	if (hash) {
		nsym = hash[1];
	} else if (gnu) {
		/* Count symbols: highest bucket start, then walk its chain. */
		uint32_t nbuckets = gnu[0], symoff = gnu[1], bloom = gnu[2];
		const uint32_t *buckets = gnu + 4 + bloom * 2;
		const uint32_t *chain = buckets + nbuckets;
		uint32_t last = 0;

		for (uint32_t b = 0; b < nbuckets; b++)
			if (buckets[b] > last)
				last = buckets[b];
		if (last >= symoff)
			while (!(chain[last - symoff] & 1))
				last++;
		nsym = last + 1;
	}
	for (uint32_t i = 0; i < nsym; i++) {
		if (ELF64_ST_TYPE(sym[i].st_info) != STT_FUNC || sym[i].st_shndx == SHN_UNDEF)
			continue;
		if (strcmp(str + sym[i].st_name, want) == 0)
			return (void *)(load + sym[i].st_value);
	}
	return NULL;
}

static long sys_getcpu(unsigned *cpu, unsigned *node, void *cache)
{
	return syscall(SYS_getcpu, cpu, node, cache);
}

int main(int argc, char **argv)
{
	getcpu_fn getcpu_p;
	clock_gettime_fn cgt_p;
	long loops, i, ok_cpu = 0, ok_mono = 0, ok_real = 0, backwards = 0;
	struct timespec prev = {0, 0};
	uint64_t t0, t1;
	int via_vdso;

	lp_name = "vdso";
	lp_init_console();
	loops = lp_loops(argc, argv, 50000);
	getcpu_p = (getcpu_fn)vdso_sym("__vdso_getcpu");
	cgt_p = (clock_gettime_fn)vdso_sym("__vdso_clock_gettime");
	via_vdso = getcpu_p && cgt_p;
	if (!getcpu_p)
		getcpu_p = sys_getcpu;
	if (!cgt_p)
		cgt_p = clock_gettime;

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++) {
		unsigned cpu = ~0u, node = ~0u;
		struct timespec ts;

		if (getcpu_p(&cpu, &node, NULL) == 0 && cpu != ~0u)
			ok_cpu++;
		if (cgt_p(CLOCK_MONOTONIC, &ts) == 0) {
			ok_mono++;
			if (ts.tv_sec < prev.tv_sec ||
			    (ts.tv_sec == prev.tv_sec && ts.tv_nsec < prev.tv_nsec))
				backwards++;
			prev = ts;
		}
		if (cgt_p(CLOCK_REALTIME, &ts) == 0)
			ok_real++;
	}
	t1 = lp_now_ns();
	lp_end();
	lp_say("linepack-result %s loops=%ld getcpu=%ld monotonic=%ld realtime=%ld backwards=%ld",
	       lp_name, loops, ok_cpu, ok_mono, ok_real, backwards);
	lp_say("linepack-info %s vdso=%s elapsed_ns=%llu", lp_name, via_vdso ? "yes" : "no",
	       (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
