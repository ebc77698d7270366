/*
 * linepack_plugin.c - linepack's QEMU TCG plugin (plugin API version 1, QEMU 7.2).
 *
 * What it records (all of it restricted to the selected mode, kernel by default):
 *   - per translation block (TB): start vaddr, byte size, instruction count and
 *     execution count.  Executions are counted by an inline add on a per-TB
 *     counter (no helper call).  TB records live in a hash table keyed by
 *     (vaddr, size, ninsns), so retranslations of the same code merge.
 *   - edges=on: block-to-block transitions, i.e. the complete branch trace an
 *     LBR would give (one helper call per executed TB).
 *   - whenever a helper runs per executed TB (edges=on, cache=on or tbtrace=):
 *     where each TB first ran in the window, as its position in the window's
 *     sequence of executed TBs (the order relayout's "blocks" lays hot code in).
 *   - cache=on: a simulated L1 instruction cache (size/ways/line, LRU) fed with
 *     the whole byte range of every executed instruction.  At translation time
 *     each TB gets the list of distinct cache lines its instructions touch, in
 *     order, with consecutive repeats merged; one helper call per executed TB
 *     replays that list through the model.
 *
 * Definition of a "fetch": one access to a cache line made when the simulated
 * instruction stream ENTERS that line.  Consecutive instructions in the same
 * line are one fetch; an instruction that straddles a line boundary enters two
 * lines (two fetches).  The merge also applies across TB boundaries (a TB
 * that starts in the line where the previous simulated TB ended does not fetch
 * that line again), so the counts do not depend on where QEMU splits blocks.
 * Instructions outside the selected mode are not simulated at all: they do
 * not touch the model.  A TB whose execution is cut short by an exception
 * still counts as fully executed (as does its inline execution counter).
 * Lines are indexed by virtual address.
 *
 * Region of interest (optional): start=<vaddr> and stop=<vaddr>.  Counting
 * begins the first time the instruction at start= executes and ends the first
 * time the instruction at stop= executes afterwards (start==stop: between two
 * consecutive executions).  start_count=N / stop_count=M: begin at the N-th
 * execution of start=, end at the M-th execution of stop= after that (so
 * start=stop=<syscall entry>,start_count=100,stop_count=10 spans 10 loop
 * iterations after a warm-up of 99).  The markers may be user addresses even in kernel
 * mode.  The cache model runs outside the window too (so it is warm), but
 * only fetches/misses/edges inside the window are counted; TB execution
 * counts are snapshots taken at the markers.
 *
 * Arguments (-plugin linepack_plugin.so,arg=value,...):
 *   out=PATH          output file (required), written atomically at exit
 *   mode=kernel|user|all   which code to record (kernel: vaddr >= 0xffff800000000000)
 *   cache=on|off      simulate the L1i (default off)
 *   size=N ways=N line=N   cache geometry (default 32768, 8, 64); sets must be a power of 2;
 *                     line up to 2 MiB, so an iTLB is the same model with line = page size
 *   prefetch=on|off   next-line prefetch: every fetch of line L also fills L+1 (MRU, no
 *                     fetch or miss counted; a present L+1 is left where it is)
 *   l2size=N l2ways=N a second level behind the L1 (same line size): L1 misses look it
 *                     up, and "misses" are then the L2 misses (an instruction-only stream:
 *                     data traffic that shares a unified L2 is not modelled)
 *   edges=on|off      record block-to-block transitions (default off)
 *   start=VADDR stop=VADDR   region of interest (decimal or 0x hex)
 *   start_count=N stop_count=M   which executions of the markers open/close it (default 1)
 *   tbtrace=PATH      debug: append every executed TB (vaddr u64, size u32, ninsns u32)
 *                     in execution order; large (16 B per executed block)
 *
 * Output format (little endian), see tools/profile/trace.py for the reader:
 *   header, 144 bytes:
 *     0 char[8] magic "LPKTRACE"   8 u32 version (3)    12 u32 header size (144)
 *    16 u32 TB record size (48)    20 u32 edge record size (32)
 *    24 u32 flags: 1 cache, 2 edges, 4 start= given, 8 stop= given, 16 window
 *           started, 32 window stopped, 64 system emulation, 128 several vCPUs,
 *           256 approximate (see Threads below)
 *    28 u32 mode (0 kernel, 1 user, 2 all)
 *    32 u32 cache size  36 u32 ways  40 u32 line size
 *    44 u32 model flags: 1 next-line prefetch, 2 L2 (misses are L2 misses); 0 = plain L1
 *    48 u64 number of TB records   56 u64 number of edge records
 *    64 u64 fetches   72 u64 misses   80 u64 start=   88 u64 stop=
 *    96 u64 translations seen (in mode)   104 u64 phantom instructions dropped (see
 *           fix_phantoms)   112 u64 start_count   120 u64 stop_count
 *   128 u64 vCPUs created   136 u64 most vCPUs alive at once
 *   TB records, sorted by (vaddr, size, ninsns), 48 bytes each:
 *     u64 vaddr, u32 size, u32 ninsns, u64 execs, u64 fetches, u64 misses,
 *     u64 first: position of the TB's first execution in the window, counted in
 *         executed TBs of the mode from the window's start (0-based: the index
 *         tbtrace= would give it); UINT64_MAX when it did not run in the window
 *         or no per-TB helper ran (counts only)
 *   (version 1, written before: 40-byte TB records without "first"; version 2: the
 *   128-byte header, without the vCPU counts)
 *   edge records, sorted by (src, dst), 32 bytes each:
 *     u64 src   address of the last instruction of the source block (LBR "from")
 *     u64 dst   start of the destination block (LBR "to")
 *     u64 count
 *     u32 src_size  byte size of the source instruction
 *     u32 flags     1: fall-through (dst is right after the source block: no branch)
 *
 * Threads.  In system mode the plugin needs -smp 1 (it refuses more vCPUs).  In
 * user mode every guest thread is a vCPU of its own, running in parallel with the
 * others, and the 7.2 API has no per-vCPU scoreboards, so the plugin runs in two
 * modes:
 *   - single: while the process has had one vCPU, everything is plain memory as
 *     described above (inline execution counter, one cache model, one edge table);
 *   - threaded: from the moment a second vCPU is created (vcpu_init, called in
 *     the creating thread, during its clone(), before the new thread runs and
 *     while the creating one executes no guest code), the inline counters are
 *     frozen (their window part is kept in tb_rec.pre) and ignored; every vCPU
 *     counts executions, fetches, misses and edges in its own tables (struct
 *     vcpu, indexed by vcpu_index), summed at exit.  Blocks translated from then
 *     on get no inline counter.  Each vCPU has its own previous block (edges),
 *     its own previous line and its own cache model (as if each thread ran on a
 *     core of its own; a vCPU index QEMU hands to a later thread keeps its
 *     cache).  "first" positions come from one shared atomic sequence (the
 *     interleaving the threads happened to run in).  Window markers with threads
 *     are approximate (one thread opens the window for all of them at once):
 *     the output says so (flag 256).
 * At exit, QEMU 7.2's linux-user stops the other threads, removes the callbacks
 * and flushes the code cache before calling at_exit, so the tables are quiet by
 * then.  A child made by fork() (no CLONE_VM) inherits a copy of the state and
 * writes nothing: the profile is the process that loaded the plugin.
 *
 * Version 3 adds to the header (now 144 bytes):
 *   128 u64 vCPUs created (guest threads that ran, the first one included)
 *   136 u64 most vCPUs alive at once
 *   and flags 128: several vCPUs ran (threaded mode), 256: approximate (window
 *   markers with several threads, or executions dropped: a vCPU index beyond the
 *   plugin's table)
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <glib.h>
#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

#define KERNEL_BASE 0xffff800000000000ULL
#define USER_TOP 0x0000800000000000ULL
#define NO_LINE UINT64_MAX
#define PAGE_SIZE 4096ULL

#define OUT_VERSION 3
#define HDR_SIZE 144
#define TB_REC_SIZE 48
#define EDGE_REC_SIZE 32

#define FLAG_THREADS 128
#define FLAG_APPROX 256

enum mode { MODE_KERNEL = 0, MODE_USER = 1, MODE_ALL = 2 };
enum roi { ROI_WAIT, ROI_ACTIVE, ROI_DONE };

struct edge;

struct tb_rec {
    uint64_t execs;         /* inline counter (single mode; ignored once threaded) */
    uint64_t vaddr;
    uint32_t size, ninsns;
    uint64_t fetches, misses;
    uint64_t first;         /* 1 + position of the first execution in the window; 0: none */
    uint64_t base, end;     /* execs at the window markers */
    uint64_t last_insn;     /* vaddr of the last instruction */
    uint32_t last_insn_size;
    uint32_t nlines;
    uint64_t prev_insn;     /* vaddr of the instruction before the last one */
    uint32_t prev_insn_size;
    bool first_crosses;     /* the first instruction crosses a page boundary */
    uint32_t id;            /* dense index: the vCPUs' counter tables */
    uint64_t pre;           /* threaded: window executions counted inline before the switch */
    uint64_t mt_execs;      /* threaded: executions the vCPUs counted (summed at exit) */
    /* output view, after dropping a phantom last instruction (see fix_phantoms) */
    uint32_t out_size, out_ninsns;
    uint64_t out_last;
    uint32_t out_last_size;
    struct edge *last_edge; /* one-entry cache: most recent successor (single mode) */
    uint64_t lines[];       /* line numbers (vaddr >> line_shift), consecutive repeats merged */
};

