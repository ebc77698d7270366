/*
 * Shared helpers for linepack workloads.
 *
 * Every workload is one static binary that runs either natively
 * (`./vfs-mix 2000 /tmp/dir`) or as the initramfs /init of a QEMU boot. As
 * /init it takes its loop count from the kernel command line: the kernel hands
 * unknown `key=value` words to init as environment variables (`loops=2000`).
 *
 * Output protocol (one line each, on stdout = the serial console under QEMU):
 *   linepack-begin <name>            just before the measured loop
 *   linepack-end <name>              just after it
 * and around the loop the functions linepack_roi_begin() / linepack_roi_end()
 * run: static, non-PIE binaries give them fixed addresses that a TCG plugin can
 * use as its region of interest (linepack.profile.workloads.roi_addresses).
 *   linepack-result <name> loops=N ... checksum=...   deterministic: derived
 *                                    only from syscall results, never from
 *                                    times, pids or addresses
 *   linepack-info <name> ...         not deterministic (elapsed time); ignore
 *                                    when comparing runs
 *   linepack-error <name> ...        something failed; no result line follows
 *   linepack-module <file> loaded    as PID 1, for each module in linepack.order
 *   linepack-kallsyms <addr> <type> <name>   as PID 1 with env lp_kallsyms=a,b,..:
 *                                    those symbols' /proc/kallsyms lines (with
 *                                    KASLR: the boot's addresses), after modules
 * When running as PID 1 the workload syncs and powers the machine off.
 */
#ifndef LINEPACK_WORKLOAD_H
#define LINEPACK_WORKLOAD_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *lp_name = "workload";

/* Write one whole line with a single write(2) so lines never interleave. */
static __attribute__((unused)) void lp_say(const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof(buf) - 2)
		n = sizeof(buf) - 2;
	buf[n++] = '\n';
	for (int off = 0; off < n;) {
		ssize_t w = write(1, buf + off, n - off);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			break;
		off += w;
	}
}

/*
 * As /init with env hold=1: instead of powering off, park the guest at a fixed
 * point for a memory dump (linepack.profile.qemu.dump_at_hold): a child blocks
 * in read(2) on an empty pipe, init in wait4(2) for it, and "linepack-hold"
 * tells the host that both are asleep. Never returns.
 */
static void lp_hold(void)
{
	int fds[2];
	char c;
	struct timespec t = {0, 100 * 1000000L};

	if (pipe(fds) < 0)
		return;
	pid_t child = fork();
	if (child == 0) {
		close(fds[1]);
		for (;;)
			if (read(fds[0], &c, 1) >= 0 || errno != EINTR)
				_exit(0);
	}
	if (child < 0)
		return;
	nanosleep(&t, NULL);        /* the child reaches its read first */
	lp_say("linepack-hold %s child=%d", lp_name, (int)child);
	for (;;)
		wait4(child, NULL, 0, NULL);
}

/* Power off when we are init; otherwise just exit. Never returns. */
static __attribute__((unused)) void lp_finish(int status)
{
	if (getpid() == 1) {
		sync();
		if (getenv("hold") && !strcmp(getenv("hold"), "1"))
			lp_hold();
		reboot(RB_POWER_OFF);
		/* Only reached if reboot failed: idle rather than panic. */
		lp_say("linepack-error %s reboot: %s", lp_name, strerror(errno));
		for (;;)
			pause();
	}
	exit(status);
}

static __attribute__((unused)) void lp_fail(const char *what)
{
	lp_say("linepack-error %s %s: %s", lp_name, what, strerror(errno));
	lp_finish(1);
}

/*
 * Loop count: argv[1] if given, else env `loops`, else the default. As PID 1
 * argv is ignored: the kernel passes every unknown command-line word without
 * '=' there, which is not ours to interpret.
 */
static __attribute__((unused)) long lp_loops(int argc, char **argv, long dflt)
{
	const char *s = (argc > 1 && getpid() != 1) ? argv[1] : getenv("loops");
	char *end;
	long v;

	if (!s || !*s)
		return dflt;
	errno = 0;
	v = strtol(s, &end, 0);
	if (errno || *end || v < 0) {
		lp_say("linepack-error %s bad loop count '%s'", lp_name, s);
		lp_finish(2);
	}
	return v;
}

/*
 * Load the kernel modules listed, one file name a line and in load order, in
 * /lib/modules/linepack.order (written by linepack.profile.qemu.workload_initrd).
 * A module that fails to load (other than "already loaded") stops the run.
 */
