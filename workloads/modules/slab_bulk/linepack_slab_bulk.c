// SPDX-License-Identifier: GPL-2.0
/*
 * linepack_slab_bulk: the slab bulk alloc/free microbenchmark as a kernel
 * module, driven from user space so that a workload's ROI markers bracket it.
 *
 * Loading creates a kmem_cache of 256-byte objects and /proc/linepack_slab_bulk.
 * Each write(2) to that file runs one round: for each bulk size in
 * bulk_sizes (1, 8, 32, 128), kmem_cache_alloc_bulk() that many objects,
 * write one word into each, and kmem_cache_free_bulk() them, `repeat` times
 * (module parameter, default 4). Bulk sizes above the per-CPU slab's free
 * objects make SLUB refill from partial slabs and the page allocator, so the
 * round covers the fast path and the slow path. A read returns
 * "rounds=R objects=N failures=F\n": counts only, identical on every run.
 */
#include <linux/module.h>
#include <linux/proc_fs.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#define MAX_BULK 128

static unsigned int repeat = 4;
module_param(repeat, uint, 0444);
MODULE_PARM_DESC(repeat, "alloc/free passes over the bulk sizes per write");

static const unsigned int bulk_sizes[] = { 1, 8, 32, MAX_BULK };

static struct kmem_cache *bulk_cache;
static struct proc_dir_entry *proc_entry;
static void *objs[MAX_BULK];
static u64 rounds, objects, failures;
static DEFINE_MUTEX(bulk_lock);

static void bulk_round(void)
{
	unsigned int r, s, i;

	for (r = 0; r < repeat; r++) {
		for (s = 0; s < ARRAY_SIZE(bulk_sizes); s++) {
			unsigned int n = bulk_sizes[s];
			int got = kmem_cache_alloc_bulk(bulk_cache, GFP_KERNEL, n, objs);

			if (got != n) {
				failures++;
				continue;
			}
			for (i = 0; i < n; i++)
				*(unsigned long *)objs[i] = i;
			objects += n;
			kmem_cache_free_bulk(bulk_cache, n, objs);
		}
	}
	rounds++;
}

static ssize_t bulk_write(struct file *file, const char __user *buf, size_t len, loff_t *pos)
{
	mutex_lock(&bulk_lock);
	bulk_round();
	mutex_unlock(&bulk_lock);
	return len;
}

static ssize_t bulk_read(struct file *file, char __user *buf, size_t len, loff_t *pos)
{
	char text[96];
	int n;

	mutex_lock(&bulk_lock);
	n = scnprintf(text, sizeof(text), "rounds=%llu objects=%llu failures=%llu\n",
		      rounds, objects, failures);
	mutex_unlock(&bulk_lock);
	return simple_read_from_buffer(buf, len, pos, text, n);
}

static const struct proc_ops bulk_ops = {
	.proc_write = bulk_write,
	.proc_read = bulk_read,
	.proc_lseek = default_llseek,
};

static int __init bulk_init(void)
{
	bulk_cache = kmem_cache_create("linepack_bulk", 256, 0, SLAB_HWCACHE_ALIGN, NULL);
	if (!bulk_cache)
		return -ENOMEM;
	proc_entry = proc_create("linepack_slab_bulk", 0600, NULL, &bulk_ops);
	if (!proc_entry) {
		kmem_cache_destroy(bulk_cache);
		return -ENOMEM;
	}
	return 0;
}

static void __exit bulk_exit(void)
{
	proc_remove(proc_entry);
	kmem_cache_destroy(bulk_cache);
}

module_init(bulk_init);
module_exit(bulk_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("linepack workload: slab bulk alloc/free rounds, one per write");