struct edge {
    struct tb_rec *src, *dst;
    uint64_t count;
};

/* edges: chunked storage (stable pointers) + open-addressing index */
#define EDGE_CHUNK 4096
struct edge_tab {
    struct edge **chunks;
    size_t nchunks, n;
    struct edge **index;
    size_t cap;
};

/* threaded: a vCPU's counts of one block (tb_rec.id), in pages of CNT_PAGE */
struct tb_cnt {
    uint64_t execs, fetches, misses;
    struct edge *last_edge;     /* one-entry cache: most recent successor on this vCPU */
};
#define CNT_PAGE_BITS 10
#define CNT_PAGE (1u << CNT_PAGE_BITS)

/*
 * What one vCPU (guest thread) owns.  Only that vCPU's thread touches it while
 * it runs (vcpu_init resets it, in the creating thread, before the new thread
 * starts); at_exit reads all of them.  The first vCPU's is st0, which is also
 * the whole state in single mode.
 */
struct vcpu {
    struct tb_rec *last_tb;     /* edges: previous simulated TB, NULL after a gap */
    uint64_t last_line;         /* cache: line where the previous simulated TB ended */
    uint64_t *tags, *l2tags;    /* cache model: per set, tags ordered MRU first */
    uint64_t fetches, misses;   /* totals in the window */
    struct edge_tab edges;
    struct tb_cnt **pages;      /* threaded: per-block counts, by tb_rec.id */
    size_t npages;
};

/* ---- options ---- */
static char *out_path;
static char *tbtrace_path;
static enum mode mode = MODE_KERNEL;
static bool do_cache, do_edges;
static bool record_first;          /* a per-TB helper runs: edges, cache or tbtrace */
static uint64_t cache_size = 32768, cache_ways = 8, line_size = 64;
static bool do_prefetch;
static uint64_t l2_size, l2_ways = 16;
static bool have_start, have_stop;
static uint64_t roi_start, roi_stop;
static uint64_t start_count = 1, stop_count = 1, start_hits, stop_hits;
static bool system_emulation;
static pid_t plugin_pid;           /* the process that loaded the plugin (not a fork child) */

/* ---- state ---- */
static GMutex lock;
static GHashTable *tbs;            /* struct tb_rec* -> itself, keyed by (vaddr,size,ninsns) */
static GPtrArray *tb_by_id;        /* tb_rec.id -> struct tb_rec* */
static uint64_t translations;
static enum roi roi_state = ROI_ACTIVE;
static bool counting = true;       /* inside the window */
static FILE *tbtrace;
static struct vcpu st0 = { .last_line = NO_LINE };

