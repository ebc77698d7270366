/* ext-TSP greedy chain merging (relayout/block_order.py ext_tsp_order), in C.
 *
 * The same search as the Python function, step for step, so that both give the
 * same order: the same arrangements tried in the same order, the same float
 * expressions summed over the same edge lists in the same order, the same
 * best-pair heap ordered by (-gain, pair, stamp), the same final sort of the
 * chains left. block_order.py falls back to the Python search when this cannot
 * be built; tests/test_block_order.py compares the two on random graphs.
 *
 * Input: n nodes (sizes, counts), m edges already merged and sorted by
 * (src, dst) (src != dst, weight > 0). Output: the order, n node indices.
 * Returns 0, or -1 when out of memory. */

#pragma GCC optimize("fp-contract=off")

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FALL_WEIGHT 1.0
#define FALL_WEIGHT_UNCOND 1.05
#define JUMP_WEIGHT 0.1
#define FORWARD_DISTANCE 1024
#define BACKWARD_DISTANCE 640
#define EPS 1e-9

typedef struct { int *v; int n, cap; } vec;

static int vpush(vec *a, int x)
{
	if (a->n == a->cap) {
		int c = a->cap ? 2 * a->cap : 4;
		int *p = realloc(a->v, sizeof(int) * c);
		if (!p)
			return -1;
		a->v = p;
		a->cap = c;
	}
	a->v[a->n++] = x;
	return 0;
}

static int vextend(vec *a, const int *x, int n)
{
	for (int i = 0; i < n; i++)
		if (vpush(a, x[i]))
			return -1;
	return 0;
}

static void vremove(vec *a, int x)        /* set discard */
{
	for (int i = 0; i < a->n; i++)
		if (a->v[i] == x) {
			a->v[i] = a->v[--a->n];
			return;
		}
}

static int vhas(const vec *a, int x)
{
	for (int i = 0; i < a->n; i++)
		if (a->v[i] == x)
			return 1;
	return 0;
}

/* a pair of chains (lo < hi): its edges and its last rating */
typedef struct {
	int64_t key;          /* lo * n + hi; -1 empty, -2 deleted */
	vec edges;
	double gain;
	int first, second, kind, cut, has;
	int64_t stamp;
} pair;

enum { XY, YX, X1YX2, YX2X1, X2X1Y };

typedef struct {
	int n;
	const int64_t *sizes;
	const int *ea, *eb, *eu;
	const double *ew;
	int *chain, *pos;
	int64_t *off, *size_of;
	vec *nodes, *inner, *partners;
	pair *tab;
	int64_t cap;          /* hash capacity (power of 2) */
	int64_t used;         /* slots live or deleted */
	int entry, split_max;
	/* scratch for arrangements */
	int x, y, k;
	int64_t sx, sy, cut;
	int mode;
} st;

static int64_t h64(int64_t k)
{
	uint64_t z = (uint64_t)k * 0x9E3779B97F4A7C15ull;
	return (int64_t)(z >> 17);
}

static pair *find(st *s, int64_t key)
{
	int64_t i = h64(key) & (s->cap - 1);
	for (;;) {
		pair *p = &s->tab[i];
		if (p->key == key)
			return p;
		if (p->key == -1)
			return NULL;
		i = (i + 1) & (s->cap - 1);
	}
}

static int rehash(st *s)
{
	pair *old = s->tab;
	int64_t ocap = s->cap, live = 0;
	for (int64_t i = 0; i < ocap; i++)
		live += old[i].key >= 0;
	while (s->cap < 4 * live + 16)
		s->cap *= 2;
	s->tab = calloc(s->cap, sizeof(pair));
	if (!s->tab) {
		s->tab = old, s->cap = ocap;
		return -1;
	}
	for (int64_t i = 0; i < s->cap; i++)
		s->tab[i].key = -1;
	for (int64_t i = 0; i < ocap; i++) {
		if (old[i].key < 0) {
			free(old[i].edges.v);
			continue;
		}
		int64_t j = h64(old[i].key) & (s->cap - 1);
		while (s->tab[j].key != -1)
			j = (j + 1) & (s->cap - 1);
		s->tab[j] = old[i];
	}
	s->used = live;
	free(old);
	return 0;
}

