/*
 * epoll: one epoll instance watching many descriptors (512 pipes). Each
 * iteration makes a deterministic subset of 16 pipes readable, collects the
 * ready ones with epoll_wait and drains them: ep_poll_callback wakeups,
 * the ready list, pipe read/write, fd lookup with many open files.
 *
 * Usage: epoll [LOOPS]   (env: loops=N)
 */
#include "linepack.h"
#include <sys/epoll.h>
#include <sys/resource.h>

#define NPIPES 512
#define PER_LOOP 16

static int rd[NPIPES], wr[NPIPES];

int main(int argc, char **argv)
{
	uint64_t h = LP_FNV_INIT, t0, t1;
	struct rlimit rl = { 4096, 4096 };
	long loops, i;
	int ep;

	lp_name = "epoll";
	lp_init_console();
	loops = lp_loops(argc, argv, 2000);
	/* 1,025 descriptors: above the usual soft limit of 1,024 */
	if (setrlimit(RLIMIT_NOFILE, &rl) < 0) {
		getrlimit(RLIMIT_NOFILE, &rl);
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	ep = epoll_create1(0);
	if (ep < 0)
		lp_fail("epoll_create1");
	for (int k = 0; k < NPIPES; k++) {
		int p[2];
		struct epoll_event ev = { .events = EPOLLIN, .data.u32 = (uint32_t)k };

		if (pipe2(p, O_NONBLOCK) < 0)
			lp_fail("pipe2");
		rd[k] = p[0];
		wr[k] = p[1];
		if (epoll_ctl(ep, EPOLL_CTL_ADD, rd[k], &ev) < 0)
			lp_fail("epoll_ctl");
	}

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++) {
		struct epoll_event evs[PER_LOOP * 2];
		int got = 0;

		/* PER_LOOP distinct pipes: a stride coprime to NPIPES from a moving start. */
		for (int k = 0; k < PER_LOOP; k++) {
			int idx = (int)((i * 37 + k * 97) % NPIPES);
			uint32_t v = (uint32_t)(i * PER_LOOP + k);

			if (write(wr[idx], &v, sizeof(v)) != sizeof(v))
				lp_fail("write");
		}
		while (got < PER_LOOP) {
			int n = epoll_wait(ep, evs, PER_LOOP * 2, 0);

			if (n < 0 && errno == EINTR)
				continue;
			if (n <= 0)
				lp_fail("epoll_wait");
			for (int e = 0; e < n; e++) {
				uint32_t v;
				int idx = (int)evs[e].data.u32;

				if (read(rd[idx], &v, sizeof(v)) != sizeof(v))
					lp_fail("read");
				/* order-independent: epoll's ready-list order is the kernel's business */
				h += (uint64_t)idx * 0x9e3779b97f4a7c15ull ^ v;
				got++;
			}
		}
	}
	t1 = lp_now_ns();
	lp_end();
	lp_say("linepack-result %s loops=%ld fds=%d checksum=%016llx", lp_name, loops, NPIPES,
	       (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