/* cache model geometry */
static unsigned line_shift;
static uint64_t set_mask;
static uint64_t l2_set_mask;
static bool have_l2;
static uint64_t window_execs;      /* executed TBs of the mode seen by tb_exec in the window */

/* vCPUs: threaded mode, vcpu table (two levels: a reader never sees a table move) */
static bool threaded;              /* a second vCPU was created */
#define VCPU_L2 256
#define VCPU_L1 4096
static struct vcpu **vcpu_dir[VCPU_L1];
static GPtrArray *all_vcpus;       /* every struct vcpu, st0 first */
static uint64_t vcpus_created, vcpus_alive, vcpus_peak;
static uint64_t dropped;           /* executions on a vCPU beyond the table (not counted) */

static void die(const char *msg)
{
    fprintf(stderr, "linepack plugin: %s\n", msg);
}

static bool in_mode(uint64_t va)
{
    switch (mode) {
    case MODE_KERNEL:
        return va >= KERNEL_BASE;
    case MODE_USER:
        return va < USER_TOP;
    default:
        return true;
    }
}

/* ---- TB hash table ---- */
static guint tb_hash(gconstpointer p)
{
    const struct tb_rec *r = p;
    uint64_t h = r->vaddr * 0x9e3779b97f4a7c15ULL;
    h ^= ((uint64_t)r->size << 32 | r->ninsns) * 0xc2b2ae3d27d4eb4fULL;
    return (guint)(h ^ (h >> 29));
}

static gboolean tb_equal(gconstpointer a, gconstpointer b)
{
    const struct tb_rec *x = a, *y = b;
    return x->vaddr == y->vaddr && x->size == y->size && x->ninsns == y->ninsns;
}

/* ---- cache model ---- */
/* One LRU set-associative level; returns 1 on a miss (the line is then MRU). */
static inline int lru_access(uint64_t *tags, uint64_t mask, unsigned ways, uint64_t line)
{
    uint64_t *set = tags + (line & mask) * ways;
    unsigned i;
    if (set[0] == line) {
        return 0;
    }
    for (i = 1; i < ways; i++) {
        if (set[i] == line) {
            memmove(set + 1, set, i * sizeof(*set));
            set[0] = line;
            return 0;
        }
    }
    memmove(set + 1, set, (ways - 1) * sizeof(*set));
    set[0] = line;
    return 1;
}

/* Prefetch fill: insert line as MRU unless present (a present line keeps its place). */
static inline void lru_fill(uint64_t *tags, uint64_t mask, unsigned ways, uint64_t line)
{
    uint64_t *set = tags + (line & mask) * ways;
    for (unsigned i = 0; i < ways; i++) {
        if (set[i] == line) {
            return;
        }
    }
    memmove(set + 1, set, (ways - 1) * sizeof(*set));
    set[0] = line;
}

static inline int cache_access(struct vcpu *v, uint64_t line)
{
    int miss = lru_access(v->tags, set_mask, cache_ways, line);
    if (do_prefetch) {
        lru_fill(v->tags, set_mask, cache_ways, line + 1);
    }
    if (miss && v->l2tags) {
        miss = lru_access(v->l2tags, l2_set_mask, l2_ways, line);
    }
    return miss;
}

static uint64_t *new_tags(uint64_t n)
{
    uint64_t *t = g_new(uint64_t, n);
    for (uint64_t i = 0; i < n; i++) {
        t[i] = NO_LINE;
    }
    return t;
}

/* ---- edges ---- */
static inline size_t edge_slot(const struct tb_rec *s, const struct tb_rec *d, size_t cap)
{
    uint64_t h = ((uintptr_t)s * 0x9e3779b97f4a7c15ULL) ^ ((uintptr_t)d * 0xc2b2ae3d27d4eb4fULL);
    return (size_t)(h ^ (h >> 31)) & (cap - 1);
}

static void edge_grow(struct edge_tab *t)
{
    size_t cap = t->cap ? t->cap * 2 : 1 << 14;
    struct edge **idx = g_new0(struct edge *, cap);
    for (size_t i = 0; i < t->cap; i++) {
        struct edge *e = t->index[i];
        if (e) {
            size_t j = edge_slot(e->src, e->dst, cap);
            while (idx[j]) {
                j = (j + 1) & (cap - 1);
            }
            idx[j] = e;
        }
    }
    g_free(t->index);
    t->index = idx;
    t->cap = cap;
}

static struct edge *edge_get(struct edge_tab *t, struct tb_rec *s, struct tb_rec *d)
{
    size_t j;
    struct edge *e;
    if ((t->n + 1) * 2 > t->cap) {
        edge_grow(t);
    }
    j = edge_slot(s, d, t->cap);
    while ((e = t->index[j])) {
        if (e->src == s && e->dst == d) {
            return e;
        }
        j = (j + 1) & (t->cap - 1);
    }
    if (t->n % EDGE_CHUNK == 0) {
        t->chunks = g_renew(struct edge *, t->chunks, t->nchunks + 1);
        t->chunks[t->nchunks++] = g_new0(struct edge, EDGE_CHUNK);
    }
    e = &t->chunks[t->n / EDGE_CHUNK][t->n % EDGE_CHUNK];
    t->n++;
    e->src = s;
    e->dst = d;
    t->index[j] = e;
    return e;
}

/* ---- vCPUs ---- */
static inline struct vcpu *vcpu_get(unsigned int idx)
{
    struct vcpu **l2;
    if (idx >= VCPU_L1 * VCPU_L2) {
        return NULL;
    }
    l2 = vcpu_dir[idx / VCPU_L2];
    return l2 ? l2[idx % VCPU_L2] : NULL;
}

