/* The expert tiers of an engine: mode, budgets, device, warm restart (expert_tiers.h). */
#include "engine/expert_tiers.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "common/log.h"
#include "engine/backend_sim.h"
#include "engine/mem_plan.h"

#define MIB 1048576.0

int md_expert_device_parse(const char *spec, struct md_expert_device *out, char *err,
			   size_t errlen)
{
	memset(out, 0, sizeof(*out));
	if (!spec || !spec[0] || strcmp(spec, "auto") == 0) {
		out->kind = MD_XDEV_AUTO;
		return 0;
	}
	if (strcmp(spec, "none") == 0) {
		out->kind = MD_XDEV_NONE;
		return 0;
	}
	if (strcmp(spec, "cuda") == 0) {
		out->kind = MD_XDEV_CUDA;
		return 0;
	}
	if (strncmp(spec, "sim", 3) == 0 && (spec[3] == 0 || spec[3] == ':')) {
		out->kind = MD_XDEV_SIM;
		const char *p = spec + 3;
		double *rate[2] = { &out->sim_copy_bps, &out->sim_compute_bps };
		for (int i = 0; i < 2 && *p == ':'; i++) {
			char *end;
			double v = strtod(p + 1, &end);
			if (end == p + 1 || v < 0 || (*end && *end != ':'))
				goto bad;
			*rate[i] = v * 1e6;
			p = end;
		}
		if (*p == 0)
			return 0;
	}
bad:
	snprintf(err, errlen, "must be auto, none, cuda or sim[:COPY_MBPS[:COMPUTE_MBPS]]");
	return -EINVAL;
}

/* Whether t is one of the layers' routed-expert tensors (read by the store, not mapped). */
static bool is_expert_tensor(const struct md_model *m, const struct md_tensor *t)
{
	for (uint32_t l = 0; l < m->hp.n_layer; l++) {
		const struct md_layer *L = &m->layers[l];
		if (t == L->gate_exps || t == L->up_exps || t == L->down_exps)
			return true;
	}
	return false;
}

/* Store mode: page in (and lock where the limit allows) only the dense weights; the routed
 * experts' pages of the mapping are never touched. */
static void populate_dense(const struct md_model *m)
{
	const uintptr_t pg = 4096, base = (uintptr_t)m->gguf.base;
	uint64_t bytes = 0;
	bool locked = true;
	for (size_t i = 0; i < m->n_tensors; i++) {
		const struct md_tensor *t = &m->tensors[i];
		uintptr_t a = (uintptr_t)t->data, z = a + t->nb2 * (size_t)(t->ne[2] * t->ne[3]);
		if (is_expert_tensor(m, t) || a < base || z > base + m->gguf.size)
			continue; /* experts, or converted into the model's own buffers */
		a &= ~(pg - 1);
		z = (z + pg - 1) & ~(pg - 1);
		if (locked && mlock((void *)a, z - a) != 0)
			locked = false;
#ifdef MADV_POPULATE_READ
		if (!locked)
			madvise((void *)a, z - a, MADV_POPULATE_READ);
#endif
		bytes += z - a;
	}
	md_log(MD_LOG_INFO, "dense weights %.1f MiB paged in%s", bytes / MIB,
	       locked ? " and locked" : " (not locked: RLIMIT_MEMLOCK)");
}

/* Mapping mode with a file that fits (md_mem_plan.populate): page the whole file in now, so
 * that no request waits on a page fault behind the read-ahead MADV_WILLNEED started. Where
 * MADV_POPULATE_READ is missing (kernels before 5.14), one read per page does the same. */