static void lp_load_modules(void)
{
	char line[256];
	FILE *order = fopen("/lib/modules/linepack.order", "r");

	if (!order)
		return;
	while (fgets(line, sizeof(line), order)) {
		char path[300];
		int fd;

		char *params;

		line[strcspn(line, "\r\n")] = 0;
		if (!line[0])
			continue;
		/* "file.ko [parameters]" */
		params = strchr(line, ' ');
		if (params)
			*params++ = 0;
		snprintf(path, sizeof(path), "/lib/modules/%s", line);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0 || (syscall(SYS_finit_module, fd, params ? params : "", 0) < 0 &&
			       errno != EEXIST)) {
			lp_say("linepack-error %s module %s: %s", lp_name, line, strerror(errno));
			lp_finish(1);
		}
		close(fd);
		lp_say("linepack-module %s loaded", line);
	}
	fclose(order);
}

/*
 * Print the /proc/kallsyms lines of the symbols named in env lp_kallsyms
 * (comma-separated; module symbols too, so it runs after the modules load).
 * As PID 1 we are root, so the addresses are real (kptr_restrict 0 or 1).
 */
static void lp_show_kallsyms(void)
{
	const char *want = getenv("lp_kallsyms");
	char line[512];
	FILE *f;

	if (!want || !*want)
		return;
	mkdir("/proc", 0555);
	mount("proc", "/proc", "proc", 0, NULL);   /* EBUSY when already mounted: fine */
	f = fopen("/proc/kallsyms", "r");
	if (!f) {
		lp_fail("open /proc/kallsyms");
		return;
	}
	while (fgets(line, sizeof(line), f)) {
		char addr[32], type[4], name[256];
		const char *p = want;
		size_t n;

		if (sscanf(line, "%31s %3s %255s", addr, type, name) != 3)
			continue;
		n = strlen(name);
		for (; p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
			if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == 0)) {
				lp_say("linepack-kallsyms %s %s %s", addr, type, name);
				break;
			}
		}
	}
	fclose(f);
}

/* When PID 1 in an initramfs: make sure stdout goes somewhere useful, load modules. */
static __attribute__((unused)) void lp_init_console(void)
{
	if (getpid() != 1)
		return;
	/* The kernel normally opened /dev/console as fds 0-2 already. */
	if (fcntl(1, F_GETFD) < 0) {
		mkdir("/dev", 0755);
		mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
		int fd = open("/dev/console", O_RDWR);
		if (fd >= 0) {
			dup2(fd, 0);
			dup2(fd, 1);
			dup2(fd, 2);
			if (fd > 2)
				close(fd);
		}
	}
	lp_load_modules();
	lp_show_kallsyms();
}

/*
 * Region-of-interest markers: real calls to out-of-line functions (never
 * inlined, never dropped), executed exactly once just before and just after
 * the measured loop. Their symbol addresses are the plugin's start=/stop=.
 */
__attribute__((noinline, used, unused)) void linepack_roi_begin(void)
{
	__asm__ volatile("" ::: "memory");
}

__attribute__((noinline, used, unused)) void linepack_roi_end(void)
{
	__asm__ volatile("nop" ::: "memory");
}

/*
 * As /init, wait until a fixed point of the guest's monotonic clock before
 * the loop (default 2 s, env settle_ms=N; 0 disables). Under QEMU -icount the
 * wait costs no host time, and it makes the loop start at the same virtual
 * time whatever the boot did: kernels laid out differently do different
 * amounts of boot work (e.g. sorting tables by address), which would
 * otherwise shift timer-driven work (RCU, RNG reseeds, slab flushes) into or
 * out of the measured loop.
 */
/* A numeric environment word (kernel command line key=value reaches /init so). */
static __attribute__((unused)) long lp_env_long(const char *key, long dflt)
{
	const char *v = getenv(key);

	return (v && *v) ? atol(v) : dflt;
}

static __attribute__((unused)) void lp_settle(void)
{
	const char *env = getenv("settle_ms");
	long ms = env ? atol(env) : 2000;
	struct timespec t;

	if (getpid() != 1 || ms <= 0)
		return;
	t.tv_sec = ms / 1000;
	t.tv_nsec = (ms % 1000) * 1000000L;
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR)
		;
}

static __attribute__((unused)) void lp_begin(void)
{
	lp_settle();
	lp_say("linepack-begin %s", lp_name);
	linepack_roi_begin();
}

static __attribute__((unused)) void lp_end(void)
{
	linepack_roi_end();
	lp_say("linepack-end %s", lp_name);
}

static __attribute__((unused)) uint64_t lp_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

/* FNV-1a over a 64-bit value: the checksum mixes syscall results in order. */
static __attribute__((unused)) uint64_t lp_mix(uint64_t h, uint64_t v)
{
	for (int i = 0; i < 8; i++) {
		h ^= (v >> (8 * i)) & 0xff;
		h *= 0x100000001b3ull;
	}
	return h;
}
#define LP_FNV_INIT 0xcbf29ce484222325ull

#endif