/* under the lock; false: the index is beyond the table */
static bool vcpu_put(unsigned int idx, struct vcpu *v)
{
    if (idx >= VCPU_L1 * VCPU_L2) {
        return false;
    }
    if (!vcpu_dir[idx / VCPU_L2]) {
        vcpu_dir[idx / VCPU_L2] = g_new0(struct vcpu *, VCPU_L2);
    }
    vcpu_dir[idx / VCPU_L2][idx % VCPU_L2] = v;
    return true;
}

static struct tb_cnt *cnt_slow(struct vcpu *v, uint32_t id)
{
    size_t p = id >> CNT_PAGE_BITS;
    if (p >= v->npages) {
        size_t n = MAX(MAX(p + 1, 2 * v->npages), 16);
        v->pages = g_renew(struct tb_cnt *, v->pages, n);
        memset(v->pages + v->npages, 0, (n - v->npages) * sizeof(*v->pages));
        v->npages = n;
    }
    if (!v->pages[p]) {
        v->pages[p] = g_new0(struct tb_cnt, CNT_PAGE);
    }
    return &v->pages[p][id & (CNT_PAGE - 1)];
}

/* this vCPU's counts of a block (threaded); pointers stay valid (pages never move) */
static inline struct tb_cnt *cnt_of(struct vcpu *v, uint32_t id)
{
    size_t p = id >> CNT_PAGE_BITS;
    if (__builtin_expect(p < v->npages && v->pages[p] != NULL, 1)) {
        return &v->pages[p][id & (CNT_PAGE - 1)];
    }
    return cnt_slow(v, id);
}

/*
 * Under the lock, when the second vCPU is created: only the creating vCPU exists
 * and it is inside a syscall (no guest code runs), so the inline counters are
 * exact here.  Keep each block's window executions so far; from now on the
 * vCPUs count.
 */
static void go_threaded(void)
{
    GHashTableIter it;
    gpointer k;
    g_hash_table_iter_init(&it, tbs);
    while (g_hash_table_iter_next(&it, &k, NULL)) {
        struct tb_rec *r = k;
        switch (roi_state) {
        case ROI_WAIT:
            r->pre = 0;
            break;
        case ROI_DONE:
            r->pre = r->end - r->base;
            break;
        default:
            r->pre = r->execs - r->base;
        }
    }
    __atomic_store_n(&threaded, true, __ATOMIC_SEQ_CST);
}

static void vcpu_init(qemu_plugin_id_t id, unsigned int idx)
{
    struct vcpu *v;
    g_mutex_lock(&lock);
    if (vcpus_created == 0) {
        vcpu_put(idx, &st0);
    } else {
        if (!threaded) {
            go_threaded();
        }
        v = vcpu_get(idx);
        if (!v) {
            v = g_new0(struct vcpu, 1);
            if (do_cache) {
                v->tags = new_tags((set_mask + 1) * cache_ways);
                v->l2tags = have_l2 ? new_tags((l2_set_mask + 1) * l2_ways) : NULL;
            }
            if (vcpu_put(idx, v)) {
                g_ptr_array_add(all_vcpus, v);
            } else {
                g_free(v->tags);
                g_free(v->l2tags);
                g_free(v);
                v = NULL;
            }
        }
        if (v) {   /* a new thread: no edge from, no line merged with, what ran before */
            v->last_tb = NULL;
            v->last_line = NO_LINE;
        }
    }
    vcpus_created++;
    vcpus_alive++;
    vcpus_peak = MAX(vcpus_peak, vcpus_alive);
    g_mutex_unlock(&lock);
}

static void vcpu_exit(qemu_plugin_id_t id, unsigned int idx)
{
    g_mutex_lock(&lock);
    if (vcpus_alive) {
        vcpus_alive--;
    }
    g_mutex_unlock(&lock);
}

/* ---- execution callbacks ---- */

