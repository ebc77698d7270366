/*
 * vfs-mix: the VFS/page-cache/mm syscall mix from DESIGN.md "Workloads".
 *
 * Per iteration, on tmpfs: creat, lstat, lseek to 4095, close,
 * open O_RDWR|O_CREAT|O_TRUNC, write 1 byte, mmap 4096 MAP_SHARED, touch the
 * page, munmap, close, unlink.
 *
 * Usage: vfs-mix [LOOPS [DIR]]   (env: loops=N, workdir=DIR)
 * As PID 1 without a directory it mounts a tmpfs on /lp-tmp and works there,
 * or, with env disk=DEV (fstype=ext4 by default), mounts DEV on /lp-disk
 * (first filling DEV from the file named by env disk_image, for RAM disks).
 */
#include <fcntl.h>
#include <sys/mman.h>
#include "linepack.h"

/* Copy a file onto a block device (a RAM disk starts empty). */
static void lp_copy_file(const char *from, const char *to)
{
	static char buf[1 << 16];
	int in = open(from, O_RDONLY), out = open(to, O_WRONLY);
	ssize_t n;

	if (in < 0 || out < 0)
		lp_fail("open disk image");
	while ((n = read(in, buf, sizeof(buf))) > 0)
		if (write(out, buf, n) != n)
			lp_fail("write disk image");
	if (n < 0 || fsync(out) < 0)
		lp_fail("copy disk image");
	close(in);
	close(out);
}

/* One iteration; returns the hash updated with this iteration's syscall results. */
static uint64_t vfs_mix_once(const char *path, long i, uint64_t h)
{
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
	return h;
}

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
		const char *disk = getenv("disk");    /* e.g. /dev/nvme0n1 holding ext4 */

		if (disk && *disk) {
			dir = "/lp-disk";
			mkdir("/dev", 0755);
			if (access(disk, F_OK) < 0)
				mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
			if (mkdir(dir, 0755) < 0 && errno != EEXIST)
				lp_fail("mkdir /lp-disk");
			if (getenv("disk_image"))
				lp_copy_file(getenv("disk_image"), disk);
			/* noinit_itable: no background inode-table zeroing thread */
			if (mount(disk, dir, getenv("fstype") ? getenv("fstype") : "ext4", 0,
				  "noinit_itable") < 0)
				lp_fail("mount disk");
		} else {
			dir = "/lp-tmp";
			if (mkdir(dir, 0755) < 0 && errno != EEXIST)
				lp_fail("mkdir /lp-tmp");
			if (mount("tmpfs", dir, "tmpfs", 0, "size=16m,mode=0755") < 0)
				lp_fail("mount tmpfs");
		}
	}
	if (snprintf(path, sizeof(path), "%s/lp-vfs-mix.dat", dir) >= (int)sizeof(path)) {
		errno = ENAMETOOLONG;
		lp_fail("path");
	}

	/*
	 * Warm-up iterations outside the measured loop (not hashed): on a disk
	 * file system the first iterations read metadata blocks, whose I/O
	 * completes at host-timed moments; afterwards the loop hits the cache and
	 * runs deterministically under -icount.
	 */
	for (i = 0; i < lp_env_long("warmup", 20); i++)
		(void)vfs_mix_once(path, i, 0);

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++)
		h = vfs_mix_once(path, i, h);
	t1 = lp_now_ns();
	lp_end();
	lp_say("linepack-result %s loops=%ld checksum=%016llx", lp_name, loops, (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