static pair *insert(st *s, int64_t key)
{
	if (2 * (s->used + 1) > s->cap && rehash(s))
		return NULL;
	int64_t i = h64(key) & (s->cap - 1), del = -1;
	for (;;) {
		pair *p = &s->tab[i];
		if (p->key == key)
			return p;
		if (p->key == -2 && del < 0)
			del = i;
		if (p->key == -1) {
			pair *q = &s->tab[del >= 0 ? del : i];
			if (del < 0)
				s->used++;
			q->key = key;
			q->edges.n = 0;
			q->has = 0;
			return q;
		}
		i = (i + 1) & (s->cap - 1);
	}
}

static int64_t pkey(st *s, int a, int b)
{
	int lo = a < b ? a : b, hi = a < b ? b : a;
	return (int64_t)lo * s->n + hi;
}

/* the address of node v in the arrangement being rated */
static int64_t addr(st *s, int v)
{
	int cx = s->chain[v] == s->x, cy = s->chain[v] == s->y;
	int in1 = cx && s->pos[v] < s->k;
	switch (s->mode) {
	case -1: return s->off[v];                                          /* X as it is */
	case XY: return s->off[v] + (cx ? 0 : s->sx);
	case YX: return s->off[v] + (cx ? s->sy : 0);
	case X1YX2: return (cx && in1) ? s->off[v] : cy ? s->cut + s->off[v] : s->off[v] + s->sy;
	case YX2X1: return cy ? s->off[v] : !in1 ? s->sy + s->off[v] - s->cut
		: s->sy + (s->sx - s->cut) + s->off[v];
	default: return cy ? s->sx + s->off[v] : !in1 ? s->off[v] - s->cut
		: (s->sx - s->cut) + s->off[v];
	}
}

static double cross_score(st *s, const int *es, int ne, int mode)
{
	double sc = 0.0;
	s->mode = mode;
	for (int i = 0; i < ne; i++) {
		int e = es[i], a = s->ea[e], b = s->eb[e];
		double w = s->ew[e];
		int64_t src_end = addr(s, a) + s->sizes[a], dst_start = addr(s, b);
		if (dst_start == src_end) {
			sc += w * (s->eu[e] ? FALL_WEIGHT_UNCOND : FALL_WEIGHT);
		} else if (dst_start > src_end) {
			int64_t d = dst_start - src_end;
			if (d < FORWARD_DISTANCE)
				sc += w * JUMP_WEIGHT * (1.0 - (double)d / FORWARD_DISTANCE);
		} else {
			int64_t d = src_end - dst_start;
			if (d < BACKWARD_DISTANCE)
				sc += w * JUMP_WEIGHT * (1.0 - (double)d / BACKWARD_DISTANCE);
		}
	}
	return sc;
}

static int cmp64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return (x > y) - (x < y);
}

static int cmp_int(const void *a, const void *b)
{
	int x = *(const int *)a, y = *(const int *)b;
	return (x > y) - (x < y);
}

