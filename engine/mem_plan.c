/* The start-up memory plan (mem_plan.h). */
#include "engine/mem_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1024.0 * 1024.0)
/* cgroup v1 writes "no limit" as a page-rounded 2^63 - 1; anything this large is none. */
#define NO_LIMIT ((uint64_t)1 << 60)
/* The least of a limit kept for the process itself when the experts go through the store. */
#define RESERVE ((uint64_t)32 << 20)

static bool read_u64(const char *path, uint64_t *out)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return false;
	char buf[64] = "";
	bool ok = fgets(buf, sizeof(buf), f) != NULL;
	fclose(f);
	if (!ok || strncmp(buf, "max", 3) == 0)
		return false;
	char *end;
	unsigned long long v = strtoull(buf, &end, 10);
	if (end == buf)
		return false;
	*out = (uint64_t)v;
	return true;
}

/* The tightest limit in file `name` of dir/path and its ancestors. */
static bool tightest(const char *dir, const char *path, const char *name, uint64_t *out)
{
	char p[1024], f[1200];
	snprintf(p, sizeof(p), "%s", path);
	bool any = false;
	for (;;) {
		uint64_t v;
		snprintf(f, sizeof(f), "%s%s/%s", dir, strcmp(p, "/") == 0 ? "" : p, name);
		if (read_u64(f, &v) && v < NO_LIMIT && (!any || v < *out)) {
			*out = v;
			any = true;
		}
		char *slash = strrchr(p, '/');
		if (!slash || strcmp(p, "/") == 0)
			break;
		if (slash == p)
			p[1] = 0;
		else
			*slash = 0;
	}
	return any;
}

void md_mem_limit_read(struct md_mem_limit *out, const char *root)
{
	memset(out, 0, sizeof(*out));
	if (!root)
		root = "";
	char path[1400];
	uint64_t lim = 0;
	snprintf(path, sizeof(path), "%s/proc/self/cgroup", root);
	FILE *f = fopen(path, "r");
	char line[1024];
	while (f && fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = 0;
		char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
		if (!c2)
			continue;
		*c2 = 0;
		const char *ctl = c1 + 1, *cg = c2 + 1;
		if (*ctl == 0) { /* v2: pure, or the hybrid "unified" mount */
			const char *dirs[2] = { "/sys/fs/cgroup", "/sys/fs/cgroup/unified" };
			for (int i = 0; i < 2; i++) {
				char d[1200];
				snprintf(d, sizeof(d), "%s%s", root, dirs[i]);
				if (tightest(d, cg, "memory.max", &lim) &&
				    (!out->bytes || lim < out->bytes)) {
					out->bytes = lim;
					snprintf(out->source, sizeof(out->source), "cgroup v2 %.80s", cg);
				}
			}
		} else if (strstr(ctl, "memory")) {
			char d[1200];
			snprintf(d, sizeof(d), "%s/sys/fs/cgroup/memory", root);
			if (tightest(d, cg, "memory.limit_in_bytes", &lim) &&
			    (!out->bytes || lim < out->bytes)) {
				out->bytes = lim;
				snprintf(out->source, sizeof(out->source), "cgroup v1 %.80s", cg);
			}
		}
	}
	if (f)
		fclose(f);
	snprintf(path, sizeof(path), "%s/proc/meminfo", root);
	f = fopen(path, "r");
	unsigned long long kb;
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1 &&
		    (!out->bytes || kb * 1024 < out->bytes)) {
			out->bytes = kb * 1024;
			snprintf(out->source, sizeof(out->source), "MemAvailable");
		}
	if (f)
		fclose(f);
}

/* The reserve kept below a limit for the process itself: a tenth, at least RESERVE. */
static uint64_t reserve_of(uint64_t limit)
{
	return limit / 10 > RESERVE ? limit / 10 : RESERVE;
}

/* With the whole file mapped its pages can always be dropped and read again; the KV pool is
 * anonymous and cannot. Keep it below the limit less the reserve (never below one context),
 * and refuse when even one context does not fit. Appends what it did to out->why. */
static void cap_kv(const struct md_mem_plan_in *in, struct md_mem_plan *out)
{
	if (in->limit == 0)
		return;
	uint64_t reserve = reserve_of(in->limit);
	uint64_t hard = in->limit > reserve ? in->limit - reserve : 0;
	size_t n = strlen(out->why);
	if (in->kv_min > hard) {
		out->refuse = true;
		snprintf(out->why, sizeof(out->why), "the smallest KV pool (%.0f MiB) needs more "
			 "than the memory limit (%.0f MiB) less %.0f MiB for the process itself",
			 in->kv_min / MIB, in->limit / MIB, reserve / MIB);
		return;
	}
	if (out->kv_bytes > hard) {
		out->kv_bytes = hard;
		snprintf(out->why + n, sizeof(out->why) - n, "; KV capped at %.0f MiB (the limit "
			 "less %.0f MiB)", hard / MIB, reserve / MIB);
	}
}

