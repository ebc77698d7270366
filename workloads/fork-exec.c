/*
 * fork-exec: process creation. Each iteration forks, the child execs a small
 * static binary (this same file started in child mode: it exits at once with a
 * status derived from its argument) and the parent waits for it: fork, exec,
 * ELF loading, page faults of a fresh address space, exit and reaping.
 *
 * Usage: fork-exec [LOOPS]   (env: loops=N)
 */
#include <sys/wait.h>
#include "linepack.h"

/* The executable to re-run: /init as PID 1, else our own file. */
static const char *self_path(void)
{
	static char buf[4096];
	ssize_t n;

	if (getpid() == 1)
		return "/init";
	n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
	if (n <= 0)
		return NULL;
	buf[n] = 0;
	return buf;
}

int main(int argc, char **argv)
{
	uint64_t h = LP_FNV_INIT, t0, t1;
	long loops, i;
	const char *exe;

	/* Child mode: `fork-exec --child N` exits with status N % 251. */
	if (argc == 3 && getpid() != 1 && !strcmp(argv[1], "--child"))
		return (int)(atol(argv[2]) % 251);

	lp_name = "fork-exec";
	lp_init_console();
	loops = lp_loops(argc, argv, 300);
	exe = self_path();
	if (!exe)
		lp_fail("readlink /proc/self/exe");

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++) {
		char num[32];
		char *args[] = { "fork-exec", "--child", num, NULL };
		char *envp[] = { NULL };
		int status;
		pid_t pid;

		snprintf(num, sizeof(num), "%ld", i);
		pid = fork();
		if (pid < 0)
			lp_fail("fork");
		if (pid == 0) {
			execve(exe, args, envp);
			_exit(255);
		}
		if (waitpid(pid, &status, 0) != pid)
			lp_fail("waitpid");
		if (!WIFEXITED(status) || WEXITSTATUS(status) == 255) {
			lp_say("linepack-error %s child %ld failed (status 0x%x)", lp_name, i, status);
			lp_finish(1);
		}
		h = lp_mix(h, (uint64_t)WEXITSTATUS(status));
	}
	t1 = lp_now_ns();
	lp_end();
	lp_say("linepack-result %s loops=%ld checksum=%016llx", lp_name, loops, (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