/* best arrangement of chains x (may be cut) and y; *gain EPS and *kind -1 when none */
static int best_merge(st *s, int x, int y, double *gain, int *kind, int *cutk)
{
	vec *X = &s->nodes[x], *Y = &s->nodes[y];
	pair *pp = find(s, pkey(s, x, y));
	const int *cross = pp->edges.v;
	int nc = pp->edges.n;
	int ex = s->chain[s->entry] == x, ey = s->chain[s->entry] == y;
	double best = EPS;
	int bk = -1, bc = 0;
	s->x = x, s->y = y, s->sx = s->size_of[x], s->sy = s->size_of[y], s->k = 0, s->cut = 0;
#define CONSIDER(g, kd, c) do { double g_ = (g); if (g_ > best) { best = g_; bk = (kd); bc = (c); } } while (0)
	if (!ey)
		CONSIDER(cross_score(s, cross, nc, XY), XY, 0);
	if (!ex)
		CONSIDER(cross_score(s, cross, nc, YX), YX, 0);
	if (X->n > 1 && X->n <= s->split_max) {
		int *cuts = malloc(sizeof(int) * (2 * (size_t)nc + 1)), ncut = 0;
		if (!cuts)
			return -1;
		for (int i = 0; i < nc; i++) {
			int a = s->ea[cross[i]], b = s->eb[cross[i]];
			if (s->chain[a] == x && b == Y->v[0])
				cuts[ncut++] = s->pos[a] + 1;
			if (a == Y->v[Y->n - 1] && s->chain[b] == x)
				cuts[ncut++] = s->pos[b];
		}
		qsort(cuts, ncut, sizeof(int), cmp_int);
		vec both = {0};
		for (int c = 0; c < ncut; c++) {
			int k = cuts[c];
			if (c > 0 && cuts[c - 1] == k)
				continue;                 /* a set: each cut once */
			if (!(0 < k && k < X->n))
				continue;
			s->k = k;
			s->cut = s->off[X->v[k]];
			both.n = 0;
			if (vextend(&both, cross, nc)) {
				free(cuts);
				free(both.v);
				return -1;
			}
			vec *in = &s->inner[x];
			for (int i = 0; i < in->n; i++) {
				int e = in->v[i];
				int a1 = s->pos[s->ea[e]] < k, b1 = s->pos[s->eb[e]] < k;
				if (a1 != b1 && vpush(&both, e)) {
					free(cuts);
					free(both.v);
					return -1;
				}
			}
			double before = cross_score(s, both.v + nc, both.n - nc, -1);
			if (!ey)
				CONSIDER(cross_score(s, both.v, both.n, X1YX2) - before, X1YX2, k);
			if (!ex)
				CONSIDER(cross_score(s, both.v, both.n, YX2X1) - before, YX2X1, k);
			if (!ex && !ey)
				CONSIDER(cross_score(s, both.v, both.n, X2X1Y) - before, X2X1Y, k);
		}
		free(both.v);
		free(cuts);
	}
#undef CONSIDER
	*gain = best, *kind = bk, *cutk = bc;
	return 0;
}

/* heap of (-gain, lo, hi, stamp), smallest first (Python's heapq on tuples) */
typedef struct { double ng; int lo, hi; int64_t stamp; } hent;

static int hless(const hent *a, const hent *b)
{
	if (a->ng != b->ng)
		return a->ng < b->ng;
	if (a->lo != b->lo)
		return a->lo < b->lo;
	if (a->hi != b->hi)
		return a->hi < b->hi;
	return a->stamp < b->stamp;
}

typedef struct { hent *v; int64_t n, cap; } heap;

static int hpush(heap *h, hent e)
{
	if (h->n == h->cap) {
		int64_t c = h->cap ? 2 * h->cap : 64;
		hent *p = realloc(h->v, sizeof(hent) * c);
		if (!p)
			return -1;
		h->v = p, h->cap = c;
	}
	int64_t i = h->n++;
	h->v[i] = e;
	while (i > 0) {
		int64_t p = (i - 1) / 2;
		if (!hless(&h->v[i], &h->v[p]))
			break;
		hent t = h->v[i]; h->v[i] = h->v[p]; h->v[p] = t;
		i = p;
	}
	return 0;
}

static hent hpop(heap *h)
{
	hent top = h->v[0];
	h->v[0] = h->v[--h->n];
	int64_t i = 0;
	for (;;) {
		int64_t l = 2 * i + 1, r = l + 1, m = i;
		if (l < h->n && hless(&h->v[l], &h->v[m]))
			m = l;
		if (r < h->n && hless(&h->v[r], &h->v[m]))
			m = r;
		if (m == i)
			break;
		hent t = h->v[i]; h->v[i] = h->v[m]; h->v[m] = t;
		i = m;
	}
	return top;
}

static int rate(st *s, heap *h, int a, int b, int64_t *stamp)
{
	double g1, g2;
	int k1, k2, c1, c2;
	if (best_merge(s, a, b, &g1, &k1, &c1) || best_merge(s, b, a, &g2, &k2, &c2))
		return -1;
	pair *p = find(s, pkey(s, a, b));
	if (g1 >= g2)
		p->gain = g1, p->first = a, p->second = b, p->kind = k1, p->cut = c1;
	else
		p->gain = g2, p->first = b, p->second = a, p->kind = k2, p->cut = c2;
	p->stamp = (*stamp)++;
	p->has = 1;
	if (p->kind >= 0) {
		hent e = {-p->gain, a < b ? a : b, a < b ? b : a, p->stamp};
		if (hpush(h, e))
			return -1;
	}
	return 0;
}

typedef struct { double nd; int lo, c; } rest_ent;

static int cmp_rest(const void *a, const void *b)
{
	const rest_ent *x = a, *y = b;
	if (x->nd != y->nd)
		return x->nd < y->nd ? -1 : 1;
	return (x->lo > y->lo) - (x->lo < y->lo);
}