void md_mem_plan_make(const struct md_mem_plan_in *in, struct md_mem_plan *out)
{
	memset(out, 0, sizeof(*out));
	out->kv_bytes = in->kv_bytes;
	uint64_t usable = in->limit / 10 * 8;
	/* The mapping is kept up to 110% of the limit (mem_plan.h: measured crossover). */
	uint64_t map_max = in->limit / 10 * 11;
	bool fits = in->limit && in->file_bytes <= usable;
	if (in->expert_bytes == 0) {
		snprintf(out->why, sizeof(out->why), "the model has no routed experts");
		out->populate = fits;
		cap_kv(in, out);
		return;
	}
	if (in->cache_mb < 0) {
		snprintf(out->why, sizeof(out->why), "expert-cache-mb is -1");
		out->populate = fits;
		cap_kv(in, out);
		return;
	}
	if (in->cache_mb > 0) {
		out->store = true;
		out->cache_bytes = (uint64_t)(in->cache_mb * MIB);
		snprintf(out->why, sizeof(out->why), "expert-cache-mb is %g", in->cache_mb);
		return;
	}
	if ((in->limit == 0 || in->file_bytes <= usable) && in->device) {
		out->store = true;
		out->cache_bytes = in->expert_bytes;
		snprintf(out->why, sizeof(out->why), "a device tier goes through the store; the file "
			 "(%.0f MiB) fits in memory, so every expert is in host RAM too",
			 in->file_bytes / MIB);
		return;
	}
	if (in->limit == 0 || in->file_bytes <= map_max) {
		if (in->limit && in->file_bytes <= usable)
			snprintf(out->why, sizeof(out->why), "the file (%.0f MiB) fits in 80%% of the "
				 "memory limit (%.0f MiB)", in->file_bytes / MIB, in->limit / MIB);
		else if (in->limit)
			snprintf(out->why, sizeof(out->why), "the file (%.0f MiB) is within 110%% of "
				 "the memory limit (%.0f MiB): the page cache keeps nearly all of it, "
				 "faster than the store's smaller cache", in->file_bytes / MIB,
				 in->limit / MIB);
		else
			snprintf(out->why, sizeof(out->why), "no memory limit could be read");
		out->populate = fits;
		cap_kv(in, out);
		return;
	}
	out->store = true;
	uint64_t dense = in->file_bytes - in->expert_bytes;
	if (out->kv_bytes > usable / 8)
		out->kv_bytes = usable / 8;
	if (out->kv_bytes < in->kv_min)
		out->kv_bytes = in->kv_min;
	/* What dense weights, KV and cache may never exceed: the limit less the process's own
	 * share (code, heap, buffers), a tenth of it and at least RESERVE. */
	uint64_t reserve = reserve_of(in->limit);
	uint64_t hard = in->limit > reserve ? in->limit - reserve : 0;
	uint64_t top = usable < hard ? usable : hard;
	uint64_t left = top > dense + out->kv_bytes ? top - dense - out->kv_bytes : 0;
	out->cache_bytes = left < in->min_cache ? in->min_cache : left;
	if (out->cache_bytes > in->expert_bytes)
		out->cache_bytes = in->expert_bytes;
	uint64_t need = dense + out->kv_bytes + out->cache_bytes;
	if (need > hard) {
		out->refuse = true;
		snprintf(out->why, sizeof(out->why), "dense weights %.0f MiB + KV %.0f MiB + the "
			 "smallest expert cache %.0f MiB need %.0f MiB, more than the memory limit "
			 "(%.0f MiB) less %.0f MiB for the process itself", dense / MIB,
			 out->kv_bytes / MIB, out->cache_bytes / MIB, need / MIB, in->limit / MIB,
			 reserve / MIB);
		return;
	}
	snprintf(out->why, sizeof(out->why), "the file (%.0f MiB) exceeds 110%% of the memory limit "
		 "(%.0f MiB): dense weights %.0f MiB stay mapped, KV %.0f MiB, experts get the "
		 "rest%s", in->file_bytes / MIB, in->limit / MIB, dense / MIB, out->kv_bytes / MIB,
		 left < in->min_cache ? " (raised to the smallest budget that serves a step)" : "");
}