/* threaded mode: one executed TB of the mode on vCPU ``vcpu`` */
static __attribute__((noinline)) void tb_exec_mt(unsigned int vcpu, struct tb_rec *r)
{
    struct vcpu *v = vcpu_get(vcpu);
    bool on = __atomic_load_n(&counting, __ATOMIC_RELAXED);
    struct tb_cnt *c;

    if (__builtin_expect(v == NULL, 0)) {
        __atomic_add_fetch(&dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    c = cnt_of(v, r->id);
    if (on) {
        c->execs++;
    }
    if (tbtrace) {      /* positions and the dump in one order */
        g_mutex_lock(&lock);
        if (counting) {
            struct { uint64_t va; uint32_t size, n; } t = { r->vaddr, r->size, r->ninsns };
            uint64_t pos = __atomic_add_fetch(&window_execs, 1, __ATOMIC_RELAXED);
            if (!r->first) {
                r->first = pos;
            }
            fwrite(&t, sizeof(t), 1, tbtrace);
        }
        g_mutex_unlock(&lock);
    } else if (on && record_first) {
        uint64_t pos = __atomic_add_fetch(&window_execs, 1, __ATOMIC_RELAXED);
        uint64_t cur = __atomic_load_n(&r->first, __ATOMIC_RELAXED);
        while ((cur == 0 || pos < cur) &&
               !__atomic_compare_exchange_n(&r->first, &cur, pos, true, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED)) {
        }
    }
    if (do_edges) {
        struct tb_rec *p = v->last_tb;
        if (p && on) {
            struct tb_cnt *pc = cnt_of(v, p->id);
            struct edge *e = pc->last_edge;
            if (!e || e->dst != r) {
                e = edge_get(&v->edges, p, r);
                pc->last_edge = e;
            }
            e->count++;
        }
        v->last_tb = r;
    }
    if (do_cache) {
        uint32_t i = r->lines[0] == v->last_line ? 1 : 0;
        uint64_t fetches = r->nlines - i, misses = 0;
        for (; i < r->nlines; i++) {
            misses += cache_access(v, r->lines[i]);
        }
        v->last_line = r->lines[r->nlines - 1];
        if (on) {
            c->fetches += fetches;
            c->misses += misses;
            v->fetches += fetches;
            v->misses += misses;
        }
    }
}

static void tb_exec(unsigned int vcpu, void *udata)
{
    struct tb_rec *r = udata;

    if (__builtin_expect(__atomic_load_n(&threaded, __ATOMIC_RELAXED), 0)) {
        tb_exec_mt(vcpu, r);
        return;
    }
    if (counting) {
        window_execs++;
        if (!r->first) {
            r->first = window_execs;
        }
    }
    if (do_edges) {
        struct tb_rec *p = st0.last_tb;
        if (p && counting) {
            struct edge *e = p->last_edge;
            if (!e || e->dst != r) {
                e = edge_get(&st0.edges, p, r);
                p->last_edge = e;
            }
            e->count++;
        }
        st0.last_tb = r;
    }
    if (do_cache) {
        uint32_t i = r->lines[0] == st0.last_line ? 1 : 0;
        uint64_t fetches = r->nlines - i, misses = 0;
        for (; i < r->nlines; i++) {
            misses += cache_access(&st0, r->lines[i]);
        }
        st0.last_line = r->lines[r->nlines - 1];
        if (counting) {
            r->fetches += fetches;
            r->misses += misses;
            st0.fetches += fetches;
            st0.misses += misses;
        }
    }
    if (tbtrace && counting) {
        struct { uint64_t va; uint32_t size, n; } t = { r->vaddr, r->size, r->ninsns };
        fwrite(&t, sizeof(t), 1, tbtrace);
    }
}

/* user mode without a per-TB helper (counts only): the inline counter counts until a
 * second vCPU appears, then this does */
static void tb_count(unsigned int vcpu, void *udata)
{
    if (__builtin_expect(__atomic_load_n(&threaded, __ATOMIC_RELAXED), 0)) {
        tb_exec_mt(vcpu, udata);
    }
}

/* a TB outside the mode ran: the next recorded edge would span a gap */
static void gap_exec(unsigned int vcpu, void *udata)
{
    if (__builtin_expect(__atomic_load_n(&threaded, __ATOMIC_RELAXED), 0)) {
        struct vcpu *v = vcpu_get(vcpu);
        if (v) {
            v->last_tb = NULL;
        }
        return;
    }
    st0.last_tb = NULL;
}

static void snapshot(bool at_start)
{
    GHashTableIter it;
    gpointer k;
    g_hash_table_iter_init(&it, tbs);
    while (g_hash_table_iter_next(&it, &k, NULL)) {
        struct tb_rec *r = k;
        if (at_start) {
            r->base = r->execs;
        } else {
            r->end = r->execs;
        }
    }
}

static void marker_exec(unsigned int vcpu, void *udata)
{
    uint64_t va = (uint64_t)(uintptr_t)udata;
    g_mutex_lock(&lock);
    if (roi_state == ROI_WAIT && have_start && va == roi_start) {
        if (++start_hits < start_count) {
            goto out;
        }
        if (!threaded) {
            snapshot(true);
            st0.last_tb = NULL;
        } else {       /* the vCPUs count from now on (the others approximately) */
            struct vcpu *v = vcpu_get(vcpu);
            if (v) {
                v->last_tb = NULL;
            }
        }
        roi_state = ROI_ACTIVE;
        __atomic_store_n(&counting, true, __ATOMIC_RELAXED);
    } else if (roi_state == ROI_ACTIVE && have_stop && va == roi_stop) {
        if (++stop_hits < stop_count) {
            goto out;
        }
        if (!threaded) {
            snapshot(false);
        }
        roi_state = ROI_DONE;
        __atomic_store_n(&counting, false, __ATOMIC_RELAXED);
    }
out:
    g_mutex_unlock(&lock);
}

/* ---- translation ---- */
static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    size_t n = qemu_plugin_tb_n_insns(tb);
    uint64_t va = qemu_plugin_tb_vaddr(tb);
    uint64_t end = va, prev = NO_LINE, *lines;
    uint32_t nlines = 0, last_size = 0, prev_size = 0;
    uint64_t prev_va = 0;
    bool crosses = false;
    struct tb_rec key, *r;
    size_t i, cap = 0;
    bool inline_count;

    if (n == 0) {
        return;
    }
    if (have_start || have_stop) {
        for (i = 0; i < n; i++) {
            struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
            uint64_t a = qemu_plugin_insn_vaddr(insn);
            if ((have_start && a == roi_start) || (have_stop && a == roi_stop)) {
                qemu_plugin_register_vcpu_insn_exec_cb(insn, marker_exec, QEMU_PLUGIN_CB_NO_REGS,
                                                       (void *)(uintptr_t)a);
            }
        }
    }
    if (!in_mode(va)) {
        if (do_edges && mode != MODE_ALL) {
            qemu_plugin_register_vcpu_tb_exec_cb(tb, gap_exec, QEMU_PLUGIN_CB_NO_REGS, NULL);
        }
        return;
    }

    for (i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        uint64_t a = qemu_plugin_insn_vaddr(insn), s = qemu_plugin_insn_size(insn);
        cap += ((a + (s ? s : 1) - 1) >> line_shift) - (a >> line_shift) + 1;
    }
    lines = g_new(uint64_t, cap);
    for (i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        uint64_t a = qemu_plugin_insn_vaddr(insn), s = qemu_plugin_insn_size(insn);
        uint64_t l, first = a >> line_shift, last = (a + (s ? s : 1) - 1) >> line_shift;
        for (l = first; l <= last; l++) {
            if (l != prev) {
                lines[nlines++] = l;
                prev = l;
            }
        }
        if (a + s > end) {
            end = a + s;
        }
        if (i + 2 == n) {
            prev_va = a;
            prev_size = (uint32_t)s;
        }
        if (i == n - 1) {
            key.last_insn = a;
            last_size = (uint32_t)s;
        }
        if (i == 0) {
            crosses = ((a ^ (a + s - 1)) & ~(PAGE_SIZE - 1)) != 0;
        }
    }

    key.vaddr = va;
    key.size = (uint32_t)(end - va);
    key.ninsns = (uint32_t)n;

    g_mutex_lock(&lock);
    translations++;
    r = g_hash_table_lookup(tbs, &key);
    if (!r) {
        r = g_malloc0(sizeof(*r) + nlines * sizeof(uint64_t));
        r->vaddr = va;
        r->size = key.size;
        r->ninsns = key.ninsns;
        r->last_insn = key.last_insn;
        r->last_insn_size = last_size;
        r->nlines = nlines;
        r->prev_insn = prev_va;
        r->prev_insn_size = prev_size;
        r->first_crosses = crosses;
        r->id = tb_by_id->len;
        memcpy(r->lines, lines, nlines * sizeof(uint64_t));
        g_hash_table_add(tbs, r);
        g_ptr_array_add(tb_by_id, r);
    }
    inline_count = !threaded;       /* threaded: the vCPUs count in the helper */
    g_mutex_unlock(&lock);
    g_free(lines);

    if (inline_count) {
        qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &r->execs, 1);
    }
    if (record_first) {
        qemu_plugin_register_vcpu_tb_exec_cb(tb, tb_exec, QEMU_PLUGIN_CB_NO_REGS, r);
    } else if (!system_emulation) {  /* a second thread may come: it needs a helper */
        qemu_plugin_register_vcpu_tb_exec_cb(tb, tb_count, QEMU_PLUGIN_CB_NO_REGS, r);
    }
}