int lp_ext_tsp(int n, const int64_t *sizes, const double *counts, int m, const int *ea,
	       const int *eb, const double *ew, const int *eu, int entry, int split_max, int *out)
{
	int rc = -1;
	st s = {0};
	heap h = {0};
	rest_ent *rest = NULL;
	int64_t *keys = NULL;
	s.n = n, s.sizes = sizes, s.ea = ea, s.eb = eb, s.ew = ew, s.eu = eu;
	s.entry = entry, s.split_max = split_max;
	s.chain = malloc(sizeof(int) * n);
	s.pos = malloc(sizeof(int) * n);
	s.off = malloc(sizeof(int64_t) * n);
	s.size_of = malloc(sizeof(int64_t) * n);
	s.nodes = calloc(n, sizeof(vec));
	s.inner = calloc(n, sizeof(vec));
	s.partners = calloc(n, sizeof(vec));
	s.cap = 64;
	while (s.cap < 4 * (int64_t)m + 16)
		s.cap *= 2;
	s.tab = calloc(s.cap, sizeof(pair));
	char *alive = calloc(n, 1);
	int *seq = malloc(sizeof(int) * n);
	if (!s.chain || !s.pos || !s.off || !s.size_of || !s.nodes || !s.inner || !s.partners ||
	    !s.tab || !alive || !seq)
		goto out;
	for (int64_t i = 0; i < s.cap; i++)
		s.tab[i].key = -1;
	for (int i = 0; i < n; i++) {
		s.chain[i] = i, s.pos[i] = 0, s.off[i] = 0, s.size_of[i] = sizes[i], alive[i] = 1;
		if (vpush(&s.nodes[i], i))
			goto out;
	}
	for (int e = 0; e < m; e++) {
		pair *p = insert(&s, pkey(&s, ea[e], eb[e]));
		if (!p || vpush(&p->edges, e))
			goto out;
	}
	/* partners and the first ratings, pairs in sorted order */
	int64_t npairs = 0;
	keys = malloc(sizeof(int64_t) * (m + 1));
	if (!keys)
		goto out;
	for (int64_t i = 0; i < s.cap; i++)
		if (s.tab[i].key >= 0)
			keys[npairs++] = s.tab[i].key;
	qsort(keys, npairs, sizeof(int64_t), cmp64);     /* lo * n + hi orders as (lo, hi) */
	for (int64_t i = 0; i < npairs; i++) {
		int lo = (int)(keys[i] / n), hi = (int)(keys[i] % n);
		if (vpush(&s.partners[lo], hi) || vpush(&s.partners[hi], lo))
			goto out_keys;
	}
	int64_t stamp = 0;
	for (int64_t i = 0; i < npairs; i++)
		if (rate(&s, &h, (int)(keys[i] / n), (int)(keys[i] % n), &stamp))
			goto out_keys;
	while (h.n) {
		hent e = hpop(&h);
		pair *p = find(&s, (int64_t)e.lo * n + e.hi);
		if (!p || !p->has || p->stamp != e.stamp)
			continue;
		int x = p->first, y = p->second, kind = p->kind, k = p->cut;
		vec *X = &s.nodes[x], *Y = &s.nodes[y];
		int ns = 0;
#define APP(V, a, b) for (int i_ = (a); i_ < (b); i_++) seq[ns++] = (V)->v[i_]
		switch (kind) {
		case XY: APP(X, 0, X->n); APP(Y, 0, Y->n); break;
		case YX: APP(Y, 0, Y->n); APP(X, 0, X->n); break;
		case X1YX2: APP(X, 0, k); APP(Y, 0, Y->n); APP(X, k, X->n); break;
		case YX2X1: APP(Y, 0, Y->n); APP(X, k, X->n); APP(X, 0, k); break;
		default: APP(X, k, X->n); APP(X, 0, k); APP(Y, 0, Y->n); break;
		}
#undef APP
		int keep = x < y ? x : y, gone = x < y ? y : x;
		/* merged edges: inner[x] + inner[y] + between(keep, gone) */
		vec merged = {0};
		if (vextend(&merged, s.inner[x].v, s.inner[x].n) ||
		    vextend(&merged, s.inner[y].v, s.inner[y].n) ||
		    vextend(&merged, p->edges.v, p->edges.n)) {
			free(merged.v);
			goto out_keys;
		}
		free(p->edges.v);
		memset(&p->edges, 0, sizeof(vec));
		p->key = -2, p->has = 0;
		free(s.inner[gone].v);
		memset(&s.inner[gone], 0, sizeof(vec));
		free(s.inner[keep].v);
		s.inner[keep] = merged;
		s.nodes[keep].n = 0;
		if (vextend(&s.nodes[keep], seq, ns))
			goto out_keys;
		free(s.nodes[gone].v);
		memset(&s.nodes[gone], 0, sizeof(vec));
		alive[gone] = 0;
		int64_t off = 0;
		for (int i = 0; i < ns; i++) {
			int v = seq[i];
			s.chain[v] = keep, s.off[v] = off, s.pos[v] = i;
			off += sizes[v];
		}
		s.size_of[keep] = off;
		vremove(&s.partners[keep], gone);
		vremove(&s.partners[gone], keep);
		vec gp = s.partners[gone];
		memset(&s.partners[gone], 0, sizeof(vec));
		for (int i = 0; i < gp.n; i++) {
			int other = gp.v[i];
			pair *q = find(&s, pkey(&s, gone, other));
			vec es = q->edges;
			memset(&q->edges, 0, sizeof(vec));
			q->key = -2, q->has = 0;
			vremove(&s.partners[other], gone);
			if (!vhas(&s.partners[other], keep) && vpush(&s.partners[other], keep)) {
				free(es.v);
				free(gp.v);
				goto out_keys;
			}
			if (!vhas(&s.partners[keep], other) && vpush(&s.partners[keep], other)) {
				free(es.v);
				free(gp.v);
				goto out_keys;
			}
			pair *t = find(&s, pkey(&s, keep, other));
			if (!t)
				t = insert(&s, pkey(&s, keep, other));
			if (!t || vextend(&t->edges, es.v, es.n)) {
				free(es.v);
				free(gp.v);
				goto out_keys;
			}
			free(es.v);
		}
		free(gp.v);
		vec *kp = &s.partners[keep];
		int *others = malloc(sizeof(int) * (kp->n + 1));
		if (!others)
			goto out_keys;
		memcpy(others, kp->v, sizeof(int) * kp->n);
		int no = kp->n;
		qsort(others, no, sizeof(int), cmp_int);
		for (int i = 0; i < no; i++)
			if (rate(&s, &h, keep < others[i] ? keep : others[i],
				 keep < others[i] ? others[i] : keep, &stamp)) {
				free(others);
				goto out_keys;
			}
		free(others);
	}
	{
		int first = s.chain[entry], nr = 0, no = 0;
		rest = malloc(sizeof(rest_ent) * n);
		if (!rest)
			goto out_keys;
		for (int c = 0; c < n; c++) {
			if (!alive[c] || c == first)
				continue;
			vec *N = &s.nodes[c];
			double sum = 0.0;
			int lo = N->v[0];
			for (int i = 0; i < N->n; i++) {
				sum += counts[N->v[i]];
				if (N->v[i] < lo)
					lo = N->v[i];
			}
			double d = s.size_of[c] ? sum / (double)s.size_of[c] : 0.0;
			rest[nr].nd = -d, rest[nr].lo = lo, rest[nr].c = c;
			nr++;
		}
		qsort(rest, nr, sizeof(rest_ent), cmp_rest);
		for (int i = 0; i < s.nodes[first].n; i++)
			out[no++] = s.nodes[first].v[i];
		for (int r = 0; r < nr; r++) {
			vec *N = &s.nodes[rest[r].c];
			for (int i = 0; i < N->n; i++)
				out[no++] = N->v[i];
		}
	}
	rc = 0;
out_keys:
out:
	free(keys);
	if (s.tab)
		for (int64_t i = 0; i < s.cap; i++)
			free(s.tab[i].edges.v);
	if (s.nodes)
		for (int i = 0; i < n; i++)
			free(s.nodes[i].v);
	if (s.inner)
		for (int i = 0; i < n; i++)
			free(s.inner[i].v);
	if (s.partners)
		for (int i = 0; i < n; i++)
			free(s.partners[i].v);
	free(s.chain); free(s.pos); free(s.off); free(s.size_of);
	free(s.nodes); free(s.inner); free(s.partners); free(s.tab);
	free(alive); free(seq); free(h.v); free(rest);
	return rc;
}
