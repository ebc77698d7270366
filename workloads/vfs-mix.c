/*
 * vfs-mix: the VFS/page-cache/mm syscall mix from DESIGN.md "Workloads".
 *
 * Per iteration, on tmpfs: creat, lstat, lseek to 4095, close,
 * open O_RDWR|O_CREAT|O_TRUNC, write 1 byte, mmap 4096 MAP_SHARED, touch the
 * page, munmap, close, unlink.
 *
 * Usage: vfs-mix [LOOPS [DIR]]   (env: loops=N, workdir=DIR)
 * As PID 1 without a directory it mounts a tmpfs on /lp-tmp and works there.
 */
#include <fcntl.h>
#include <sys/mman.h>
#include "linepack.h"

int main(int argc, char **argv)
{
	const char *dir;
	char path[4096];
	uint64_t h = LP_FNV_INIT, t0, t1;
	long loops, i;

	lp_name = "vfs-mix";
	lp_init_console();
	loops = lp_loops(argc, argv, 2000);
	dir = (argc > 2 && getpid() != 1) ? argv[2] : getenv("workdir");
	if (!dir || !*dir) {
		if (getpid() != 1) {
			lp_say("linepack-error %s no directory given (usage: vfs-mix LOOPS DIR)", lp_name);
			lp_finish(2);
		}
		dir = "/lp-tmp";
		if (mkdir(dir, 0755) < 0 && errno != EEXIST)
			lp_fail("mkdir /lp-tmp");
		if (mount("tmpfs", dir, "tmpfs", 0, "size=16m,mode=0755") < 0)
			lp_fail("mount tmpfs");
	}
	if (snprintf(path, sizeof(path), "%s/lp-vfs-mix.dat", dir) >= (int)sizeof(path)) {
		errno = ENAMETOOLONG;
		lp_fail("path");
	}

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++) {
		struct stat st;
		int fd;
		off_t off;
		ssize_t w;
		char *p;

		fd = creat(path, 0644);
		if (fd < 0)
			lp_fail("creat");
		if (lstat(path, &st) < 0)
			lp_fail("lstat");
		h = lp_mix(h, (uint64_t)st.st_size);
		h = lp_mix(h, S_ISREG(st.st_mode));
		off = lseek(fd, 4095, SEEK_SET);
		if (off < 0)
			lp_fail("lseek");
		h = lp_mix(h, (uint64_t)off);
		if (close(fd) < 0)
			lp_fail("close");

		fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
		if (fd < 0)
			lp_fail("open");
		w = write(fd, "x", 1);
		if (w != 1)
			lp_fail("write");
		h = lp_mix(h, (uint64_t)w);
		p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p == MAP_FAILED)
			lp_fail("mmap");
		/* Touch: read the byte written, write the page's second byte. */
		h = lp_mix(h, (unsigned char)p[0]);
		h = lp_mix(h, (unsigned char)p[1]);
		p[1] = (char)i;
		if (munmap(p, 4096) < 0)
			lp_fail("munmap");
		if (close(fd) < 0)
			lp_fail("close");
		if (unlink(path) < 0)
			lp_fail("unlink");
	}
	t1 = lp_now_ns();
	lp_end();
	lp_say("linepack-result %s loops=%ld checksum=%016llx", lp_name, loops, (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
