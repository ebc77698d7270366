/*
 * dirwalk: a directory tree walk like `find -ls` or `du`. Set-up (outside the
 * measured loop) builds a tree of 3,000 files in 60 directories (2 levels) on
 * tmpfs; each iteration walks the whole tree with getdents64 and fstatat on
 * every entry: dcache lookups, readdir, stat, path walking.
 *
 * Usage: dirwalk [LOOPS [DIR]]   (env: loops=N, workdir=DIR; as PID 1 a tmpfs
 * is mounted on /lp-walk when no workdir is given)
 */
#include "linepack.h"
#include <dirent.h>

#define TOP 6
#define SUB 10
#define FILES 50

static char root[4096];

struct linux_dirent64 {
	uint64_t d_ino;
	int64_t d_off;
	unsigned short d_reclen;
	unsigned char d_type;
	char d_name[];
};

/* Walk dirfd's tree; add what the kernel said (names, sizes, modes, link counts). */
static void walk(int dfd, int depth, uint64_t *entries, uint64_t *sum)
{
	char buf[8192];
	long n;

	while ((n = syscall(SYS_getdents64, dfd, buf, sizeof(buf))) > 0) {
		for (long off = 0; off < n;) {
			struct linux_dirent64 *d = (struct linux_dirent64 *)(buf + off);
			struct stat st;

			off += d->d_reclen;
			if (!strcmp(d->d_name, ".") || !strcmp(d->d_name, ".."))
				continue;
			if (fstatat(dfd, d->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
				lp_fail("fstatat");
			++*entries;
			/* order-independent: readdir order belongs to the file system;
			 * sizes of regular files only (a directory's differs by fs) */
			*sum += (uint64_t)(S_ISREG(st.st_mode) ? st.st_size : 0) * 1000003u + (uint64_t)st.st_mode * 31u + st.st_nlink
				+ (uint64_t)strlen(d->d_name) * 7919u + (uint64_t)(unsigned char)d->d_name[0];
			if (S_ISDIR(st.st_mode) && depth < 4) {
				int sub = openat(dfd, d->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

				if (sub < 0)
					lp_fail("openat dir");
				walk(sub, depth + 1, entries, sum);
				close(sub);
			}
		}
	}
	if (n < 0)
		lp_fail("getdents64");
}

static void build_tree(void)
{
	char path[4200];

	snprintf(path, sizeof(path), "%s/tree", root);
	if (mkdir(path, 0755) < 0)
		lp_fail("mkdir tree");
	for (int a = 0; a < TOP; a++) {
		snprintf(path, sizeof(path), "%s/tree/d%d", root, a);
		if (mkdir(path, 0755) < 0)
			lp_fail("mkdir");
		for (int b = 0; b < SUB; b++) {
			snprintf(path, sizeof(path), "%s/tree/d%d/s%02d", root, a, b);
			if (mkdir(path, 0755) < 0)
				lp_fail("mkdir");
			for (int f = 0; f < FILES; f++) {
				int fd, len = (a * 7 + b * 13 + f * 17) % 200;
				char data[200];

				snprintf(path, sizeof(path), "%s/tree/d%d/s%02d/file-%03d.dat", root, a, b, f);
				fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
				if (fd < 0)
					lp_fail("create");
				memset(data, 'a' + f % 26, sizeof(data));
				if (write(fd, data, len) != len)
					lp_fail("write");
				close(fd);
			}
		}
	}
}

static void remove_tree(void)
{
	char path[4200];

	for (int a = 0; a < TOP; a++) {
		for (int b = 0; b < SUB; b++) {
			for (int f = 0; f < FILES; f++) {
				snprintf(path, sizeof(path), "%s/tree/d%d/s%02d/file-%03d.dat", root, a, b, f);
				unlink(path);
			}
			snprintf(path, sizeof(path), "%s/tree/d%d/s%02d", root, a, b);
			rmdir(path);
		}
		snprintf(path, sizeof(path), "%s/tree/d%d", root, a);
		rmdir(path);
	}
	snprintf(path, sizeof(path), "%s/tree", root);
	rmdir(path);
}

int main(int argc, char **argv)
{
	uint64_t entries = 0, sum = 0, t0, t1;
	const char *dir = (argc > 2 && getpid() != 1) ? argv[2] : getenv("workdir");
	char path[4200];
	long loops, i;

	lp_name = "dirwalk";
	lp_init_console();
	loops = lp_loops(argc, argv, 20);
	if (!dir || !*dir) {
		if (getpid() != 1) {
			lp_say("linepack-error %s no directory (usage: dirwalk LOOPS DIR)", lp_name);
			lp_finish(2);
		}
		dir = "/lp-walk";
		mkdir(dir, 0755);
		if (mount("tmpfs", dir, "tmpfs", 0, "size=64m") < 0)
			lp_fail("mount tmpfs");
	}
	snprintf(root, sizeof(root), "%s", dir);
	build_tree();
	snprintf(path, sizeof(path), "%s/tree", root);

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++) {
		int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

		if (dfd < 0)
			lp_fail("open tree");
		walk(dfd, 0, &entries, &sum);
		close(dfd);
	}
	t1 = lp_now_ns();
	lp_end();
	remove_tree();
	lp_say("linepack-result %s loops=%ld entries=%llu checksum=%016llx", lp_name, loops,
	       (unsigned long long)entries, (unsigned long long)sum);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