static void populate_all(const struct md_model *m)
{
	const size_t pg = 4096;
	uintptr_t a = (uintptr_t)m->gguf.base & ~(uintptr_t)(pg - 1);
	size_t len = (size_t)((uintptr_t)m->gguf.base + m->gguf.size - a);
	if (!m->gguf.base || len == 0)
		return;
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int rc = -1;
#ifdef MADV_POPULATE_READ
	rc = madvise((void *)a, len, MADV_POPULATE_READ);
#endif
	if (rc != 0) {
		volatile const uint8_t *p = (const uint8_t *)a;
		uint8_t sum = 0;
		for (size_t off = 0; off < len; off += pg)
			sum ^= p[off];
		(void)sum;
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	md_log(MD_LOG_INFO, "the whole file paged in: %.0f MiB in %.2f s", len / MIB,
	       (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
}

/* Queue reads of the experts the last clean shutdown found hot. */
static void warm_start(struct md_expert_tiers *t)
{
	uint32_t n = 0;
	if (!t->hot_path[0])
		return;
	int rc = md_expert_store_warm(t->store, t->hot_path, &n);
	if (rc == -ENOENT)
		md_log(MD_LOG_INFO, "experts: no hot set in '%s' yet (cold start)", t->hot_path);
	else if (rc)
		md_log(MD_LOG_WARN, "experts: hot set '%s' not used: %s", t->hot_path,
		       rc == -EINVAL ? "another model's, or malformed" : strerror(-rc));
	else
		md_log(MD_LOG_INFO, "experts: warm start, reading %u hot experts from '%s'", n,
		       t->hot_path);
}

void md_expert_tiers_save(struct md_expert_tiers *t)
{
	if (!t->store || !t->hot_path[0])
		return;
	int rc = md_expert_store_save(t->store, t->hot_path);
	if (rc)
		md_log(MD_LOG_ERROR, "experts: cannot write the hot set '%s': %s (any previous one "
		       "is kept as it was; the next start may be colder)", t->hot_path, strerror(-rc));
	else
		md_log(MD_LOG_INFO, "experts: hot set written to '%s'", t->hot_path);
}

/* The device of the device tier (c->device_mb > 0), or NULL with the reason logged: none
 * asked for, none present, or the store is off. */
static struct md_backend *pick_device(struct md_expert_tiers *t,
				      const struct md_expert_tiers_config *c,
				      const struct md_expert_device *d)
{
	if (c->device_mb <= 0 || d->kind == MD_XDEV_NONE)
		return NULL;
	if (c->cache_mb < 0 && !c->dev) {
		md_log(MD_LOG_WARN, "device-expert-mb %lld ignored: the device tier goes through "
		       "the expert store, which expert-cache-mb -1 turns off",
		       (long long)c->device_mb);
		return NULL;
	}
	if (c->dev)
		return c->dev;
	if (d->kind == MD_XDEV_SIM) {
		/* capacity: the budget (rounding to slots never asks for more) */
		struct md_backend *b = md_backend_sim_new((size_t)c->device_mb << 20, 0);
		if (b) {
			md_backend_sim_set_rates(b, d->sim_copy_bps, d->sim_compute_bps);
			t->dev_owned = true;
		}
		return b;
	}
	struct md_backend *b = md_backend_cuda();
	if (!b)
		md_log(d->kind == MD_XDEV_CUDA ? MD_LOG_WARN : MD_LOG_INFO,
		       "device-expert-mb %lld ignored: no CUDA device (%s)", (long long)c->device_mb,
		       md_backend_cuda_error());
	return b;
}

int md_expert_tiers_init(struct md_expert_tiers *t, const struct md_model *m,
			 const struct md_expert_tiers_config *c, char *err, size_t errlen)
{
	memset(t, 0, sizeof(*t));
	t->kv_bytes = c->kv_bytes;
	enum md_epol_kind pol = MD_EPOL_PRED;
	if (c->policy && md_epol_parse(c->policy, &pol)) {
		snprintf(err, errlen, "unknown expert-policy '%s'", c->policy);
		return -EINVAL;
	}
	struct md_expert_device dv;
	if (md_expert_device_parse(c->device, &dv, err, errlen)) {
		char why[200];
		snprintf(why, sizeof(why), "%s", err);
		snprintf(err, errlen, "expert-device '%s': %s", c->device, why);
		return -EINVAL;
	}
	if (c->state_dir && c->state_dir[0])
		snprintf(t->hot_path, sizeof(t->hot_path), "%s/hot-experts", c->state_dir);
	struct md_backend *dev = pick_device(t, c, &dv);
	t->dev = dev;
	struct md_mem_limit lim;
	md_mem_limit_read(&lim, NULL);
	struct md_mem_plan_in in = {
		.limit = lim.bytes,
		.file_bytes = m->gguf.size,
		.expert_bytes = md_expert_store_expert_bytes(m),
		.kv_bytes = c->kv_bytes,
		.kv_min = c->kv_min,
		.min_cache = md_expert_store_min_bytes(m, (int)c->step_tokens),
		.cache_mb = c->cache_mb,
		.device = dev != NULL,
	};
	struct md_mem_plan plan;
	md_mem_plan_make(&in, &plan);
	if (plan.refuse) {
		snprintf(err, errlen, "within the memory limit (%s): %s", lim.source, plan.why);
		md_expert_tiers_release(t);
		t->refused = true;
		return -ENOMEM;
	}
	t->kv_bytes = plan.kv_bytes;
	if (!plan.store) {
		md_log(MD_LOG_INFO, "experts: mmap (the whole file mapped), limit %.0f MiB (%s): %s",
		       lim.bytes / MIB, lim.bytes ? lim.source : "unknown", plan.why);
		if (plan.populate)
			populate_all(m);
		return 0;
	}
	t->kv_bytes = plan.kv_bytes;
	struct md_expert_store_config sc = {
		.host_bytes = plan.cache_bytes,
		.policy = pol,
		.max_tokens = (int)c->step_tokens,
		.prefetch = c->prefetch,
		.dev = dev,
		.dev_bytes = dev ? (size_t)c->device_mb << 20 : 0,
	};
	char serr[400];
	int rc = md_expert_store_new(&t->store, m, &sc, serr, sizeof(serr));
	if (rc) {
		snprintf(err, errlen, "cannot set up the expert store: %s", serr);
		md_expert_tiers_release(t);
		return rc;
	}
	warm_start(t);
	uint32_t n_fill = c->fill ? md_expert_store_fill(t->store) : 0;
	if (n_fill)
		md_log(MD_LOG_INFO, "experts: filling the cache, reading %u experts ahead of the "
		       "first requests", n_fill);
	struct md_expert_store_stats st;
	md_expert_store_get_stats(t->store, &st);
	char dline[512] = "";
	if (dev) {
		struct md_backend_device info;
		if (dev->device_info(dev, 0, &info))
			snprintf(info.name, sizeof(info.name), "%s", dev->name);
		snprintf(dline, sizeof(dline), ", device tier %.0f MiB on %.200s (%u experts, copies "
			 "measured at %.2f GB/s)", st.dev_mem_bytes / MIB, info.name, st.dev_slots,
			 st.dev_up_bps / 1e9);
	}
	md_log(MD_LOG_INFO, "experts: store, host cache %.0f MiB (%u of %u experts, %.2f MiB "
	       "each, %s reads)%s, policy %s, prefetch %s, KV %.0f MiB, limit %.0f MiB (%s): %s",
	       plan.cache_bytes / MIB, st.n_slots,
	       (m->hp.n_layer - m->hp.n_layer_dense_lead) * m->hp.n_expert, /* dense layers: none */
	       st.slot_bytes / MIB, st.direct ? "O_DIRECT" : "buffered", dline, md_epol_name(pol),
	       c->prefetch ? "on" : "off", plan.kv_bytes / MIB, lim.bytes / MIB,
	       lim.bytes ? lim.source : "unknown", plan.why);
	populate_dense(m);
	return 0;
}

void md_expert_tiers_release(struct md_expert_tiers *t)
{
	md_expert_store_free(t->store);
	t->store = NULL;
	if (t->dev_owned)
		md_backend_sim_free(t->dev);
	t->dev = NULL;
	t->dev_owned = false;
}
