/*
 * tcp-loopback: TCP over the loopback interface in one process. Each
 * iteration connects to a listening socket on 127.0.0.1 (the three-way
 * handshake runs synchronously through the loopback device's softirq),
 * accepts, sends a request, echoes it back, reads the reply and closes both
 * ends: socket setup and teardown, the TCP state machine, skb allocation,
 * the IP stack and loopback transmit.
 *
 * Usage: tcp-loopback [LOOPS]   (env: loops=N)
 */
#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include "linepack.h"

#define MSG 200

/* As PID 1 nothing brought `lo` up yet. */
static void lo_up(void)
{
	struct ifreq ifr;
	int s = socket(AF_INET, SOCK_DGRAM, 0);

	if (s < 0)
		lp_fail("socket");
	memset(&ifr, 0, sizeof(ifr));
	strcpy(ifr.ifr_name, "lo");
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		lp_fail("SIOCGIFFLAGS lo");
	if (!(ifr.ifr_flags & IFF_UP)) {
		ifr.ifr_flags |= IFF_UP;
		if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
			lp_fail("SIOCSIFFLAGS lo");
	}
	close(s);
}

static int xfer(int fd, char *buf, size_t len, int out)
{
	size_t done = 0;

	while (done < len) {
		ssize_t r = out ? send(fd, buf + done, len - done, 0) : recv(fd, buf + done, len - done, 0);

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		done += r;
	}
	return 0;
}

/* One connection: connect, accept, request, reply, close; returns h mixed with the reply. */
static uint64_t one_round(int lsock, const struct sockaddr_in *addr, long i, uint64_t h)
{
	char req[MSG], rep[MSG];
	struct linger lg = { 1, 0 };
	int c, s, one = 1;

	for (int k = 0; k < MSG; k++)
		req[k] = (char)(i * 31 + k);
	c = socket(AF_INET, SOCK_STREAM, 0);
	if (c < 0)
		lp_fail("socket");
	setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(c, (const struct sockaddr *)addr, sizeof(*addr)) < 0)
		lp_fail("connect");
	s = accept(lsock, NULL, NULL);
	if (s < 0)
		lp_fail("accept");
	if (xfer(c, req, MSG, 1) < 0 || xfer(s, rep, MSG, 0) < 0)
		lp_fail("request");
	for (int k = 0; k < MSG; k++)
		rep[k] ^= 0x5a;
	if (xfer(s, rep, MSG, 1) < 0 || xfer(c, req, MSG, 0) < 0)
		lp_fail("reply");
	for (int k = 0; k < MSG; k += 8)
		h = lp_mix(h, *(uint64_t *)(req + k));
	/* Server closes first (its side goes through FIN_WAIT/TIME_WAIT);
	 * the client resets (linger 0) so no TIME_WAIT piles up on its ports. */
	close(s);
	setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
	close(c);
	return h;
}

int main(int argc, char **argv)
{
	uint64_t h = LP_FNV_INIT, t0, t1;
	struct sockaddr_in addr;
	socklen_t alen = sizeof(addr);
	long loops, i;
	int lsock, one = 1;

	lp_name = "tcp-loopback";
	lp_init_console();
	loops = lp_loops(argc, argv, 500);
	if (getpid() == 1)
		lo_up();
	lsock = socket(AF_INET, SOCK_STREAM, 0);
	if (lsock < 0)
		lp_fail("socket");
	setsockopt(lsock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	addr.sin_port = 0;                              /* any free port */
	if (bind(lsock, (struct sockaddr *)&addr, sizeof(addr)) < 0)
		lp_fail("bind");
	if (listen(lsock, 16) < 0)
		lp_fail("listen");
	if (getsockname(lsock, (struct sockaddr *)&addr, &alen) < 0)
		lp_fail("getsockname");

	/*
	 * Warm-up outside the measured loop (not hashed): the first connect fills
	 * the kernel's once-per-boot tables (net_get_random_once: 256 KiB of random
	 * bytes for the ephemeral-port perturbation table), a one-time cost that
	 * would otherwise land in the loop.
	 */
	for (i = 0; i < lp_env_long("warmup", 2); i++)
		(void)one_round(lsock, &addr, -1 - i, 0);

	lp_begin();
	t0 = lp_now_ns();
	for (i = 0; i < loops; i++)
		h = one_round(lsock, &addr, i, h);
	t1 = lp_now_ns();
	lp_end();
	close(lsock);
	lp_say("linepack-result %s loops=%ld checksum=%016llx", lp_name, loops, (unsigned long long)h);
	lp_say("linepack-info %s elapsed_ns=%llu", lp_name, (unsigned long long)(t1 - t0));
	lp_finish(0);
	return 0;
}