/* ---- output ---- */
static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static int cmp_tb(const void *a, const void *b)
{
    const struct tb_rec *x = *(struct tb_rec *const *)a, *y = *(struct tb_rec *const *)b;
    if (x->vaddr != y->vaddr) {
        return x->vaddr < y->vaddr ? -1 : 1;
    }
    if (x->out_size != y->out_size) {
        return x->out_size < y->out_size ? -1 : 1;
    }
    return x->out_ninsns < y->out_ninsns ? -1 : x->out_ninsns > y->out_ninsns;
}

struct edge_out {
    uint64_t src, dst, count;
    uint32_t src_size, flags;
};

static int cmp_edge(const void *a, const void *b)
{
    const struct edge_out *x = a, *y = b;
    if (x->src != y->src) {
        return x->src < y->src ? -1 : 1;
    }
    return x->dst < y->dst ? -1 : x->dst > y->dst;
}

static uint64_t execs_out(const struct tb_rec *r)
{
    if (threaded) {
        return r->pre + r->mt_execs;
    }
    switch (roi_state) {
    case ROI_WAIT:
        return 0;
    case ROI_DONE:
        return r->end - r->base;
    default:
        return r->execs - r->base;
    }
}

/*
 * QEMU 7.2 quirk: when the i386 translator meets an instruction that crosses a
 * page boundary after the first instruction of a block, it ends the block
 * before it, but the plugin API still lists that instruction as the block's
 * last one, with only the bytes read before the translator gave up (a prefix
 * of it).  The instruction then starts a block of its own, as its first
 * instruction, with its full size.  A block's last instruction (not its first)
 * can never really cross a page, so: a last instruction at an address where a
 * block starts whose first instruction crosses a page is a phantom, and is dropped from
 * the output view (instruction count, size, branch source).  The line list
 * replayed at run time kept the phantom's bytes, which lie in the line where
 * the next block (the real instruction) starts, so the fetch sequence is
 * unchanged (merged repeat).  A phantom whose real instruction never ran as a
 * block (an exception on the second page) stays.
 * Returns the number of records fixed.
 */
static uint64_t fix_phantoms(struct tb_rec **v, size_t ntb)
{
    GHashTable *crossing = g_hash_table_new(g_int64_hash, g_int64_equal);
    uint64_t fixed = 0;
    size_t i;

    for (i = 0; i < ntb; i++) {
        v[i]->out_size = v[i]->size;
        v[i]->out_ninsns = v[i]->ninsns;
        v[i]->out_last = v[i]->last_insn;
        v[i]->out_last_size = v[i]->last_insn_size;
        if (v[i]->first_crosses) {
            g_hash_table_add(crossing, &v[i]->vaddr);
        }
    }
    for (i = 0; i < ntb; i++) {
        struct tb_rec *r = v[i];
        if (r->ninsns >= 2 && g_hash_table_contains(crossing, &r->last_insn)) {
            r->out_ninsns = r->ninsns - 1;
            r->out_size = (uint32_t)(r->last_insn - r->vaddr);
            r->out_last = r->prev_insn;
            r->out_last_size = r->prev_insn_size;
            fixed++;
        }
    }
    g_hash_table_destroy(crossing);
    return fixed;
}

/* threaded: add up the vCPUs' counts into the blocks and the totals */
static void sum_vcpus(uint64_t *fetches, uint64_t *misses)
{
    *fetches = *misses = 0;
    for (guint k = 0; k < all_vcpus->len; k++) {
        struct vcpu *v = g_ptr_array_index(all_vcpus, k);
        *fetches += v->fetches;
        *misses += v->misses;
        if (!threaded) {
            continue;
        }
        for (size_t p = 0; p < v->npages; p++) {
            if (!v->pages[p]) {
                continue;
            }
            for (size_t j = 0; j < CNT_PAGE; j++) {
                size_t id = p * CNT_PAGE + j;
                const struct tb_cnt *c = &v->pages[p][j];
                struct tb_rec *r;
                if (id >= tb_by_id->len) {
                    break;
                }
                r = g_ptr_array_index(tb_by_id, id);
                r->mt_execs += c->execs;
                r->fetches += c->fetches;
                r->misses += c->misses;
            }
        }
    }
}

