/* The start-up memory plan: how much memory the process may use, and whether the model's
 * routed experts stay in the mapping or go through the expert store (engine/experts.h).
 *
 * DESIGN
 * While the whole file fits in about 80% of the memory the process may use, the mapping is
 * fastest (the kernel keeps it all; nothing is copied), so nothing changes. Up to 110% of the
 * limit the mapping is kept too: the page cache then still holds all but a few percent of the
 * file, and its few misses cost less than the store's smaller cache (whose budget is the 80%
 * line less dense weights and KV). Measured on moe64-2g (1869 MiB, 64 experts, Zen 3, 2
 * threads, bench/bench_experts.py), store against mapping: 0.64x at a 1800 MiB limit (file
 * 104% of it), 1.01x at 1700 (110%), 1.29x at 1550 (121%), 2.08x at 1300 (144%); the 1700
 * and 1550 runs shared the machine with a compile, so only their ratios count. Beyond
 * 110%, the dense weights (embeddings, attention, norms, routers, shared experts) stay mapped
 * and the routed experts go through the store, whose host budget is what is left of 80% of
 * the limit after the dense weights and the KV pool; the KV pool gets at most an eighth of
 * it then, and never less than the engine's floor (one full context).
 * Whatever the 80%, dense weights, KV and cache together stay a reserve below the limit (a
 * tenth of it, at least 32 MiB: the process's own code, heap and buffers). When the store's
 * smallest budget (one step's experts) is more than what is left, the budget is raised to it
 * as long as that holds; beyond that the plan refuses the model, which a start-up must turn
 * into a clear error rather than a process the OOM killer ends later (the dense weights are
 * locked in memory, the cache and KV are anonymous). A budget set by hand
 * (expert-cache-mb > 0) is taken as it is. With the whole file mapped (its pages can always
 * be dropped and read again) the KV pool, which is anonymous, is kept below the limit less
 * the reserve, and a limit that cannot hold even one context's KV is refused the same way.
 * When the mapping is kept and the whole file fits in the 80%, it is paged in at start-up
 * (populate), so that the first requests do not wait on page faults behind the kernel's
 * read-ahead (llama.cpp maps with MAP_POPULATE for the same reason); between 80% and 110%
 * it is not, since reading all of it would push its own pages out.
 * A device tier needs the store (its copies come from host slots): with one, a file that fits
 * gets the store too, with a host budget of every expert.
 * The limit is the tightest of the cgroup memory limits on the process's cgroup and its
 * ancestors (v2 memory.max, v1 memory.limit_in_bytes), else MemAvailable. The planning
 * itself is a pure function, tested on its own. */
#ifndef MD_MEM_PLAN_H
#define MD_MEM_PLAN_H

#include <stdbool.h>
#include <stdint.h>

/* What the process may use. */
struct md_mem_limit {
	uint64_t bytes;   /* 0 when nothing could be read */
	char source[96];  /* "cgroup v2 /a/b", "cgroup v1 /a", "MemAvailable" */
};

/* Read the limit from /proc and /sys (root: a test's fake tree, NULL for "/"). */
void md_mem_limit_read(struct md_mem_limit *out, const char *root);

struct md_mem_plan_in {
	uint64_t limit;        /* bytes the process may use (0: unknown, the mapping is kept) */
	uint64_t file_bytes;   /* the GGUF file */
	uint64_t expert_bytes; /* routed experts' bytes in it (0: a dense model) */
	uint64_t kv_bytes;     /* the KV budget configured */
	uint64_t kv_min;       /* the least KV pool the engine makes (one full context, or all
				  of kv-blocks when that is set) */
	uint64_t min_cache;    /* the store's smallest budget (md_expert_store_min_bytes) */
	double cache_mb;       /* expert-cache-mb: 0 auto, -1 never the store, > 0 that budget */
	bool device;           /* a device tier is wanted: it goes through the store, so auto
				* picks the store even when the file fits (every expert cached) */
};

struct md_mem_plan {
	bool refuse;           /* the model cannot be served within the limit (why says so) */
	bool store;            /* experts through the store */
	uint64_t cache_bytes;  /* its host budget */
	uint64_t kv_bytes;     /* the KV budget to use */
	bool populate;         /* the mapping is kept and the file fits in 80% of a known limit:
				* page it all in before serving */
	char why[256];         /* one phrase for the start-up line */
};

void md_mem_plan_make(const struct md_mem_plan_in *in, struct md_mem_plan *out);

#endif
