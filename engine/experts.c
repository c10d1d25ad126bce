/* The expert store: a host-RAM cache of routed experts read from the GGUF file (experts.h). */
#include "engine/experts.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

/* Offsets, lengths and buffers of O_DIRECT reads are multiples of this (the page size covers
 * every logical block size Linux filesystems use). */
#define ALIGN 4096u
#define MAX_IO_THREADS 16
#define BG_COPIES 4 /* background copies up in flight at most (bg_room) */

enum slot_state { SLOT_FREE, SLOT_LOADING, SLOT_READY, SLOT_FAILED };
enum slot_queue { Q_NONE, Q_DEMAND, Q_PREFETCH };

struct slot {
	uint8_t *buf;     /* borrowed: slot_bytes of the arena */
	int32_t unit;     /* engine thread: the unit held, -1 when free */
	int32_t refs;     /* engine thread: pinned by plan or got, not yet released */
	bool pinned;      /* engine thread: pinned by the current plan, not yet got */
	bool prefetched;  /* engine thread: read by prefetch(), not planned since */
	/* under mu */
	uint8_t state;    /* enum slot_state */
	uint8_t queue;    /* enum slot_queue */
	int32_t next;     /* next slot in its queue, or in the free list (engine thread) */
	int err;          /* SLOT_FAILED: the read's error */
	uint64_t up_fence; /* engine thread: a copy to the device reads this slot until then */
};

/* A device slot (engine thread only). */
struct dslot {
	int32_t unit;     /* -1 when free */
	int32_t refs;     /* pinned by plan or got, not yet released */
	bool pinned;
	bool promoted;    /* copied up in the background, not planned since */
	uint64_t fence;   /* the copy that fills it; usable once passed */
	uint64_t up_cum;  /* copied for the current plan: its plan's copy bytes up to this one */
	int32_t next;     /* free list */
};

/* Where a unit's three matrices lie in the file and how they look. */
struct unit_src {
	struct md_mat m[3]; /* gate, up, down; data unused */
	uint64_t off[3];    /* file offsets */
};

struct md_expert_store {
	struct md_expert_src base; /* first: the ops table */
	const struct md_model *m;  /* borrowed: outlives the store */
	uint32_t n_layer, n_expert, n_units;
	struct unit_src *units;    /* owned (n_units) */
	size_t slot_bytes;
	size_t part_off[3];        /* offset of each matrix's span in a slot */
	uint32_t n_slots;
	struct slot *slots;        /* owned (n_slots) */
	uint8_t *arena;            /* owned: n_slots * slot_bytes, mapped or (arena_dev) pinned */
	uint32_t n_reserve;        /* slots one layer of the largest step may need at once */
	pthread_t prefault_th;     /* backs the arena's pages (prefault_arena), when prefault_on */
	bool prefault_on;
	_Atomic bool prefault_stop;
	struct md_backend *arena_dev; /* the device whose host_alloc gave the arena, or NULL */
	int32_t *unit_slot;        /* owned (n_units): slot of each unit, -1 */
	struct md_epol *pol;       /* owned */
	int32_t free_head;         /* engine thread: free slots */
	uint64_t now;              /* engine thread: policy time, one tick per plan */
	int32_t *plan_units;       /* owned (n_expert): units pinned by the current plan */
	int n_plan;
	int32_t last_layer;        /* engine thread: layer of the last plan, -1 */
	uint8_t *step_seen;        /* owned (n_units): used in the current step */
	uint32_t step_distinct;
	uint8_t *predicted;        /* owned (n_units): named by the layer's last prediction */
	uint8_t *has_pred;         /* owned (n_layer) */
	uint32_t *c_bypass;        /* owned (n_expert): the plan's misses cached as transit */
	uint8_t *plan_mark;        /* owned (n_expert): scratch, the plan's experts */
	int n_bypass;
	uint64_t *last_use;        /* owned (n_units): policy time of the last plan naming it */

	struct md_backend *dev;    /* borrowed: NULL without a device tier */
	uint32_t n_dev;
	uint8_t *dev_arena;        /* owned (dev->alloc): n_dev * slot_bytes of device memory */
	struct dslot *dslots;      /* owned (n_dev) */
	int32_t *unit_dev;         /* owned (n_units): device slot of each unit, -1 */
	uint8_t *got_dev;          /* owned (n_units): the current get returned device views */
	struct md_epol *dpol;      /* owned: the device tier's policy */
	int32_t dev_free;
	struct md_xcost cost;      /* engine thread: compute-where-it-lives rates (expert_cost.h) */
	uint64_t *unit_bytes;      /* owned (n_units): weight bytes of each unit (its 3 matrices) */
	struct md_xcost_item *c_it; /* owned (n_expert): the plan's device misses */
	int32_t *c_idx;            /* owned (n_expert): their indices into the plan's experts */
	int32_t *c_order;          /* owned (n_expert): md_xcost_choose's copy order */
	uint8_t *c_up;             /* owned (n_expert): md_xcost_choose's choice */
	int32_t *c_up_idx;         /* owned (n_expert): the plan's experts copied up, in order */
	uint8_t *c_mark;           /* owned (n_expert): scratch */
	double up_t0;              /* engine thread: when the current plan queued its copies */
	uint64_t bg_fence[BG_COPIES]; /* engine thread: the last background copies (0: none) */
	int bg_next;               /* engine thread: the bg_fence entry the next one replaces */
	bool rates_fixed;          /* the cost model's rates came with the config: not measured */

	int fd_direct;             /* owned, -1 when O_DIRECT is refused */
	int fd_buf;                /* owned: buffered reads */
	_Atomic bool direct;       /* reads use fd_direct */
	char path[4096];

	pthread_mutex_t mu;
	pthread_cond_t job_cv;     /* readers wait for jobs */
	pthread_cond_t done_cv;    /* the engine thread waits for loads */
	int32_t q_head[3], q_tail[3]; /* under mu: demand and prefetch queues of slots */
	bool stop;                 /* under mu */
	pthread_t io[MAX_IO_THREADS];
	int n_io;