static void write_output(void)
{
    size_t ntb = g_hash_table_size(tbs), i, ne = 0, n_edges = 0;
    struct tb_rec **v = g_new(struct tb_rec *, ntb ? ntb : 1);
    struct edge_out *eo;
    unsigned char hdr[HDR_SIZE] = { 0 }, rec[TB_REC_SIZE];
    GHashTableIter it;
    gpointer k;
    char *tmp = g_strdup_printf("%s.tmp.%d", out_path, (int)getpid());
    FILE *f;
    uint32_t flags = 0;

    uint64_t phantoms, total_fetches, total_misses;
    size_t nout = 0;

    sum_vcpus(&total_fetches, &total_misses);
    for (guint k = 0; k < all_vcpus->len; k++) {
        n_edges += ((struct vcpu *)g_ptr_array_index(all_vcpus, k))->edges.n;
    }
    eo = g_new(struct edge_out, n_edges ? n_edges : 1);
    i = 0;
    g_hash_table_iter_init(&it, tbs);
    while (g_hash_table_iter_next(&it, &k, NULL)) {
        v[i++] = k;
    }
    phantoms = fix_phantoms(v, ntb);
    qsort(v, ntb, sizeof(*v), cmp_tb);
    /* records equal in the output view are written once, summed */
    for (i = 0; i < ntb; i++) {
        if (i == 0 || cmp_tb(&v[i - 1], &v[i]) != 0) {
            nout++;
        }
    }

    for (guint k = 0; k < all_vcpus->len; k++) {
        const struct edge_tab *t = &((struct vcpu *)g_ptr_array_index(all_vcpus, k))->edges;
        for (i = 0; i < t->n; i++) {
            struct edge *e = &t->chunks[i / EDGE_CHUNK][i % EDGE_CHUNK];
            if (!e->count) {
                continue;
            }
            eo[ne].src = e->src->out_last;
            eo[ne].dst = e->dst->vaddr;
            eo[ne].count = e->count;
            eo[ne].src_size = e->src->out_last_size;
            eo[ne].flags = e->dst->vaddr == e->src->vaddr + e->src->out_size ? 1 : 0;
            ne++;
        }
    }
    qsort(eo, ne, sizeof(*eo), cmp_edge);
    if (ne) {   /* merge records of different source TBs (or vCPUs) ending at one instruction */
        size_t w = 0;
        for (i = 1; i < ne; i++) {
            if (eo[i].src == eo[w].src && eo[i].dst == eo[w].dst) {
                eo[w].count += eo[i].count;
                eo[w].flags |= eo[i].flags;
            } else {
                eo[++w] = eo[i];
            }
        }
        ne = w + 1;
    }

    flags |= do_cache ? 1 : 0;
    flags |= do_edges ? 2 : 0;
    flags |= have_start ? 4 : 0;
    flags |= have_stop ? 8 : 0;
    flags |= roi_state != ROI_WAIT ? 16 : 0;
    flags |= roi_state == ROI_DONE ? 32 : 0;
    flags |= system_emulation ? 64 : 0;
    flags |= threaded ? FLAG_THREADS : 0;
    flags |= (threaded && (have_start || have_stop)) || dropped ? FLAG_APPROX : 0;
    memcpy(hdr, "LPKTRACE", 8);
    put32(hdr + 8, OUT_VERSION);
    put32(hdr + 12, HDR_SIZE);
    put32(hdr + 16, TB_REC_SIZE);
    put32(hdr + 20, EDGE_REC_SIZE);
    put32(hdr + 24, flags);
    put32(hdr + 28, mode);
    put32(hdr + 32, (uint32_t)cache_size);
    put32(hdr + 36, (uint32_t)cache_ways);
    put32(hdr + 40, (uint32_t)line_size);
    put32(hdr + 44, (do_prefetch ? 1u : 0u) | (have_l2 ? 2u : 0u));
    put64(hdr + 48, nout);
    put64(hdr + 56, ne);
    put64(hdr + 64, total_fetches);
    put64(hdr + 72, total_misses);
    put64(hdr + 80, roi_start);
    put64(hdr + 88, roi_stop);
    put64(hdr + 96, translations);
    put64(hdr + 104, phantoms);
    put64(hdr + 112, start_count);
    put64(hdr + 120, stop_count);
    put64(hdr + 128, vcpus_created);
    put64(hdr + 136, vcpus_peak);

    f = fopen(tmp, "wb");
    if (!f) {
        fprintf(stderr, "linepack plugin: cannot write %s: %s\n", tmp, strerror(errno));
        goto out;
    }
    fwrite(hdr, 1, HDR_SIZE, f);
    for (i = 0; i < ntb;) {
        const struct tb_rec *r = v[i];
        uint64_t execs = 0, fetches = 0, misses = 0, first = 0;
        size_t j;
        for (j = i; j < ntb && cmp_tb(&v[i], &v[j]) == 0; j++) {
            execs += execs_out(v[j]);
            fetches += v[j]->fetches;
            misses += v[j]->misses;
            if (v[j]->first && (!first || v[j]->first < first)) {
                first = v[j]->first;
            }
        }
        put64(rec, r->vaddr);
        put32(rec + 8, r->out_size);
        put32(rec + 12, r->out_ninsns);
        put64(rec + 16, execs);
        put64(rec + 24, fetches);
        put64(rec + 32, misses);
        put64(rec + 40, first ? first - 1 : UINT64_MAX);
        fwrite(rec, 1, TB_REC_SIZE, f);
        i = j;
    }
    for (i = 0; i < ne; i++) {
        unsigned char er[EDGE_REC_SIZE];
        put64(er, eo[i].src);
        put64(er + 8, eo[i].dst);
        put64(er + 16, eo[i].count);
        put32(er + 24, eo[i].src_size);
        put32(er + 28, eo[i].flags);
        fwrite(er, 1, EDGE_REC_SIZE, f);
    }
    if (fflush(f) != 0 || ferror(f) || fsync(fileno(f)) != 0) {
        fprintf(stderr, "linepack plugin: error writing %s: %s\n", tmp, strerror(errno));
        fclose(f);
        unlink(tmp);
        goto out;
    }
    fclose(f);
    if (rename(tmp, out_path) != 0) {
        fprintf(stderr, "linepack plugin: cannot rename %s to %s: %s\n", tmp, out_path,
                strerror(errno));
        unlink(tmp);
    }
out:
    g_free(tmp);
    g_free(v);
    g_free(eo);
}

