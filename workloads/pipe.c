/*
 * pipe: ping-pong between two processes over two pipes, like
 * `perf bench sched pipe`: every message wakes the other side, so the loop is
 * scheduler + pipe + wakeup (static-key heavy) kernel paths.
 *
 * Usage: pipe [LOOPS]   (env: loops=N)
 */
#include <sys/wait.h>
#include "linepack.h"

static int xread(int fd, uint32_t *v)
{
	ssize_t r;

	do
		r = read(fd, v, sizeof(*v));
	while (r < 0 && errno == EINTR);
	return r == sizeof(*v) ? 0 : -1;
}

static int xwrite(int fd, uint32_t v)
{
	ssize_t r;

	do
		r = write(fd, &v, sizeof(v));
	while (r < 0 && errno == EINTR);
	return r == sizeof(v) ? 0 : -1;
}

int main(int argc, char **argv)
{
	int ping[2], pong[2], status;
	uint64_t h = LP_FNV_INIT, t0, t1;
	long loops, i;
	pid_t child;

	lp_name = "pipe";
	lp_init_console();
	loops = lp_loops(argc, argv, 20000);
	if (pipe(ping) < 0 || pipe(pong) < 0)
		lp_fail("pipe");

	lp_begin();
	t0 = lp_now_ns();
	child = fork();
	if (child < 0)
		lp_fail("fork");
	if (child == 0) {
		/* Echo each value back incremented; exit status tells success. */
		close(ping[1]);
		close(pong[0]);
		for (i = 0; i < loops; i++) {
			uint32_t v;

			if (xread(ping[0], &v) < 0 || xwrite(pong[1], v + 1) < 0)
				_exit(1);
		}
		_exit(0);
	}
	close(ping[0]);
	close(pong[1]);
	for (i = 0; i < loops; i++) {
		uint32_t v;

		if (xwrite(ping[1], (uint32_t)i) < 0)
			lp_fail("write");
		if (xread(pong[0], &v) < 0)
			lp_fail("read");
		h = lp_mix(h, v);
	}
	if (waitpid(child, &status, 0) != child)
		lp_fail("waitpid");
	t1 = lp_now_ns();
	lp_end();
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		lp_say("linepack-error %s child failed (status 0x%x)", lp_name, status);
		lp_finish(1);
	}
	lp_say("linepack-result %s loops=%ld checksum=%016llx", lp_name, loops, (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