	_Atomic uint64_t hits, misses, bytes_read, read_errors, evictions, stall_ns;
	_Atomic uint64_t pf_issued, pf_used, pf_wasted, pf_cancelled, pred_used, pred_total;
	_Atomic uint64_t bypassed;
	_Atomic uint64_t steps, step_experts;
	_Atomic uint32_t last_step_experts, n_resident;
	_Atomic uint64_t dev_hits, dev_misses, dev_uploads, dev_evictions, dev_bytes_up;
	_Atomic uint64_t dev_up_compute, dev_host_compute, dev_stall_ns;
	_Atomic uint64_t dev_pf_issued, dev_pf_used, dev_pf_wasted;
	_Atomic uint32_t dev_resident;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t align_down(uint64_t x)
{
	return x & ~(uint64_t)(ALIGN - 1);
}

static uint64_t align_up(uint64_t x)
{
	return (x + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
}

static size_t mat_bytes(const struct md_mat *m)
{
	return m->nb1 * (size_t)m->n_out;
}

/* Bytes a read of the range (off, len) covers once widened to the alignment. */
static size_t span_of(uint64_t off, size_t len)
{
	return (size_t)(align_up(off + len) - align_down(off));
}

/* ---- layout ---- */

static const struct md_tensor *part_tensor(const struct md_layer *L, int p)
{
	return p == 0 ? L->gate_exps : p == 1 ? L->up_exps : L->down_exps;
}

/* Largest span of each part over all units; false when the model has no routed experts.
 * Layers without (a dense FFN: the leading layers of DeepSeek and GLM-4.5) hold no units. */
static bool part_spans(const struct md_model *m, size_t span[3])
{
	const struct md_hparams *hp = &m->hp;
	span[0] = span[1] = span[2] = 0;
	if (!hp->n_expert)
		return false;
	bool any = false;
	for (uint32_t l = 0; l < hp->n_layer; l++)
		for (int p = 0; p < 3; p++) {
			const struct md_tensor *t = part_tensor(&m->layers[l], p);
			if (!t)
				continue;
			any = true;
			for (uint32_t e = 0; e < hp->n_expert; e++) {
				struct md_mat x = md_mat_of(t, e);
				size_t sp = span_of((uint64_t)((const uint8_t *)x.data - m->gguf.base),
						    mat_bytes(&x));
				if (sp > span[p])
					span[p] = sp;
			}
		}
	return any;
}

size_t md_expert_store_slot_bytes(const struct md_model *m)
{
	size_t span[3];
	if (!part_spans(m, span))
		return 0;
	return span[0] + span[1] + span[2];
}

uint64_t md_expert_store_expert_bytes(const struct md_model *m)
{
	uint64_t sum = 0;
	if (!m->hp.n_expert)
		return 0;
	for (uint32_t l = 0; l < m->hp.n_layer; l++)
		for (int p = 0; p < 3; p++) {
			const struct md_tensor *t = part_tensor(&m->layers[l], p);
			if (t) {
				struct md_mat x = md_mat_of(t, 0);
				sum += (uint64_t)mat_bytes(&x) * m->hp.n_expert;
			}
		}
	return sum;
}

static uint32_t max_active(const struct md_model *m, int max_tokens)
{
	uint64_t k = (uint64_t)(max_tokens > 0 ? max_tokens : 1) * m->hp.n_expert_used;
	return k < m->hp.n_expert ? (uint32_t)k : m->hp.n_expert;
}

size_t md_expert_store_min_bytes(const struct md_model *m, int max_tokens)
{
	return md_expert_store_slot_bytes(m) * max_active(m, max_tokens);
}

/* ---- readers ---- */

/* Read [off, off + need) of the file into buf, reading span bytes from the aligned off
 * (the file may end before off + span). 0, -EIO for a file that ends early, or -errno. */
static int read_range(int fd, uint8_t *buf, size_t span, uint64_t off, size_t need)
{
	size_t got = 0;
	while (got < need) {
		ssize_t r = pread(fd, buf + got, span - got, (off_t)(off + got));
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return got ? -EIO : -errno; /* an unaligned retry after a short read: EOF */
		if (r == 0)
			return -EIO;
		got += (size_t)r;
	}
	return 0;
}

/* Read unit u into buf. Returns 0 or a negative code. */
static int read_unit(struct md_expert_store *s, uint32_t u, uint8_t *buf)
{
	const struct unit_src *us = &s->units[u];
	for (int p = 0; p < 3; p++) {
		uint64_t a = align_down(us->off[p]);
		size_t need = (size_t)(us->off[p] - a) + mat_bytes(&us->m[p]);
		size_t span = span_of(us->off[p], mat_bytes(&us->m[p]));
		int rc = -EINVAL;
		if (atomic_load(&s->direct)) {
			rc = read_range(s->fd_direct, buf + s->part_off[p], span, a, need);
			if (rc == -EINVAL && atomic_exchange(&s->direct, false))
				md_log(MD_LOG_WARN, "expert store: O_DIRECT reads of '%s' refused; "
				       "reading through the page cache", s->path);
		}
		if (!atomic_load(&s->direct) && rc == -EINVAL) {
			rc = read_range(s->fd_buf, buf + s->part_off[p], span, a, need);
			/* The slot is the copy we keep: drop the page cache's. */
			posix_fadvise(s->fd_buf, (off_t)a, (off_t)span, POSIX_FADV_DONTNEED);
		}
		if (rc)
			return rc;
		atomic_fetch_add(&s->bytes_read, span);
	}
	return 0;
}

static void q_push(struct md_expert_store *s, int q, int32_t sl, bool front)
{
	struct slot *x = &s->slots[sl];
	x->queue = (uint8_t)q;
	x->next = -1;
	if (s->q_head[q] < 0) {
		s->q_head[q] = s->q_tail[q] = sl;
	} else if (front) {
		x->next = s->q_head[q];
		s->q_head[q] = sl;
	} else {
		s->slots[s->q_tail[q]].next = sl;
		s->q_tail[q] = sl;
	}
}

static int32_t q_pop(struct md_expert_store *s, int q)
{
	int32_t sl = s->q_head[q];
	if (sl < 0)
		return -1;
	s->q_head[q] = s->slots[sl].next;
	if (s->q_head[q] < 0)
		s->q_tail[q] = -1;
	s->slots[sl].queue = Q_NONE;
	return sl;
}

static void q_remove(struct md_expert_store *s, int q, int32_t sl)
{
	int32_t prev = -1;
	for (int32_t i = s->q_head[q]; i >= 0; prev = i, i = s->slots[i].next) {
		if (i != sl)
			continue;
		if (prev < 0)
			s->q_head[q] = s->slots[i].next;
		else
			s->slots[prev].next = s->slots[i].next;
		if (s->q_tail[q] == sl)
			s->q_tail[q] = prev;
		s->slots[sl].queue = Q_NONE;
		return;
	}
}

static void *io_main(void *arg)
{
	struct md_expert_store *s = arg;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	pthread_mutex_lock(&s->mu);
	for (;;) {
		while (!s->stop && s->q_head[Q_DEMAND] < 0 && s->q_head[Q_PREFETCH] < 0)
			pthread_cond_wait(&s->job_cv, &s->mu);
		if (s->stop)
			break;
		int32_t sl = q_pop(s, Q_DEMAND);
		if (sl < 0)
			sl = q_pop(s, Q_PREFETCH);
		/* unit and buf do not change while the slot is LOADING (it is not evictable). */
		uint32_t u = (uint32_t)s->slots[sl].unit;
		uint8_t *buf = s->slots[sl].buf;
		pthread_mutex_unlock(&s->mu);
		int rc = read_unit(s, u, buf);
		pthread_mutex_lock(&s->mu);
		s->slots[sl].state = rc ? SLOT_FAILED : SLOT_READY;
		s->slots[sl].err = rc;
		pthread_cond_broadcast(&s->done_cv);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* ---- slots (engine thread) ---- */

/* Policy predicate, called with mu held: neither pinned, held nor being read. */
static bool evictable(void *arg, uint32_t unit)
{
	struct md_expert_store *s = arg;
	int32_t sl = s->unit_slot[unit];
	if (sl < 0 || s->slots[sl].refs != 0 || s->slots[sl].state == SLOT_LOADING)
		return false;
	if (s->slots[sl].up_fence && s->dev->fence_done(s->dev, s->slots[sl].up_fence) != 1)
		return false;
	s->slots[sl].up_fence = 0;
	return true;
}

/* Unmap unit u from its slot (not loading, not referenced) and put the slot on the free
 * list. */
static void drop_unit(struct md_expert_store *s, uint32_t u, bool evicted)
{
	int32_t sl = s->unit_slot[u];
	struct slot *x = &s->slots[sl];
	if (x->prefetched && evicted) {
		const struct unit_src *us = &s->units[u];
		for (int p = 0; p < 3; p++)
			atomic_fetch_add(&s->pf_wasted, span_of(us->off[p], mat_bytes(&us->m[p])));
	}
	s->unit_slot[u] = -1;
	md_epol_remove(s->pol, u);
	x->unit = -1;
	x->prefetched = false;
	x->pinned = false;
	x->state = SLOT_FREE; /* not loading: no reader looks at it */
	x->next = s->free_head;
	s->free_head = sl;
	atomic_fetch_sub(&s->n_resident, 1);
	if (evicted)
		atomic_fetch_add(&s->evictions, 1);
}

/* A free slot, evicting the policy's victim if needed; with wait, waits for reads in flight
 * to end when every slot is busy. -1 when none can be had. With bypass (a demand read of unit
 * want), *bypass says whether the policy would rather not cache want in the victim's place
 * (md_epol_admit, weighed against the weakest cached unit when the victim is a transit one):
 * the caller then caches it as transit (expert_policy.h). */
static int32_t take_slot(struct md_expert_store *s, bool wait, uint32_t want, bool *bypass)
{
	if (bypass)
		*bypass = false;
	for (;;) {
		if (s->free_head >= 0) {
			int32_t sl = s->free_head;
			s->free_head = s->slots[sl].next;
			return sl;
		}
		pthread_mutex_lock(&s->mu);
		int64_t v = md_epol_victim(s->pol, evictable, s, s->now);
		if (v >= 0 && bypass) {
			int64_t w = md_epol_transit(s->pol, (uint32_t)v)
				? md_epol_victim_cached(s->pol, evictable, s, s->now) : v;
			*bypass = w >= 0 && !md_epol_admit(s->pol, want, (uint32_t)w, s->now);
		}
		bool loading = false;
		uint64_t fence = 0; /* a copy to the device that holds a slot */
		if (v < 0 && wait)
			for (uint32_t i = 0; i < s->n_slots && !loading; i++) {
				loading = s->slots[i].state == SLOT_LOADING;
				if (s->slots[i].refs == 0 && s->slots[i].up_fence)
					fence = s->slots[i].up_fence;
			}
		if (v < 0 && loading)
			pthread_cond_wait(&s->done_cv, &s->mu);
		pthread_mutex_unlock(&s->mu);
		if (v >= 0)
			drop_unit(s, (uint32_t)v, true);
		else if (!loading && (!fence || s->dev->fence_wait(s->dev, fence)))
			return -1; /* nothing will free up (or the device failed) */
	}
}

/* Map unit u to a free slot and queue its read. Returns the slot or -1 (no slot). bypass:
 * as take_slot's (demand reads). */
static int32_t start_read(struct md_expert_store *s, uint32_t u, int q, bool wait, bool *bypass)
{
	int32_t sl = take_slot(s, wait, u, bypass);
	if (sl < 0)
		return -1;
	struct slot *x = &s->slots[sl];
	x->unit = (int32_t)u;
	x->refs = 0;
	x->pinned = false;
	x->up_fence = 0;
	x->prefetched = q == Q_PREFETCH;
	s->unit_slot[u] = sl;
	md_epol_insert(s->pol, u, s->now);
	atomic_fetch_add(&s->n_resident, 1);
	pthread_mutex_lock(&s->mu);
	x->state = SLOT_LOADING;
	x->err = 0;
	q_push(s, q, sl, false);
	pthread_cond_signal(&s->job_cv);
	pthread_mutex_unlock(&s->mu);
	return sl;
}

/* Read unit u ahead of use (prefetch priority, never waiting for a slot): 1 when queued, 0 when
 * already resident or on its way, -1 when no slot is free or evictable. Counted as a prefetch:
 * pre-gating's guesses, the warm start's hot set and the start-up fill go through here. */
static int read_ahead(struct md_expert_store *s, uint32_t u)
{
	if (s->unit_slot[u] >= 0)
		return 0;
	if (start_read(s, u, Q_PREFETCH, false, NULL) < 0)
		return -1;
	atomic_fetch_add(&s->pf_issued, 1);
	return 1;
}

static void pin(struct md_expert_store *s, int32_t sl)
{
	s->slots[sl].refs++;
	s->slots[sl].pinned = true;
}

/* Close the step that ended (its distinct experts) when a plan starts a new one. */
static void step_mark(struct md_expert_store *s, uint32_t layer, const int32_t *experts, int n)
{
	if ((int32_t)layer <= s->last_layer) {
		atomic_fetch_add(&s->steps, 1);
		atomic_fetch_add(&s->step_experts, s->step_distinct);
		atomic_store(&s->last_step_experts, s->step_distinct);
		memset(s->step_seen, 0, s->n_units);
		s->step_distinct = 0;
	}
	s->last_layer = (int32_t)layer;
	for (int i = 0; i < n; i++) {
		uint32_t u = layer * s->n_expert + (uint32_t)experts[i];
		if (!s->step_seen[u]) {
			s->step_seen[u] = 1;
			s->step_distinct++;
		}
	}
}

/* ---- the device tier (engine thread) ---- */

static bool dev_evictable(void *arg, uint32_t unit)
{
	struct md_expert_store *s = arg;
	int32_t ds = s->unit_dev[unit];
	return ds >= 0 && s->dslots[ds].refs == 0 &&
	       s->dev->fence_done(s->dev, s->dslots[ds].fence) == 1;
}

/* Whether a background copy may be queued: fewer than BG_COPIES of them in flight. They share
 * the copy stream with the copies a plan waits for, which queue behind them; when the tier
 * thrashes (more experts each step than it holds) every expert the CPU ran would be copied up
 * only to be evicted unused, and the plans' own copies would wait behind that traffic. */
static bool bg_room(struct md_expert_store *s)
{
	uint64_t f = s->bg_fence[s->bg_next];
	return f == 0 || s->dev->fence_done(s->dev, f) != 0;
}

/* Copy unit u, resident in host slot sl, up to a free or evictable device slot. now: for this
 * step (the cost model chose it): the device slot is pinned for the plan's get; else in the
 * background, for later steps. Returns the device slot, or -1 when none can be had or the copy
 * cannot be queued (the expert then runs on the host). */
static int32_t promote(struct md_expert_store *s, uint32_t u, int32_t sl, bool now)
{
	int32_t ds = s->dev_free;
	if (ds >= 0) {
		s->dev_free = s->dslots[ds].next;
	} else {
		int64_t v = md_epol_victim(s->dpol, dev_evictable, s, s->now);
		if (v < 0)
			return -1;
		ds = s->unit_dev[v];
		if (s->dslots[ds].promoted)
			atomic_fetch_add(&s->dev_pf_wasted, s->slot_bytes);
		s->unit_dev[v] = -1;
		md_epol_remove(s->dpol, (uint32_t)v);
		atomic_fetch_add(&s->dev_evictions, 1);
		atomic_fetch_sub(&s->dev_resident, 1);
	}
	struct dslot *d = &s->dslots[ds];
	uint64_t fence = 0;
	if (s->dev->upload_async(s->dev, s->dev_arena + (size_t)ds * s->slot_bytes,
				 s->slots[sl].buf, s->slot_bytes, MD_BACKEND_STREAM_COPY) ||
	    s->dev->fence_record(s->dev, MD_BACKEND_STREAM_COPY, &fence)) {
		d->unit = -1;
		d->next = s->dev_free;
		s->dev_free = ds;
		return -1;
	}
	d->unit = (int32_t)u;
	d->refs = now ? 1 : 0;
	d->pinned = now;
	d->promoted = !now;
	d->fence = fence;
	s->slots[sl].up_fence = fence;
	s->unit_dev[u] = ds;
	md_epol_insert(s->dpol, u, s->now);
	atomic_fetch_add(&s->dev_uploads, 1);
	atomic_fetch_add(&s->dev_bytes_up, s->slot_bytes);
	atomic_fetch_add(&s->dev_resident, 1);
	if (!now)
		atomic_fetch_add(&s->dev_pf_issued, 1);
	return ds;
}

/* The device misses of the plan that are ready in host RAM (c_it, c_idx: nc of them, and their
 * planned host slots pinned): the cost model (expert_cost.h) picks those to copy up and
 * compute on the device in this step; their copies are queued now and they move from the
 * host part of the order to the device part. w0: modelled seconds of the device-resident
 * experts. Returns how many go up. */
static int plan_uploads(struct md_expert_store *s, uint32_t layer, const int32_t *experts,
			int nc, int n_dev_pinned, double w0, int32_t *up_idx)
{
	int max_up = (int)s->n_dev - n_dev_pinned;
	if (nc == 0 || max_up <= 0)
		return 0;
	int n_up = md_xcost_choose(&s->cost, w0, s->c_it, nc, max_up, s->c_up, s->c_order, NULL);
	int k = 0;
	uint64_t cum = 0;
	s->up_t0 = (double)now_ns() * 1e-9;
	for (int j = 0; j < n_up; j++) {
		int32_t i = s->c_idx[s->c_order[j]];
		uint32_t u = layer * s->n_expert + (uint32_t)experts[i];
		int32_t ds = promote(s, u, s->unit_slot[u], true);
		if (ds < 0)
			break; /* no device slot after all: the rest run on the host */
		cum += s->slot_bytes;
		s->dslots[ds].up_cum = cum;
		up_idx[k++] = i;
	}
	return k;
}

/* ---- the ops ---- */

/* The plan of a layer that had a prediction: the guesses it does not use and whose reads have
 * not started are taken off the prefetch queue and their slots freed. A guess is for this
 * visit of the layer only (the next one is a step away, and gets its own), and in the
 * I/O-bound regime the store is for, a read nobody waits for delays the ones they do. (On
 * moe64-2g at half its file in memory this saves little: 94 -> 91.5 MiB read per token; most
 * wrong guesses are already being read when the plan comes, ~20% of the bytes read.) */
static void cancel_guesses(struct md_expert_store *s, uint32_t layer, const int32_t *experts,
			   int n)
{
	uint8_t *pred = s->predicted + layer * s->n_expert;
	memset(s->plan_mark, 0, s->n_expert);
	for (int i = 0; i < n; i++)
		s->plan_mark[experts[i]] = 1;
	for (uint32_t e = 0; e < s->n_expert; e++) {
		uint32_t u = layer * s->n_expert + e;
		int32_t sl = s->unit_slot[u];
		if (!pred[e] || s->plan_mark[e] || sl < 0 || !s->slots[sl].prefetched ||
		    s->slots[sl].refs)
			continue;
		pthread_mutex_lock(&s->mu);
		bool queued = s->slots[sl].state == SLOT_LOADING && s->slots[sl].queue == Q_PREFETCH;
		if (queued)
			q_remove(s, Q_PREFETCH, sl);
		pthread_mutex_unlock(&s->mu);
		if (!queued)
			continue;
		drop_unit(s, u, false);
		atomic_fetch_add(&s->pf_cancelled, 1);
	}
}

static int st_plan(struct md_expert_src *src, uint32_t layer, const int32_t *experts,
		   const int32_t *tokens, int n, int32_t *order)
{
	struct md_expert_store *s = (struct md_expert_store *)src;
	if (layer >= s->n_layer || n < 0 || (uint32_t)n > s->n_expert || !s->m->layers[layer].gate_exps)
		return -EINVAL; /* outside the model, or a layer with a dense FFN */
	for (int i = 0; i < n; i++)
		if (experts[i] < 0 || (uint32_t)experts[i] >= s->n_expert)
			return -EINVAL;
	s->now++;
	/* Pins of the previous plan that no get took (a get failed before them) go. */
	for (int i = 0; i < s->n_plan; i++) {
		int32_t sl = s->unit_slot[s->plan_units[i]];
		if (sl >= 0 && s->slots[sl].pinned) {
			s->slots[sl].pinned = false;
			s->slots[sl].refs--;
		}
		int32_t ds = s->dev ? s->unit_dev[s->plan_units[i]] : -1;
		if (ds >= 0 && s->dslots[ds].pinned) {
			s->dslots[ds].pinned = false;
			s->dslots[ds].refs--;
		}
	}
	s->n_plan = 0;
	step_mark(s, layer, experts, n);
	if (s->has_pred[layer]) {
		uint64_t hit = 0;
		for (int i = 0; i < n; i++)
			hit += s->predicted[layer * s->n_expert + (uint32_t)experts[i]];
		atomic_fetch_add(&s->pred_used, hit);
		atomic_fetch_add(&s->pred_total, (uint64_t)n);
		s->has_pred[layer] = 0;
		cancel_guesses(s, layer, experts, n);
	}

	/* Experts on the device (their copy done) come first and need nothing else. */
	int k = 0;
	double w0 = 0; /* their modelled compute */
	for (int i = 0; s->dev && i < n; i++) {
		uint32_t u = layer * s->n_expert + (uint32_t)experts[i];
		int32_t ds = s->unit_dev[u];
		if (ds < 0 || s->dev->fence_done(s->dev, s->dslots[ds].fence) != 1)
			continue;
		struct dslot *d = &s->dslots[ds];
		d->refs++;
		d->pinned = true;
		if (d->promoted) {
			d->promoted = false;
			atomic_fetch_add(&s->dev_pf_used, 1);
		}
		s->plan_units[s->n_plan++] = (int32_t)u;
		atomic_fetch_add(&s->dev_hits, 1);
		w0 += md_xcost_dev(&s->cost, s->unit_bytes[u], tokens ? tokens[i] : 1);
		order[k++] = i;
	}
	const int n_dev = k;
	if (s->dev)
		atomic_fetch_add(&s->dev_misses, (uint64_t)(n - n_dev));
	/* Pin what is here (loaded or on its way) before any read may evict; ready ones next.
	 * Those ready in host RAM but not on the device are the cost model's candidates. */
	int32_t *rest = order + n; /* filled backwards: the others, in plan order */
	int nc = 0;
	pthread_mutex_lock(&s->mu);
	for (int i = 0; i < n; i++) {
		uint32_t u = layer * s->n_expert + (uint32_t)experts[i];
		int32_t sl = s->unit_slot[u];
		if (n_dev && s->unit_dev[u] >= 0 && s->dslots[s->unit_dev[u]].pinned)
			continue;
		s->plan_units[s->n_plan++] = (int32_t)u;
		if (sl < 0) {
			*--rest = i;
			continue;
		}
		struct slot *x = &s->slots[sl];
		pin(s, sl);
		if (x->prefetched) {
			x->prefetched = false;
			atomic_fetch_add(&s->pf_used, 1);
		}
		atomic_fetch_add(x->state == SLOT_FAILED ? &s->misses : &s->hits, 1);
		if (x->state == SLOT_READY) {
			if (s->dev && s->unit_dev[u] < 0) {
				s->c_it[nc] = (struct md_xcost_item){ s->unit_bytes[u],
								      tokens ? tokens[i] : 1 };
				s->c_idx[nc++] = i;
			}
			order[k++] = i;
			continue;
		}
		*--rest = i;
		if (x->state == SLOT_FAILED) { /* a failed prefetch: try again */
			x->state = SLOT_LOADING;
			q_push(s, Q_DEMAND, sl, false);
			pthread_cond_signal(&s->job_cv);
		} else if (x->queue == Q_PREFETCH) {
			q_remove(s, Q_PREFETCH, sl);
			q_push(s, Q_DEMAND, sl, false);
		}
	}
	pthread_mutex_unlock(&s->mu);
	/* Compute where it lives: the chosen device misses are copied up now and move behind the
	 * host-ready ones (their gets wait for the copies, which the host work hides). */
	int n_up = s->dev ? plan_uploads(s, layer, experts, nc, n_dev, w0, s->c_up_idx) : 0;
	if (n_up) {
		memset(s->c_mark, 0, s->n_expert);
		for (int j = 0; j < n_up; j++)
			s->c_mark[s->c_up_idx[j]] = 1;
		int h = n_dev;
		for (int j = n_dev; j < k; j++)
			if (!s->c_mark[order[j]])
				order[h++] = order[j];
		memcpy(order + h, s->c_up_idx, sizeof(*order) * (size_t)n_up);
	}
	if (s->dev) {
		atomic_fetch_add(&s->dev_up_compute, (uint64_t)n_up);
		atomic_fetch_add(&s->dev_host_compute, (uint64_t)(n - n_dev - n_up));
	}
	int n_ready = k - n_up;
	/* The policy hears of this visit before any victim is chosen for its misses, as the
	 * replay (bench/cache-replay) does: a miss's admission then knows it was just used. */
	for (int i = 0; i < n; i++) {
		md_epol_access(s->pol, layer * s->n_expert + (uint32_t)experts[i], s->now);
		s->last_use[layer * s->n_expert + (uint32_t)experts[i]] = s->now;
	}
	/* The others were stored backwards from the end: put them in plan order after the
	 * ready ones, and start the reads of the missing ones in that order. */
	for (int a = k, z = n - 1; a < z; a++, z--) {
		int32_t t = order[a];
		order[a] = order[z];
		order[z] = t;
	}
	for (int j = k; j < n; j++) {
		uint32_t u = layer * s->n_expert + (uint32_t)experts[order[j]];
		if (s->unit_slot[u] >= 0)
			continue;
		bool bypass;
		int32_t sl = start_read(s, u, Q_DEMAND, true, &bypass);
		if (sl < 0)
			return -ENOSPC; /* cannot happen with the budget checked at start */
		pin(s, sl);
		atomic_fetch_add(&s->misses, 1);
		if (bypass)
			s->c_bypass[s->n_bypass++] = u;
	}
	/* Misses the policy would not have admitted stream through as transit units: the first
	 * victims once released, so what the cache holds stays. */
	for (int i = 0; i < s->n_bypass; i++)
		md_epol_demote(s->pol, s->c_bypass[i]);
	atomic_fetch_add(&s->bypassed, (uint64_t)s->n_bypass);
	s->n_bypass = 0;
	return n_ready;
}

static int st_get(struct md_expert_src *src, uint32_t layer, int32_t e, struct md_expert_w *out)
{
	struct md_expert_store *s = (struct md_expert_store *)src;
	if (layer >= s->n_layer || e < 0 || (uint32_t)e >= s->n_expert || !s->m->layers[layer].gate_exps)
		return -EINVAL;
	uint32_t u = layer * s->n_expert + (uint32_t)e;
	const struct unit_src *us = &s->units[u];
	int32_t ds = s->dev ? s->unit_dev[u] : -1;
	if (ds >= 0 && s->dslots[ds].pinned) { /* planned on the device */
		struct dslot *d = &s->dslots[ds];
		int done = s->dev->fence_done(s->dev, d->fence);
		if (done == 0) { /* copied up for this step: wait for its copy */
			uint64_t t0 = now_ns();
			if (s->dev->fence_wait(s->dev, d->fence))
				return -EIO;
			uint64_t t1 = now_ns();
			atomic_fetch_add(&s->dev_stall_ns, t1 - t0);
			if (!s->rates_fixed)
				md_xcost_observe_up(&s->cost, d->up_cum,
						    (double)t1 * 1e-9 - s->up_t0);
		} else if (done < 0) {
			return -EIO;
		}
		int32_t sl = s->unit_slot[u]; /* the host copy it came from is not needed now */
		if (sl >= 0 && s->slots[sl].pinned) {
			s->slots[sl].pinned = false;
			s->slots[sl].refs--;
		}
		d->pinned = false;
		s->got_dev[u] = 1;
		uint8_t *base = s->dev_arena + (size_t)ds * s->slot_bytes;
		struct md_mat *o[3] = { &out->gate, &out->up, &out->down };
		for (int p = 0; p < 3; p++) {
			*o[p] = us->m[p];
			o[p]->data = base + s->part_off[p] + (us->off[p] - align_down(us->off[p]));
		}
		out->dev = s->dev;
		return 0;
	}
	int32_t sl = s->unit_slot[u];
	if (sl < 0 || !s->slots[sl].pinned)
		return -EINVAL; /* not planned: the contract says plan first */
	struct slot *x = &s->slots[sl];
	pthread_mutex_lock(&s->mu);
	if (x->state == SLOT_LOADING) {
		uint64_t t0 = now_ns();
		if (x->queue != Q_NONE) { /* not started: it is the one needed now */
			q_remove(s, x->queue, sl);
			q_push(s, Q_DEMAND, sl, true);
		}
		while (x->state == SLOT_LOADING)
			pthread_cond_wait(&s->done_cv, &s->mu);
		atomic_fetch_add(&s->stall_ns, now_ns() - t0);
	}
	int rc = x->state == SLOT_FAILED ? x->err : 0;
	pthread_mutex_unlock(&s->mu);
	x->pinned = false;
	if (rc) {
		atomic_fetch_add(&s->read_errors, 1);
		md_log(MD_LOG_WARN, "expert store: cannot read expert %d of layer %u from '%s': %s",
		       e, layer, s->path, strerror(-rc));
		x->refs--;
		drop_unit(s, u, false);
		return rc;
	}
	struct md_mat *o[3] = { &out->gate, &out->up, &out->down };
	for (int p = 0; p < 3; p++) {
		*o[p] = us->m[p];
		o[p]->data = x->buf + s->part_off[p] + (us->off[p] - align_down(us->off[p]));
	}
	out->dev = NULL;
	s->got_dev[u] = 0;
	if (s->dev && ds < 0 && bg_room(s)) {
		int32_t bds = promote(s, u, sl, false);
		if (bds >= 0) {
			s->bg_fence[s->bg_next] = s->dslots[bds].fence;
			s->bg_next = (s->bg_next + 1) % BG_COPIES;
		}
	}
	return 0;
}

static void st_release(struct md_expert_src *src, uint32_t layer, int32_t e)
{
	struct md_expert_store *s = (struct md_expert_store *)src;
	if (layer >= s->n_layer || e < 0 || (uint32_t)e >= s->n_expert)
		return;
	uint32_t u = layer * s->n_expert + (uint32_t)e;
	if (s->got_dev[u]) {
		s->got_dev[u] = 0;
		int32_t ds = s->unit_dev[u];
		if (ds >= 0 && s->dslots[ds].refs > 0)
			s->dslots[ds].refs--;
		return;
	}
	int32_t sl = s->unit_slot[u];
	if (sl >= 0 && s->slots[sl].refs > 0)
		s->slots[sl].refs--;
}

static void st_prefetch(struct md_expert_src *src, uint32_t layer, const int32_t *experts, int n)
{
	struct md_expert_store *s = (struct md_expert_store *)src;
	if (layer >= s->n_layer || !s->m->layers[layer].gate_exps)
		return;
	uint8_t *pred = s->predicted + layer * s->n_expert;
	memset(pred, 0, s->n_expert);
	s->has_pred[layer] = 1;
	for (int i = 0; i < n; i++) {
		if (experts[i] < 0 || (uint32_t)experts[i] >= s->n_expert)
			continue;
		uint32_t u = layer * s->n_expert + (uint32_t)experts[i];
		pred[experts[i]] = 1;
		md_epol_hint(s->pol, u, 1.0f, s->now);
		if (read_ahead(s, u) < 0)
			break; /* every slot is in use: no room to guess */
	}
}

/* The forward pass's timings of expert compute, for the cost model's rates. */
static void st_observe(struct md_expert_src *src, bool dev, uint64_t bytes, uint64_t tok_bytes,
		       double seconds)
{
	struct md_expert_store *s = (struct md_expert_store *)src;
	if (!s->rates_fixed)
		md_xcost_observe(&s->cost, dev, bytes, tok_bytes, seconds);
}

static bool st_resident(struct md_expert_src *src, uint32_t layer, int32_t e)
{
	return e >= 0 && md_expert_store_resident((struct md_expert_store *)src, layer, (uint32_t)e);
}

static const struct md_expert_src_ops store_ops = {
	.name = "store",
	.plan = st_plan,
	.get = st_get,
	.release = st_release,
	.prefetch = st_prefetch,
	.observe = st_observe,
	.resident = st_resident,
};

/* The same without prefetch: the forward pass then does not predict. */
static const struct md_expert_src_ops store_ops_nopf = {
	.name = "store",
	.plan = st_plan,
	.get = st_get,
	.release = st_release,
	.observe = st_observe,
	.resident = st_resident,
};

/* ---- lifecycle ---- */

struct md_expert_src *md_expert_store_src(struct md_expert_store *s)
{
	return &s->base;
}

bool md_expert_store_resident(struct md_expert_store *s, uint32_t layer, uint32_t expert)
{
	if (layer >= s->n_layer || expert >= s->n_expert)
		return false;
	int32_t sl = s->unit_slot[layer * s->n_expert + expert];
	if (sl < 0)
		return false;
	pthread_mutex_lock(&s->mu);
	bool r = s->slots[sl].state == SLOT_READY;
	pthread_mutex_unlock(&s->mu);
	return r;
}

void md_expert_store_get_stats(struct md_expert_store *s, struct md_expert_store_stats *o)
{
	memset(o, 0, sizeof(*o));
	o->hits = atomic_load(&s->hits);
	o->misses = atomic_load(&s->misses);
	o->bytes_read = atomic_load(&s->bytes_read);
	o->read_errors = atomic_load(&s->read_errors);
	o->evictions = atomic_load(&s->evictions);
	o->bypassed = atomic_load(&s->bypassed);
	o->stall_ns = atomic_load(&s->stall_ns);
	o->prefetch_issued = atomic_load(&s->pf_issued);
	o->prefetch_used = atomic_load(&s->pf_used);
	o->prefetch_wasted_bytes = atomic_load(&s->pf_wasted);
	o->prefetch_cancelled = atomic_load(&s->pf_cancelled);
	o->predicted_used = atomic_load(&s->pred_used);
	o->predicted_total = atomic_load(&s->pred_total);
	o->steps = atomic_load(&s->steps);
	o->step_experts = atomic_load(&s->step_experts);
	o->last_step_experts = atomic_load(&s->last_step_experts);
	o->n_slots = s->n_slots;
	o->n_resident = atomic_load(&s->n_resident);
	o->slot_bytes = s->slot_bytes;
	o->direct = atomic_load(&s->direct);
	o->dev_hits = atomic_load(&s->dev_hits);
	o->dev_misses = atomic_load(&s->dev_misses);
	o->dev_uploads = atomic_load(&s->dev_uploads);
	o->dev_bytes_uploaded = atomic_load(&s->dev_bytes_up);
	o->dev_evictions = atomic_load(&s->dev_evictions);
	o->dev_compute_dev = atomic_load(&s->dev_up_compute);
	o->dev_compute_host = atomic_load(&s->dev_host_compute);
	o->dev_stall_ns = atomic_load(&s->dev_stall_ns);
	o->dev_prefetch_issued = atomic_load(&s->dev_pf_issued);
	o->dev_prefetch_used = atomic_load(&s->dev_pf_used);
	o->dev_prefetch_wasted_bytes = atomic_load(&s->dev_pf_wasted);
	o->dev_mem_bytes = (uint64_t)s->n_dev * s->slot_bytes;
	o->dev_up_bps = s->n_dev ? 1048576.0 / s->cost.up_s_per_mib : 0;
	o->dev_slots = s->n_dev;
	o->dev_resident = atomic_load(&s->dev_resident);
}

void md_expert_store_free(struct md_expert_store *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	s->stop = true;
	pthread_cond_broadcast(&s->job_cv);
	pthread_mutex_unlock(&s->mu);
	for (int i = 0; i < s->n_io; i++)
		pthread_join(s->io[i], NULL);
	if (s->prefault_on) {
		atomic_store(&s->prefault_stop, true);
		pthread_join(s->prefault_th, NULL);
	}
	pthread_cond_destroy(&s->job_cv);
	pthread_cond_destroy(&s->done_cv);
	pthread_mutex_destroy(&s->mu);
	if (s->fd_direct >= 0)
		close(s->fd_direct);
	if (s->fd_buf >= 0)
		close(s->fd_buf);
	if (s->arena && s->arena_dev)
		s->arena_dev->host_free(s->arena_dev, s->arena);
	else if (s->arena)
		munmap(s->arena, (size_t)s->n_slots * s->slot_bytes);
	md_epol_free(s->pol);
	if (s->dev && s->dev_arena)
		s->dev->free(s->dev, s->dev_arena);
	md_epol_free(s->dpol);
	free(s->dslots);
	free(s->unit_dev);
	free(s->unit_bytes);
	free(s->c_it);
	free(s->c_idx);
	free(s->c_order);
	free(s->c_up);
	free(s->c_up_idx);
	free(s->c_mark);
	free(s->got_dev);
	free(s->units);
	free(s->slots);
	free(s->unit_slot);
	free(s->plan_units);
	free(s->step_seen);
	free(s->predicted);
	free(s->has_pred);
	free(s->c_bypass);
	free(s->plan_mark);
	free(s->last_use);
	free(s);
}

/* ---- warm restart ---- */

#define HOT_MAGIC "moed-hot-experts 1"

static int cmp_recent(const void *a, const void *b, void *arg)
{
	const uint64_t *t = arg;
	uint64_t x = t[*(const uint32_t *)a], y = t[*(const uint32_t *)b];
	return x < y ? 1 : x > y ? -1 : 0;
}

/* The directory part of path ("." without one) into buf. */
static void dir_of(const char *path, char *buf, size_t cap)
{
	const char *slash = strrchr(path, '/');
	if (!slash)
		snprintf(buf, cap, ".");
	else if (slash == path)
		snprintf(buf, cap, "/");
	else
		snprintf(buf, cap, "%.*s", (int)(slash - path), path);
}

int md_expert_store_save(struct md_expert_store *s, const char *path)
{
	uint32_t *u = malloc(s->n_units * sizeof(*u));
	if (!u)
		return -ENOMEM;
	uint32_t n = 0;
	for (uint32_t i = 0; i < s->n_units; i++) /* resident and used: not a fill never used */
		if (s->unit_slot[i] >= 0 && s->last_use[i] &&
		    md_expert_store_resident(s, i / s->n_expert, i % s->n_expert))
			u[n++] = i;
	qsort_r(u, n, sizeof(*u), cmp_recent, s->last_use);
	char tmp[4200];
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (!f) {
		int rc = -errno;
		free(u);
		return rc;
	}
	fprintf(f, "%s\nlayers %u experts %u file-bytes %zu\n", HOT_MAGIC, s->n_layer,
		s->n_expert, s->m->gguf.size);
	for (uint32_t i = 0; i < n; i++)
		fprintf(f, "%u %u\n", u[i] / s->n_expert, u[i] % s->n_expert);
	free(u);
	/* Every byte reaches the disk before the rename makes the file the one the next start
	 * reads: a full disk (ENOSPC), a file-size limit (EFBIG) or an I/O error shows here, and
	 * a crash or power cut after the rename finds the whole new file, never a cut one. */
	int rc = 0;
	errno = 0;
	if (fflush(f) || ferror(f))
		rc = errno ? -errno : -EIO;
	if (!rc && fsync(fileno(f)))
		rc = -errno;
	if (fclose(f) && !rc)
		rc = -errno;
	if (!rc && rename(tmp, path))
		rc = -errno;
	if (rc) {
		unlink(tmp);
		return rc;
	}
	/* The rename itself is made durable by syncing the directory; failing that only risks
	 * the previous file after a power cut, so it is not an error. */
	char dir[4200];
	dir_of(path, dir, sizeof(dir));
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd >= 0) {
		fsync(dfd);
		close(dfd);
	}
	return 0;
}

int md_expert_store_warm(struct md_expert_store *s, const char *path, uint32_t *n)
{
	*n = 0;
	FILE *f = fopen(path, "r");
	if (!f)
		return -errno;
	char line[256];
	unsigned nl, ne;
	size_t bytes;
	int rc = 0;
	if (!fgets(line, sizeof(line), f) || strncmp(line, HOT_MAGIC "\n", sizeof(HOT_MAGIC)) ||
	    fscanf(f, "layers %u experts %u file-bytes %zu\n", &nl, &ne, &bytes) != 3 ||
	    nl != s->n_layer || ne != s->n_expert || bytes != s->m->gguf.size)
		rc = -EINVAL;
	unsigned l, e;
	while (!rc && *n < s->n_slots && fscanf(f, "%u %u\n", &l, &e) == 2) {
		if (l >= s->n_layer || e >= s->n_expert || !s->m->layers[l].gate_exps) {
			rc = -EINVAL; /* outside the model, or a dense layer's */
			break;
		}
		int q = read_ahead(s, l * s->n_expert + e);
		if (q < 0)
			break;
		*n += (uint32_t)q;
	}
	fclose(f);
	return rc;
}

/* Fill the free slots, but for one layer's worth left for the first misses, with reads at
 * prefetch priority: the layers in turn, expert 0 of each, then expert 1, so every layer gets
 * an equal share. A store starts empty, and every expert a request then uses for the first
 * time is a miss that stalls its layer; the disk is idle before the first request, and these
 * reads give way to any demand read (the I/O threads take demand reads first). Their units
 * were never used, so the policy evicts them before anything a request touched. Filled units
 * count as prefetches, like warm ones. */
uint32_t md_expert_store_fill(struct md_expert_store *s)
{
	uint32_t n_free = 0, n = 0;
	for (int32_t sl = s->free_head; sl >= 0; sl = s->slots[sl].next)
		n_free++;
	for (uint32_t e = 0; e < s->n_expert && n_free > s->n_reserve; e++)
		for (uint32_t l = 0; l < s->n_layer && n_free > s->n_reserve; l++) {
			int q = s->m->layers[l].gate_exps ? read_ahead(s, l * s->n_expert + e) : 0;
			if (q < 0)
				return n;
			n_free -= (uint32_t)q;
			n += (uint32_t)q;
		}
	return n;
}

/* The units' file ranges; -ENOTSUP when an expert matrix is not in the mapped file. */
static int map_units(struct md_expert_store *s, char *err, size_t errlen)
{
	const struct md_model *m = s->m;
	const uint8_t *base = m->gguf.base;
	for (uint32_t l = 0; l < s->n_layer; l++)
		for (uint32_t e = 0; e < s->n_expert && m->layers[l].gate_exps; e++) {
			struct unit_src *us = &s->units[l * s->n_expert + e];
			for (int p = 0; p < 3; p++) {
				struct md_mat x = md_mat_of(part_tensor(&m->layers[l], p), e);
				const uint8_t *d = x.data;
				if (!m->gguf._mapped || d < base || d + mat_bytes(&x) > base + m->gguf.size) {
					snprintf(err, errlen, "expert %u of layer %u is not read from the "
						 "file as it lies there (merged copy): the expert store "
						 "cannot serve this model", e, l);
					return -ENOTSUP;
				}
				us->m[p] = x;
				us->m[p].data = NULL;
				us->off[p] = (uint64_t)(d - base);
				s->unit_bytes[l * s->n_expert + e] += mat_bytes(&x);
			}
		}
	return 0;
}

/* Open the model's file twice (O_DIRECT where allowed, and buffered), checking that it is
 * still the mapped one. */
static int open_file(struct md_expert_store *s, bool buffered, char *err, size_t errlen)
{
	struct stat a, b;
	snprintf(s->path, sizeof(s->path), "%s", s->m->path);
	s->fd_buf = open(s->path, O_RDONLY | O_CLOEXEC);
	if (s->fd_buf < 0) {
		int rc = -errno;
		snprintf(err, errlen, "cannot open '%s' for expert reads: %s", s->path, strerror(errno));
		return rc;
	}
	if (fstat(s->fd_buf, &a) || fstat(s->m->gguf._fd, &b) || a.st_ino != b.st_ino ||
	    a.st_dev != b.st_dev) {
		snprintf(err, errlen, "'%s' is no longer the file the model was loaded from", s->path);
		return -ESTALE;
	}
	s->fd_direct = buffered ? -1 : open(s->path, O_RDONLY | O_DIRECT | O_CLOEXEC);
	if (s->fd_direct < 0 && !buffered)
		md_log(MD_LOG_WARN, "expert store: cannot open '%s' with O_DIRECT (%s); reading "
		       "through the page cache", s->path, strerror(errno));
	atomic_store(&s->direct, s->fd_direct >= 0);
	return 0;
}

/* The device tier: its slots in one device allocation, its policy. */
static int setup_dev(struct md_expert_store *s, const struct md_expert_store_config *c,
		     char *err, size_t errlen)
{
	uint64_t n = c->dev ? c->dev_bytes / s->slot_bytes : 0;
	if (n == 0)
		return 0;
	if (n > s->n_units)
		n = s->n_units;
	s->dev = c->dev;
	s->n_dev = (uint32_t)n;
	s->dslots = calloc(n, sizeof(*s->dslots));
	s->unit_dev = malloc(s->n_units * sizeof(*s->unit_dev));
	s->dpol = md_epol_new(c->policy, s->n_layer, s->n_expert);
	void *p = NULL;
	int rc = s->dslots && s->unit_dev && s->dpol ? s->dev->alloc(s->dev, n * s->slot_bytes, &p)
						      : -ENOMEM;
	if (rc) {
		snprintf(err, errlen, "cannot allocate %.1f MiB of device memory for %u experts",
			 n * s->slot_bytes / 1048576.0, s->n_dev);
		return rc;
	}
	s->dev_arena = p;
	s->c_it = calloc(s->n_expert, sizeof(*s->c_it));
	s->c_idx = calloc(s->n_expert, sizeof(*s->c_idx));
	s->c_order = calloc(s->n_expert, sizeof(*s->c_order));
	s->c_up = calloc(s->n_expert, 1);
	s->c_up_idx = calloc(s->n_expert, sizeof(*s->c_up_idx));
	s->c_mark = calloc(s->n_expert, 1);
	if (!s->c_it || !s->c_idx || !s->c_order || !s->c_up || !s->c_up_idx || !s->c_mark) {
		snprintf(err, errlen, "out of memory for the device tier");
		return -ENOMEM;
	}
	for (uint32_t u = 0; u < s->n_units; u++)
		s->unit_dev[u] = -1;
	for (uint32_t i = s->n_dev; i-- > 0;) {
		s->dslots[i].unit = -1;
		s->dslots[i].next = s->dev_free;
		s->dev_free = (int32_t)i;
	}
	return 0;
}

/* The device's rates for the cost model, measured once at start (a few milliseconds): copies
 * of one slot up and the gate matmul of layer 0's expert 0 at 1 and 16 tokens, timed to their
 * fences. Nothing is resident afterwards; on any error the priors stay. */
static void probe_dev(struct md_expert_store *s)
{
	const struct unit_src *us = &s->units[0];
	const struct md_mat *g = &us->m[0];
	const int T = 16;
	float *x = calloc((size_t)g->n_in * T, sizeof(float));
	float *y = calloc((size_t)g->n_out * T, sizeof(float));
	uint8_t *buf = s->slots[0].buf; /* the first slot, free until the store is handed out */
	uint64_t fence;
	if (!x || !y || read_unit(s, 0, buf))
		goto out;
	double best_up = 0;
	for (int r = 0; r < 3; r++) {
		uint64_t t0 = now_ns();
		if (s->dev->upload_async(s->dev, s->dev_arena, buf, s->slot_bytes,
					 MD_BACKEND_STREAM_COPY) ||
		    s->dev->fence_record(s->dev, MD_BACKEND_STREAM_COPY, &fence) ||
		    s->dev->fence_wait(s->dev, fence))
			goto out;
		double t = (double)(now_ns() - t0) * 1e-9;
		if (r == 0 || t < best_up)
			best_up = t;
	}
	md_xcost_observe_up(&s->cost, s->slot_bytes, best_up);
	struct md_mat w = *g;
	w.data = s->dev_arena + s->part_off[0] + (us->off[0] - align_down(us->off[0]));
	double t1 = 0, t16 = 0;
	for (int r = 0; r < 3; r++)
		for (int i = 0; i < 2; i++) {
			int n = i ? T : 1;
			uint64_t t0 = now_ns();
			if (s->dev->matmul(s->dev, &w, x, n, y))
				goto out;
			double t = (double)(now_ns() - t0) * 1e-9;
			double *best = i ? &t16 : &t1;
			if (r == 0 || t < *best)
				*best = t;
		}
	md_xcost_set_dev(&s->cost, mat_bytes(g), 1, t1, T, t16);
out:
	free(x);
	free(y);
}

/* Back the host slots with memory ahead of their first reads, in huge pages where the kernel
 * gives them. Left to the first read into each slot, a miss would also pay the page faults and
 * the zeroing of its ~2 MiB (512 faults of 4 KiB) on the decode path, while the cache is
 * filling; the budget is the plan's already, so taking it early costs no memory that was not
 * promised. A thread does it, a chunk at a time from the first slot (the free list hands out
 * slot 0 first), so that start-up does not wait for it: this machine backs ~1 GB/s of
 * anonymous memory, and a cache of tens of GiB would otherwise hold the server's readiness
 * (and systemd's start timeout) for as many seconds. A read that reaches a slot first faults
 * its pages itself, as before. */
#define PREFAULT_CHUNK (4u << 20)

static void *prefault_main(void *arg)
{
	struct md_expert_store *s = arg;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19); /* behind everything else */
	const size_t len = (size_t)s->n_slots * s->slot_bytes;
	for (size_t off = 0; off < len && !atomic_load(&s->prefault_stop); off += PREFAULT_CHUNK) {
		size_t n = len - off < PREFAULT_CHUNK ? len - off : PREFAULT_CHUNK;
		int rc = -1;
#ifdef MADV_POPULATE_WRITE
		rc = madvise(s->arena + off, n, MADV_POPULATE_WRITE);
#endif
		if (rc != 0) /* kernels before 5.14: adding 0 keeps what a read put there */
			for (size_t o = 0; o < n; o += 4096)
				__atomic_fetch_add(s->arena + off + o, 0, __ATOMIC_RELAXED);
	}
	return NULL;
}

static void prefault_arena(struct md_expert_store *s)
{
	if (getenv("MOED_ARENA_LAZY")) /* A/B */
		return;
#ifdef MADV_HUGEPAGE
	madvise(s->arena, (size_t)s->n_slots * s->slot_bytes, MADV_HUGEPAGE);
#endif
	s->prefault_on = pthread_create(&s->prefault_th, NULL, prefault_main, s) == 0;
}

int md_expert_store_new(struct md_expert_store **out, const struct md_model *m,
			const struct md_expert_store_config *c, char *err, size_t errlen)
{
	*out = NULL;
	size_t span[3];
	if (!part_spans(m, span)) {
		snprintf(err, errlen, "the model has no routed experts to store");
		return -ENOTSUP;
	}
	size_t slot_bytes = span[0] + span[1] + span[2];
	uint32_t need = max_active(m, c->max_tokens);
	uint64_t n_slots = c->host_bytes / slot_bytes;
	uint64_t all = (uint64_t)(m->hp.n_layer - m->hp.n_layer_dense_lead) * m->hp.n_expert;
	if (n_slots > all)
		n_slots = all;
	if (n_slots < need) {
		snprintf(err, errlen, "expert cache of %.1f MiB holds %llu experts of %.2f MiB, but "
			 "one layer of a %d-token step may use %u (%.1f MiB): raise expert-cache-mb "
			 "or lower step-tokens", c->host_bytes / 1048576.0,
			 (unsigned long long)n_slots, slot_bytes / 1048576.0, c->max_tokens, need,
			 (double)need * slot_bytes / 1048576.0);
		return -EINVAL;
	}
	struct md_expert_store *s = calloc(1, sizeof(*s));
	if (!s) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	s->base.ops = c->prefetch ? &store_ops : &store_ops_nopf;
	s->m = m;
	s->n_layer = m->hp.n_layer;
	s->n_expert = m->hp.n_expert;
	s->n_units = s->n_layer * s->n_expert;
	s->slot_bytes = slot_bytes;
	s->part_off[0] = 0;
	s->part_off[1] = span[0];
	s->part_off[2] = span[0] + span[1];
	s->n_slots = (uint32_t)n_slots;
	s->n_reserve = need;
	s->fd_direct = s->fd_buf = -1;
	s->free_head = -1;
	s->last_layer = -1;
	for (int q = 0; q < 3; q++)
		s->q_head[q] = s->q_tail[q] = -1;
	pthread_mutex_init(&s->mu, NULL);
	pthread_cond_init(&s->job_cv, NULL);
	pthread_cond_init(&s->done_cv, NULL);
	s->units = calloc(s->n_units, sizeof(*s->units));
	s->slots = calloc(s->n_slots, sizeof(*s->slots));
	s->unit_slot = malloc(s->n_units * sizeof(*s->unit_slot));
	s->plan_units = calloc(s->n_expert, sizeof(*s->plan_units));
	s->step_seen = calloc(s->n_units, 1);
	s->predicted = calloc(s->n_units, 1);
	s->has_pred = calloc(s->n_layer, 1);
	s->c_bypass = calloc(s->n_expert, sizeof(*s->c_bypass));
	s->plan_mark = calloc(s->n_expert, 1);
	s->last_use = calloc(s->n_units, sizeof(*s->last_use));
	s->got_dev = calloc(s->n_units, 1);
	s->unit_bytes = calloc(s->n_units, sizeof(*s->unit_bytes));
	s->dev_free = -1;
	s->pol = md_epol_new(c->policy, s->n_layer, s->n_expert);
	/* With a device tier the host slots are its copies' sources: pinned memory (the device's
	 * host_alloc), so that a copy up is a DMA queued on the copy stream while the engine goes
	 * on. From pageable memory the CUDA runtime stages every copy through its own buffers on
	 * the calling thread. (On an H100 with pageable slots, random-1g with a quarter of its
	 * experts on the device decoded 112 tok/s with the cost model and 116 copying every miss,
	 * ~22 MB copied up per token: 2.5 GB/s if the copies were all the time. The pinned slots
	 * have not yet run on a GPU.) Where pinning is refused, mapped. */
	void *arena = NULL;
	if (c->dev && c->dev->host_alloc && !getenv("MOED_NO_PIN") && /* A/B: pageable slots */
	    c->dev->host_alloc(c->dev, (size_t)n_slots * slot_bytes, &arena) == 0) {
		s->arena_dev = c->dev;
	} else {
		arena = mmap(NULL, (size_t)n_slots * slot_bytes, PROT_READ | PROT_WRITE,
			     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (arena == MAP_FAILED)
			arena = NULL;
		if (c->dev && !getenv("MOED_NO_PIN"))
			md_log(MD_LOG_WARN, "expert store: %.0f MiB of host slots could not be "
			       "pinned: copies to the device tier go through the runtime's staging",
			       (double)n_slots * slot_bytes / 1048576.0);
	}
	s->arena = arena;
	if (arena && !s->arena_dev)
		prefault_arena(s);
	int rc;
	if (!s->units || !s->slots || !s->unit_slot || !s->plan_units || !s->step_seen ||
	    !s->predicted || !s->has_pred || !s->c_bypass || !s->plan_mark || !s->last_use ||
	    !s->got_dev ||
	    !s->unit_bytes ||
	    !s->pol || !s->arena) {
		snprintf(err, errlen, "out of memory for an expert cache of %u slots", s->n_slots);
		rc = -ENOMEM;
		goto fail;
	}
	for (uint32_t u = 0; u < s->n_units; u++)
		s->unit_slot[u] = -1;
	for (uint32_t i = s->n_slots; i-- > 0;) {
		s->slots[i].buf = s->arena + (size_t)i * slot_bytes;
		s->slots[i].unit = -1;
		s->slots[i].next = s->free_head;
		s->free_head = (int32_t)i;
	}
	rc = map_units(s, err, errlen);
	if (rc)
		goto fail;
	rc = setup_dev(s, c, err, errlen);
	if (rc)
		goto fail;
	rc = open_file(s, c->buffered, err, errlen);
	if (rc)
		goto fail;
	md_xcost_init(&s->cost, 0, 0, 0);
	s->rates_fixed = c->rates != NULL;
	if (c->rates)
		s->cost = *c->rates;
	else if (s->dev)
		probe_dev(s);
	int n_io = c->io_threads > 0 ? c->io_threads : 4;
	if (n_io > MAX_IO_THREADS)
		n_io = MAX_IO_THREADS;
	for (; s->n_io < n_io; s->n_io++)
		if (pthread_create(&s->io[s->n_io], NULL, io_main, s)) {
			snprintf(err, errlen, "cannot start expert reader threads");
			rc = -EAGAIN;
			goto fail;
		}
	*out = s;
	return 0;
fail:
	md_expert_store_free(s);
	return rc;
}
