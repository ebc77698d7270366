/*
 * slab-bulk: drives the linepack_slab_bulk kernel module (workloads/modules/
 * slab_bulk, loaded by /init from /lib/modules): each iteration is one write
 * to /proc/linepack_slab_bulk, i.e. one round of kmem_cache_alloc_bulk /
 * kmem_cache_free_bulk over bulk sizes 1, 8, 32 and 128. The result line holds
 * the module's own counts (rounds, objects, failures).
 *
 * Usage: slab-bulk [LOOPS]   (env: loops=N); needs the module loaded.
 */
#include "linepack.h"

#define PROC_FILE "/proc/linepack_slab_bulk"

int main(int argc, char **argv)
{
	uint64_t t0, t1;
	char text[128];
	long loops, i;
	ssize_t n;
	int fd;

	lp_name = "slab-bulk";
	lp_init_console();
	loops = lp_loops(argc, argv, 2000);
	if (access(PROC_FILE, F_OK) < 0) {
		mkdir("/proc", 0555);
		mount("proc", "/proc", "proc", 0, NULL);
	}
	fd = open(PROC_FILE, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		lp_fail("open " PROC_FILE " (is linepack_slab_bulk.ko loaded?)");

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++)
		if (pwrite(fd, "1", 1, 0) != 1)
			lp_fail("write " PROC_FILE);
	t1 = lp_now_ns();
	lp_end();
	n = pread(fd, text, sizeof(text) - 1, 0);
	if (n <= 0)
		lp_fail("read " PROC_FILE);
	text[n] = 0;
	text[strcspn(text, "\n")] = 0;
	close(fd);
	lp_say("linepack-result %s loops=%ld %s", lp_name, loops, text);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
