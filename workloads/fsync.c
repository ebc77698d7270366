/*
 * fsync: small appends, each made durable with fsync(2), on ext4 on a virtio
 * disk (like a database log or a mail spool): ext4 block allocation, the jbd2
 * journal commit, writeback, blk-mq and the virtio-blk driver with its
 * completion interrupts.
 *
 * Usage: fsync [LOOPS [DIR]]   (env: loops=N, workdir=DIR). As PID 1 without a
 * directory it mounts env disk=DEV (fstype=ext4 by default) on /lp-disk.
 */
#include "linepack.h"

#define RECORD 100

int main(int argc, char **argv)
{
	const char *dir = (argc > 2 && getpid() != 1) ? argv[2] : getenv("workdir");
	uint64_t h = LP_FNV_INIT, t0, t1;
	char path[4096], rec[RECORD];
	struct stat st;
	long loops, i;
	int fd;

	lp_name = "fsync";
	lp_init_console();
	loops = lp_loops(argc, argv, 200);
	if (!dir || !*dir) {
		const char *disk = getenv("disk");

		if (getpid() != 1 || !disk || !*disk) {
			lp_say("linepack-error %s no directory (usage: fsync LOOPS DIR; as init: disk=DEV)",
			       lp_name);
			lp_finish(2);
		}
		dir = "/lp-disk";
		mkdir("/dev", 0755);
		if (access(disk, F_OK) < 0)
			mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
		if (mkdir(dir, 0755) < 0 && errno != EEXIST)
			lp_fail("mkdir /lp-disk");
		/* noinit_itable: no background inode-table zeroing thread */
		if (mount(disk, dir, getenv("fstype") ? getenv("fstype") : "ext4", 0, "noinit_itable") < 0)
			lp_fail("mount disk");
	}
	snprintf(path, sizeof(path), "%s/lp-fsync.log", dir);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
	if (fd < 0)
		lp_fail("open");
	if (fsync(fd) < 0)
		lp_fail("fsync");

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++) {
		ssize_t w;

		for (int k = 0; k < RECORD; k++)
			rec[k] = (char)('a' + (i + k) % 26);
		rec[RECORD - 1] = '\n';
		w = write(fd, rec, RECORD);
		if (w != RECORD)
			lp_fail("write");
		if (fsync(fd) < 0)
			lp_fail("fsync");
		h = lp_mix(h, (uint64_t)w);
	}
	t1 = lp_now_ns();
	lp_end();
	if (fstat(fd, &st) < 0)
		lp_fail("fstat");
	close(fd);
	/* Read the log back: what fsync made durable is what the checksum covers. */
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		lp_fail("open for reading");
	for (i = 0; i < loops; i++) {
		if (read(fd, rec, RECORD) != RECORD)
			lp_fail("read back");
		for (int k = 0; k < RECORD; k += 4)
			h = lp_mix(h, *(uint32_t *)(rec + k));
	}
	close(fd);
	unlink(path);
	lp_say("linepack-result %s loops=%ld size=%lld checksum=%016llx", lp_name, loops,
	       (long long)st.st_size, (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