static void at_exit(qemu_plugin_id_t id, void *p)
{
    if (getpid() != plugin_pid) {
        return;     /* a fork() child: the process that loaded the plugin writes the profile */
    }
    g_mutex_lock(&lock);
    if (tbtrace) {
        fclose(tbtrace);
        tbtrace = NULL;
    }
    write_output();
    g_mutex_unlock(&lock);
}

/* ---- arguments ---- */
static bool parse_u64(const char *val, uint64_t *ret)
{
    char *end;
    errno = 0;
    if (!*val || *val == '-') {
        return false;
    }
    *ret = strtoull(val, &end, 0);
    return errno == 0 && *end == '\0';
}

static bool is_pow2(uint64_t v)
{
    return v && !(v & (v - 1));
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                           int argc, char **argv)
{
    char msg[512];
    uint64_t sets;

    for (int i = 0; i < argc; i++) {
        char *opt = argv[i], *eq = strchr(opt, '=');
        g_autofree char *name = eq ? g_strndup(opt, eq - opt) : g_strdup(opt);
        const char *val = eq ? eq + 1 : "";
        bool ok = true;

        if (!strcmp(name, "out")) {
            ok = *val != '\0';
            out_path = g_strdup(val);
        } else if (!strcmp(name, "tbtrace")) {
            ok = *val != '\0';
            tbtrace_path = g_strdup(val);
        } else if (!strcmp(name, "mode")) {
            if (!strcmp(val, "kernel")) {
                mode = MODE_KERNEL;
            } else if (!strcmp(val, "user")) {
                mode = MODE_USER;
            } else if (!strcmp(val, "all")) {
                mode = MODE_ALL;
            } else {
                ok = false;
            }
        } else if (!strcmp(name, "cache")) {
            ok = qemu_plugin_bool_parse(name, val, &do_cache);
        } else if (!strcmp(name, "edges")) {
            ok = qemu_plugin_bool_parse(name, val, &do_edges);
        } else if (!strcmp(name, "size")) {
            ok = parse_u64(val, &cache_size);
        } else if (!strcmp(name, "ways")) {
            ok = parse_u64(val, &cache_ways);
        } else if (!strcmp(name, "line")) {
            ok = parse_u64(val, &line_size);
        } else if (!strcmp(name, "prefetch")) {
            ok = qemu_plugin_bool_parse(name, val, &do_prefetch);
        } else if (!strcmp(name, "l2size")) {
            ok = parse_u64(val, &l2_size);
        } else if (!strcmp(name, "l2ways")) {
            ok = parse_u64(val, &l2_ways);
        } else if (!strcmp(name, "start")) {
            ok = parse_u64(val, &roi_start);
            have_start = true;
        } else if (!strcmp(name, "stop")) {
            ok = parse_u64(val, &roi_stop);
            have_stop = true;
        } else if (!strcmp(name, "start_count")) {
            ok = parse_u64(val, &start_count) && start_count > 0;
        } else if (!strcmp(name, "stop_count")) {
            ok = parse_u64(val, &stop_count) && stop_count > 0;
        } else {
            snprintf(msg, sizeof(msg), "unknown argument '%s' (known: out, mode, cache, size, "
                     "ways, line, prefetch, l2size, l2ways, edges, start, stop, start_count, "
                     "stop_count, tbtrace)", opt);
            die(msg);
            return -1;
        }
        if (!ok) {
            snprintf(msg, sizeof(msg), "bad value in '%s'", opt);
            die(msg);
            return -1;
        }
    }
    if (!out_path) {
        die("missing out=<path>");
        return -1;
    }
    if (!is_pow2(line_size) || line_size > (1ULL << 21)) {
        die("line= must be a power of two <= 2097152");
        return -1;
    }
    if (cache_ways < 1 || cache_ways > 64 || cache_size == 0 || cache_size > (1ULL << 31) ||
        cache_size % (cache_ways * line_size) != 0 ||
        !is_pow2(sets = cache_size / (cache_ways * line_size))) {
        die("cache geometry: size/(ways*line) must be a power of two, ways 1..64");
        return -1;
    }
    if (l2_size) {
        uint64_t l2_sets;
        if (l2_ways < 1 || l2_ways > 64 || l2_size > (1ULL << 31) ||
            l2_size % (l2_ways * line_size) != 0 ||
            !is_pow2(l2_sets = l2_size / (l2_ways * line_size))) {
            die("L2 geometry: l2size/(l2ways*line) must be a power of two, l2ways 1..64");
            return -1;
        }
        if (do_prefetch) {
            die("prefetch=on and l2size= cannot be combined (prefetches would bypass the L2)");
            return -1;
        }
        l2_set_mask = l2_sets - 1;
        have_l2 = true;
        st0.l2tags = new_tags(l2_sets * l2_ways);
    }
    system_emulation = info->system_emulation;
    if (info->system_emulation && info->system.max_vcpus > 1) {
        die("needs a single vCPU (-smp 1): counters are not per-vCPU");
        return -1;
    }

    line_shift = (unsigned)__builtin_ctzll(line_size);
    set_mask = sets - 1;
    st0.tags = new_tags(sets * cache_ways);
    record_first = do_cache || do_edges || tbtrace_path;
    plugin_pid = getpid();
    if (have_start) {
        roi_state = ROI_WAIT;
        counting = false;
    }
    if (tbtrace_path) {
        tbtrace = fopen(tbtrace_path, "wb");
        if (!tbtrace) {
            snprintf(msg, sizeof(msg), "cannot open tbtrace=%s: %s", tbtrace_path, strerror(errno));
            die(msg);
            return -1;
        }
        setvbuf(tbtrace, NULL, _IOFBF, 1 << 20);
    }
    tbs = g_hash_table_new(tb_hash, tb_equal);
    tb_by_id = g_ptr_array_new();
    all_vcpus = g_ptr_array_new();
    g_ptr_array_add(all_vcpus, &st0);

    qemu_plugin_register_vcpu_init_cb(id, vcpu_init);
    qemu_plugin_register_vcpu_exit_cb(id, vcpu_exit);
    qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
