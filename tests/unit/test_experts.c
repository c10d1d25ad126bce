/* Unit tests for the expert store (engine/experts.h): logits bit-identical to the mapping at
 * every budget from the smallest allowed to the whole model, through O_DIRECT and buffered
 * reads; a too-small budget refused; an expert between get and release never evicted nor
 * overwritten (also under a random plan/get/release load at the smallest budget); a file cut
 * short under the store fails the request with -EIO, and once the file is whole again the
 * same store serves identical logits; with per-token errors (md_batch.tok_err) only the tokens
 * routed to an unreadable expert fail and the others' logits stay exact.
 *
 * usage: test_experts MOED_GGUF */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend_sim.h"
#include "engine/experts.h"
#include "engine/forward.h"
#include "engine/gguf.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "tests/check.h"
#include "tools/gguf_writer.h"
#include "frand.h"
#include "gen_model.h"

enum { N_PROMPT = 21, N_GEN = 4, ROWS = N_PROMPT + N_GEN, BATCH = 2 };

struct fw {
	struct md_model m;
	struct md_kv_cache kv;
	struct md_forward_ctx *f;
	size_t V;
};

/* Prefill N_PROMPT tokens in batches of BATCH, then N_GEN single-token steps; every row's
 * logits into out. Returns ROWS or md_forward's first error. */
static int run(struct fw *w, float *out)
{
	int32_t tok[ROWS], sq[BATCH], ps[BATCH];
	bool want[BATCH] = { true, true };
	for (int i = 0; i < ROWS; i++)
		tok[i] = (int32_t)((i * 97 + 11) % (int)w->V);
	int s = md_kv_seq_new(&w->kv);
	if (s < 0 || md_kv_reserve(&w->kv, s, ROWS))
		return -ENOSPC;
	int rows = 0, rc = 0;
	for (int t = 0; t < ROWS && rc >= 0;) {
		int n = t < N_PROMPT ? (N_PROMPT - t < BATCH ? N_PROMPT - t : BATCH) : 1;
		for (int j = 0; j < n; j++) {
			sq[j] = s;
			ps[j] = t + j;
		}
		struct md_batch b = { n, tok + t, sq, ps, want, NULL };
		rc = md_forward(w->f, &w->kv, &b, out + (size_t)rows * w->V);
		if (rc > 0)
			rows += rc;
		t += n;
	}
	md_kv_seq_free(&w->kv, s);
	return rc < 0 ? rc : rows;
}

static int fw_open(struct fw *w, const char *path)
{
	char err[256];
	memset(w, 0, sizeof(*w));
	if (md_model_load(&w->m, path, err, sizeof err)) {
		fprintf(stderr, "load: %s\n", err);
		return -1;
	}
	w->V = w->m.hp.n_vocab;
	if (md_kv_init(&w->kv, w->m.hp.n_layer, w->m.hp.n_head_kv * w->m.hp.head_dim, 16, 4))
		return -1;
	w->f = md_forward_new(&w->m, 2, BATCH);
	return w->f ? 0 : -1;
}

static void fw_close(struct fw *w)
{
	md_forward_free(w->f);
	md_kv_release(&w->kv);
	md_model_free(&w->m);
}

static enum md_epol_kind store_policy = MD_EPOL_LRU; /* of the stores store_new makes */

static struct md_expert_store *store_new(const struct md_model *m, size_t slots, bool buffered,
					 bool prefetch, char *err, int *rc)
{
	struct md_expert_store_config c = {
		.host_bytes = slots * md_expert_store_slot_bytes(m),
		.policy = store_policy,
		.io_threads = 3,
		.max_tokens = BATCH,
		.buffered = buffered,
		.prefetch = prefetch,
	};
	struct md_expert_store *s = NULL;
	*rc = md_expert_store_new(&s, m, &c, err, 256);
	return s;
}

/* Rewrite src as dst with blk.<last>.ffn_down_exps moved to the end of the file, so that
 * cutting the file short takes only experts away (what the mapping reads stays). */
static int fill_copy(void *ctx, void *dst, size_t n)
{
	memcpy(dst, ctx, n);
	return 0;
}

static int rewrite_down_last(const char *src, const char *dst, const char *last)
{
	struct md_gguf g;
	char err[256];
	if (md_gguf_open(&g, src, err, sizeof err)) {
		fprintf(stderr, "open: %s\n", err);
		return -1;
	}
	struct md_gguf_writer *w = md_gguf_writer_new();
	md_gguf_w_copy_kv(w, &g);
	const struct md_gguf_tensor *tl = NULL;
	for (uint64_t i = 0; i < g.n_tensors; i++) {
		const struct md_gguf_tensor *t = &g.tensors[i];
		char name[128];
		snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
		if (strcmp(name, last) == 0) {
			tl = t;
			continue;
		}
		md_gguf_w_tensor(w, name, t->type, t->n_dims, t->ne, fill_copy, (void *)t->data);
	}
	int rc = -1;
	if (tl) {
		md_gguf_w_tensor(w, last, tl->type, tl->n_dims, tl->ne, fill_copy, (void *)tl->data);
		rc = md_gguf_writer_write(w, dst, err, sizeof err);
		if (rc)
			fprintf(stderr, "write: %s\n", err);
	}
	md_gguf_writer_free(w);
	md_gguf_close(&g);
	return rc;
}

static const char *const gen_args[] = { "--arch", "qwen3moe", "--type", "q8_0", "--seed", "5",
	"--n-layer", "3", "--n-embd", "256", "--head-dim", "64", "--n-ff-exp", "256", "--n-expert",
	"32", "--n-expert-used", "2", NULL };

/* Identical logits at every budget, and the counters a user reads to see it working. */
static void test_budgets(const char *path, float *ref, float *got)
{
	struct fw w;
	if (fw_open(&w, path)) {
		failures++;
		return;
	}
	const uint32_t units = w.m.hp.n_layer * w.m.hp.n_expert;
	const size_t need = md_expert_store_min_bytes(&w.m, BATCH) / md_expert_store_slot_bytes(&w.m);
	CHECK_EQ_I(need, 4); /* 2 tokens x 2 experts */
	CHECK_EQ_I(run(&w, ref), ROWS);

	const size_t budgets[] = { need, units / 10, units / 2, units };
	for (int bi = 0; bi < 4; bi++)
		for (int mode = 0; mode < 5; mode++) { /* O_DIRECT, buffered, O_DIRECT + prefetch;
							* lfu, pred (with its transit misses) */
			bool buffered = mode == 1, prefetch = mode == 2;
			store_policy = mode == 3 ? MD_EPOL_LFU : mode == 4 ? MD_EPOL_PRED : MD_EPOL_LRU;
			if (mode >= 3 && bi >= 2)
				continue; /* the other policies where they evict */
			char err[256] = "";
			int rc;
			struct md_expert_store *s = store_new(&w.m, budgets[bi], buffered, prefetch,
							      err, &rc);
			CHECK_EQ_I(rc, 0);
			if (!s) {
				fprintf(stderr, "store: %s\n", err);
				continue;
			}
			md_forward_set_expert_src(w.f, md_expert_store_src(s));
			memset(got, 0, ROWS * w.V * sizeof(float));
			CHECK_EQ_I(run(&w, got), ROWS);
			CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
			struct md_expert_store_stats st;
			md_expert_store_get_stats(s, &st);
			CHECK_EQ_U(st.n_slots, budgets[bi]);
			CHECK(st.misses > 0 && st.bytes_read >= st.misses * 3 * 256 * 272);
			CHECK_EQ_U(st.read_errors, 0);
			CHECK_EQ_U(st.steps, (N_PROMPT + 1) / BATCH + N_GEN - 1); /* passes, less the open one */
			if (buffered)
				CHECK(!st.direct);
			if (budgets[bi] < units / 2)
				CHECK(st.evictions > 0);
			/* The whole model cached: a second pass misses nothing. */
			if (budgets[bi] == units) {
				CHECK_EQ_U(st.evictions, 0);
				uint64_t misses = st.misses, bytes = st.bytes_read, stall = st.stall_ns;
				CHECK_EQ_I(run(&w, got), ROWS);
				CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
				md_expert_store_get_stats(s, &st);
				CHECK_EQ_U(st.misses, misses);
				if (!prefetch) { /* a prefetch may read a guess the first pass never used */
					CHECK_EQ_U(st.bytes_read, bytes);
					CHECK_EQ_U(st.stall_ns, stall);
				}
			}
			if (prefetch) {
				/* Two of the three layers get a prediction each pass. */
				CHECK(st.predicted_total > 0 && st.predicted_used > 0);
				CHECK(st.predicted_used <= st.predicted_total);
				CHECK(bi == 3 || st.prefetch_issued > 0);
				CHECK(st.prefetch_used + st.prefetch_cancelled <= st.prefetch_issued);
				CHECK(st.n_resident <= st.n_slots);
				printf("experts: %zu slots: prefetch accuracy %.2f, %llu issued, %llu "
				       "used, %llu cancelled unread, %.2f MiB wasted\n", budgets[bi],
				       (double)st.predicted_used / (double)st.predicted_total,
				       (unsigned long long)st.prefetch_issued,
				       (unsigned long long)st.prefetch_used,
				       (unsigned long long)st.prefetch_cancelled,
				       st.prefetch_wasted_bytes / 1048576.0);
			} else {
				CHECK_EQ_U(st.predicted_total, 0);
			}
			if (mode < 4)
				CHECK_EQ_U(st.bypassed, 0); /* only pred declines to admit */
			if (mode == 4)
				printf("experts: pred at %zu slots: %llu misses, %llu streamed through "
				       "as transit\n", budgets[bi], (unsigned long long)st.misses,
				       (unsigned long long)st.bypassed);
			if (bi == 0 && mode == 0)
				printf("experts: reads %s; smallest budget: %llu misses, %llu hits, "
				       "%llu evictions, %.1f MiB read\n",
				       st.direct ? "O_DIRECT" : "buffered (O_DIRECT refused here)",
				       (unsigned long long)st.misses, (unsigned long long)st.hits,
				       (unsigned long long)st.evictions, st.bytes_read / 1048576.0);
			md_forward_set_expert_src(w.f, NULL);
			md_expert_store_free(s);
		}
	store_policy = MD_EPOL_LRU;

	/* One slot short of a layer's active experts for a full step: refused, with the numbers. */
	char err[256] = "";
	int rc;
	struct md_expert_store *s = store_new(&w.m, need - 1, false, false, err, &rc);
	CHECK(s == NULL);
	CHECK_EQ_I(rc, -EINVAL);
	CHECK(strstr(err, "expert-cache-mb") != NULL);
	CHECK(strstr(err, "holds 3 experts") != NULL);
	fw_close(&w);
}

/* The simulated device tier: identical logits with experts computed on the device, copies
 * fast and slow (so that plans meet copies still in flight), a device budget far below the
 * experts used (evictions); device memory is what the tier asked for, and freed with it. */
static void test_device(const char *path, const float *ref, float *got)
{
	struct fw w;
	if (fw_open(&w, path)) {
		failures++;
		return;
	}
	const size_t slot = md_expert_store_slot_bytes(&w.m);
	/* Copies instant, or at 20 MB/s (a slot takes ~10 ms); the last case has the smallest host
	 * budget, so plans must wait for copies that hold the only slots they could take. */
	const double bws[3] = { 0, 20e6, 20e6 };
	const size_t host[3] = { 48, 48, 4 }, devs[3] = { 6, 6, 2 };
	for (int bi = 0; bi < 3; bi++) {
		struct md_backend *dev = md_backend_sim_new(64 * slot, bws[bi]);
		CHECK(dev != NULL);
		if (!dev)
			break;
		struct md_expert_store_config c = {
			.host_bytes = host[bi] * slot, .policy = MD_EPOL_LRU, .io_threads = 2,
			.max_tokens = BATCH, .prefetch = true, .dev = dev, .dev_bytes = devs[bi] * slot,
		};
		char err[256];
		struct md_expert_store *s = NULL;
		CHECK_EQ_I(md_expert_store_new(&s, &w.m, &c, err, sizeof err), 0);
		if (!s) {
			md_backend_sim_free(dev);
			continue;
		}
		CHECK_EQ_U(md_backend_sim_used(dev), devs[bi] * slot);
		unsigned long copies0 = md_backend_sim_copies(dev); /* the start-up probe's */
		md_forward_set_expert_src(w.f, md_expert_store_src(s));
		for (int pass = 0; pass < 2; pass++) {
			memset(got, 0, ROWS * w.V * sizeof(float));
			CHECK_EQ_I(run(&w, got), ROWS);
			CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
		}
		struct md_expert_store_stats st;
		md_expert_store_get_stats(s, &st);
		CHECK_EQ_U(st.dev_slots, devs[bi]);
		CHECK(st.dev_uploads >= devs[bi] && st.dev_resident == devs[bi]);
		if (bi == 0) /* instant copies: the timing cannot hide the device from plans */
			CHECK(st.dev_hits > 0 && st.dev_uploads > 6 && st.dev_evictions > 0);
		CHECK_EQ_U(md_backend_sim_copies(dev) - copies0, st.dev_uploads);
		CHECK_EQ_U(st.dev_misses, st.dev_compute_dev + st.dev_compute_host);
		CHECK_EQ_U(st.dev_mem_bytes, devs[bi] * slot);
		printf("experts: device tier (%zu host, %zu device slots, %s copies): %llu device hits, %llu uploads, %llu "
		       "evictions\n", host[bi], devs[bi], bi ? "20 MB/s" : "instant",
		       (unsigned long long)st.dev_hits,
		       (unsigned long long)st.dev_uploads, (unsigned long long)st.dev_evictions);
		md_forward_set_expert_src(w.f, NULL);
		md_expert_store_free(s);
		CHECK_EQ_U(md_backend_sim_used(dev), 0);
		md_backend_sim_free(dev);
	}
	/* A device too small for its budget: the store is refused with the reason. */
	struct md_backend *dev = md_backend_sim_new(2 * slot, 0);
	struct md_expert_store_config c = { .host_bytes = 48 * slot, .max_tokens = BATCH,
					    .dev = dev, .dev_bytes = 6 * slot };
	char err[256] = "";
	struct md_expert_store *s = NULL;
	CHECK_EQ_I(md_expert_store_new(&s, &w.m, &c, err, sizeof err), -ENOMEM);
	CHECK(s == NULL && strstr(err, "device memory") != NULL);
	md_backend_sim_free(dev);
	fw_close(&w);
}

/* Compute where it lives through the store: the cost model's choice for device misses, each
 * way with the logits of the mapping. Copies at 2 MB/s (a slot takes ~100 ms, measured by the
 * start-up probe): misses run on the CPU. Instant copies but a device whose matmul reads 5 MB/s
 * (measured likewise): the CPU again. Fixed rates with a bus far faster than the CPU's reads:
 * misses are copied up and computed on the device for the step; with a bus at 1 kB/s: none
 * is. */
static void test_compute_where(const char *path, const float *ref, float *got)
{
	struct fw w;
	if (fw_open(&w, path)) {
		failures++;
		return;
	}
	const size_t slot = md_expert_store_slot_bytes(&w.m);
	struct md_xcost fast, slow;
	md_xcost_init(&fast, 1e9, 1e13, 1e12);
	md_xcost_init(&slow, 1e9, 1e13, 1e3);
	const struct md_xcost *rates[4] = { NULL, &fast, &slow, NULL };
	/* measured: slow enough that no CPU under any load is slower; two device slots so that
	 * background copies (at most one per device slot in flight) stay few */
	const double bw[4] = { 2e6, 0, 0, 0 }, compute[4] = { 0, 0, 0, 5e6 };
	const size_t devs[4] = { 2, 12, 12, 2 };
	for (int ci = 0; ci < 4; ci++) {
		struct md_backend *dev = md_backend_sim_new(64 * slot, 0);
		CHECK(dev != NULL);
		if (!dev)
			break;
		md_backend_sim_set_rates(dev, bw[ci], compute[ci]);
		struct md_expert_store_config c = {
			.host_bytes = 48 * slot, .policy = MD_EPOL_LRU, .io_threads = 2,
			.max_tokens = BATCH, .prefetch = true, .dev = dev, .dev_bytes = devs[ci] * slot,
			.rates = rates[ci],
		};
		char err[256];
		struct md_expert_store *s = NULL;
		CHECK_EQ_I(md_expert_store_new(&s, &w.m, &c, err, sizeof err), 0);
		if (!s) {
			md_backend_sim_free(dev);
			continue;
		}
		md_forward_set_expert_src(w.f, md_expert_store_src(s));
		for (int pass = 0; pass < 2; pass++) {
			memset(got, 0, ROWS * w.V * sizeof(float));
			CHECK_EQ_I(run(&w, got), ROWS);
			CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
		}
		struct md_expert_store_stats st;
		md_expert_store_get_stats(s, &st);
		CHECK_EQ_U(st.dev_misses, st.dev_compute_dev + st.dev_compute_host);
		if (ci == 1) {
			CHECK(st.dev_compute_dev > 0 && st.dev_hits > 0);
		} else {
			CHECK_EQ_U(st.dev_compute_dev, 0);
			CHECK(st.dev_compute_host > 0);
		}
		if (ci == 0) /* the probe measured the bus */
			CHECK(st.dev_up_bps > 1e6 && st.dev_up_bps < 3e6);
		printf("experts: compute where it lives (%s): %llu device hits, %llu misses copied up "
		       "for the step, %llu on the CPU\n", ci == 0 ? "2 MB/s copies, measured" :
		       ci == 1 ? "fixed rates, fast bus" : ci == 2 ? "fixed rates, slow bus" :
		       "instant copies, device computing at 5 MB/s, measured",
		       (unsigned long long)st.dev_hits,
		       (unsigned long long)st.dev_compute_dev, (unsigned long long)st.dev_compute_host);
		md_forward_set_expert_src(w.f, NULL);
		md_expert_store_free(s);
		md_backend_sim_free(dev);
	}
	fw_close(&w);
}

/* Warm restart: the hot set saved by one store makes the next one's first pass miss less;
 * a file of another model is refused and queues nothing. */
static void test_warm(const char *path, const float *ref, float *got)
{
	struct fw w;
	if (fw_open(&w, path)) {
		failures++;
		return;
	}
	char err[256], hot[700];
	int rc;
	snprintf(hot, sizeof hot, "%s.hot", path);
	struct md_expert_store *a = store_new(&w.m, 24, false, false, err, &rc);
	struct md_expert_store *b = store_new(&w.m, 24, false, false, err, &rc);
	CHECK(a && b);
	if (a && b) {
		struct md_expert_store_stats sa, sb;
		md_forward_set_expert_src(w.f, md_expert_store_src(a));
		CHECK_EQ_I(run(&w, got), ROWS);
		md_expert_store_get_stats(a, &sa);
		CHECK_EQ_I(md_expert_store_save(a, hot), 0);
		uint32_t n = 0;
		CHECK_EQ_I(md_expert_store_warm(b, hot, &n), 0);
		CHECK_EQ_U(n, 24);
		md_forward_set_expert_src(w.f, md_expert_store_src(b));
		memset(got, 0, ROWS * w.V * sizeof(float));
		CHECK_EQ_I(run(&w, got), ROWS);
		CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
		md_expert_store_get_stats(b, &sb);
		CHECK(sb.misses < sa.misses);
		CHECK(sb.prefetch_used > 0);
		printf("experts: warm start: %llu misses against %llu cold\n",
		       (unsigned long long)sb.misses, (unsigned long long)sa.misses);
		md_forward_set_expert_src(w.f, NULL);
		/* Another model's file (a different expert count): refused, nothing read. */
		FILE *f = fopen(hot, "w");
		CHECK(f != NULL);
		if (f) {
			fprintf(f, "moed-hot-experts 1\nlayers 3 experts 16 file-bytes %zu\n0 1\n",
				w.m.gguf.size);
			fclose(f);
		}
		md_expert_store_free(b);
		b = store_new(&w.m, 24, false, false, err, &rc);
		CHECK_EQ_I(md_expert_store_warm(b, hot, &n), -EINVAL);
		CHECK_EQ_U(n, 0);
		md_expert_store_get_stats(b, &sb);
		CHECK_EQ_U(sb.n_resident, 0);
		CHECK_EQ_I(md_expert_store_warm(b, "/nonexistent/hot", &n), -ENOENT);
	}
	md_expert_store_free(a);
	md_expert_store_free(b);
	unlink(hot);
	fw_close(&w);
}

/* The bytes of expert e of layer l in the mapping, gate/up/down. */
static bool same_as_file(const struct md_model *m, uint32_t l, int32_t e, const struct md_expert_w *x)
{
	const struct md_layer *L = &m->layers[l];
	struct md_mat f[3] = { md_mat_of(L->gate_exps, e), md_mat_of(L->up_exps, e),
			       md_mat_of(L->down_exps, e) };
	const struct md_mat *g[3] = { &x->gate, &x->up, &x->down };
	for (int p = 0; p < 3; p++)
		if (g[p]->n_out != f[p].n_out || g[p]->nb1 != f[p].nb1 ||
		    memcmp(g[p]->data, f[p].data, f[p].nb1 * (size_t)f[p].n_out) != 0)
			return false;
	return true;
}

static uint32_t rnd(void)
{
	return (uint32_t)((frand() + 1.0f) * 1048576.0f);
}

/* Experts between get and release stay: a prefetch finds no slot while they are held, and
 * under a random load at the smallest budget every held view keeps the file's bytes. */
static void test_in_use(const char *path)
{
	struct fw w;
	if (fw_open(&w, path)) {
		failures++;
		return;
	}
	char err[256];
	int rc;
	struct md_expert_store *s = store_new(&w.m, 4, false, true, err, &rc);
	CHECK(s != NULL);
	if (!s) {
		fw_close(&w);
		return;
	}
	struct md_expert_src *src = md_expert_store_src(s);
	const int32_t ex[4] = { 3, 9, 17, 30 };
	int32_t order[32];
	struct md_expert_w x[4];
	CHECK_EQ_I(md_expert_src_plan(src, 0, ex, NULL, 4, order), 0); /* nothing resident yet */
	for (int i = 0; i < 4; i++) {
		CHECK_EQ_I(md_expert_src_get(src, 0, ex[order[i]], &x[i]), 0);
		CHECK(same_as_file(&w.m, 0, ex[order[i]], &x[i]));
	}
	/* Every slot held: a prefetch cannot take one. */
	const int32_t pf[4] = { 0, 1, 2, 3 };
	md_expert_src_prefetch(src, 1, pf, 4);
	struct md_expert_store_stats st;
	md_expert_store_get_stats(s, &st);
	CHECK_EQ_U(st.prefetch_issued, 0);
	CHECK_EQ_U(st.evictions, 0);
	for (int i = 0; i < 4; i++) {
		CHECK(md_expert_store_resident(s, 0, (uint32_t)ex[i]));
		CHECK(same_as_file(&w.m, 0, ex[order[i]], &x[i]));
	}
	for (int i = 0; i < 4; i++)
		md_expert_src_release(src, 0, ex[order[i]]);
	/* Released: the prefetch now evicts them; the next plan finds its experts read. */
	md_expert_src_prefetch(src, 1, pf, 4);
	md_expert_store_get_stats(s, &st);
	CHECK_EQ_U(st.prefetch_issued, 4);
	CHECK_EQ_U(st.evictions, 4);
	CHECK(!md_expert_store_resident(s, 0, 3));
	CHECK(md_expert_src_plan(src, 1, pf, NULL, 4, order) >= 0);
	for (int i = 0; i < 4; i++) {
		CHECK_EQ_I(md_expert_src_get(src, 1, pf[order[i]], &x[i]), 0);
		CHECK(same_as_file(&w.m, 1, pf[order[i]], &x[i]));
	}
	for (int i = 0; i < 4; i++)
		md_expert_src_release(src, 1, pf[order[i]]);
	md_expert_store_get_stats(s, &st);
	CHECK_EQ_U(st.prefetch_used, 4);
	CHECK_EQ_U(st.predicted_used, 4);
	CHECK_EQ_U(st.predicted_total, 4);

	/* Random plans of 1..4 experts with prefetches between: every view, checked after all
	 * the layer's gets (the later reads evict around it), has the file's bytes. */
	frand_seed(77);
	int bad = 0;
	for (int it = 0; it < 300; it++) {
		uint32_t l = (uint32_t)(rnd() % 3);
		int n = 1 + (int)(rnd() % 4);
		int32_t set[4];
		uint32_t used = 0;
		for (int i = 0; i < n;) {
			int32_t e = (int32_t)(rnd() % 32);
			if (used >> e & 1)
				continue;
			used |= 1u << e;
			set[i++] = e;
		}
		for (int i = 1; i < n; i++) /* ascending */
			for (int j = i; j > 0 && set[j] < set[j - 1]; j--) {
				int32_t t = set[j];
				set[j] = set[j - 1];
				set[j - 1] = t;
			}
		int ready = md_expert_src_plan(src, l, set, NULL, n, order);
		if (ready < 0 || ready > n)
			bad++;
		for (int i = 0; i < ready; i++)
			if (!md_expert_store_resident(s, l, (uint32_t)set[order[i]]))
				bad++;
		uint32_t nl = (l + 1) % 3;
		int32_t guess = (int32_t)(rnd() % 32);
		md_expert_src_prefetch(src, nl, &guess, 1);
		for (int i = 0; i < n; i++)
			if (md_expert_src_get(src, l, set[order[i]], &x[i]))
				bad++;
		for (int i = 0; i < n; i++)
			if (!same_as_file(&w.m, l, set[order[i]], &x[i]))
				bad++;
		for (int i = 0; i < n; i++)
			md_expert_src_release(src, l, set[order[i]]);
	}
	CHECK_EQ_I(bad, 0);
	md_expert_store_get_stats(s, &st);
	CHECK(st.evictions > 100);
	CHECK_EQ_U(st.read_errors, 0);
	md_expert_store_free(s);
	fw_close(&w);
}

/* The file cut short under the store: the request fails with -EIO, nothing is held, and the
 * same store serves identical logits once the file is whole again. */
static void test_truncated(const char *path, const float *ref, float *got)
{
	char cut[700];
	snprintf(cut, sizeof cut, "%s.cut", path);
	if (rewrite_down_last(path, cut, "blk.2.ffn_down_exps.weight")) {
		failures++;
		return;
	}
	struct fw w;
	if (fw_open(&w, cut)) {
		failures++;
		unlink(cut);
		return;
	}
	char err[256];
	int rc;
	uint32_t units = w.m.hp.n_layer * w.m.hp.n_expert;
	struct md_expert_store *s = store_new(&w.m, units, false, false, err, &rc);
	CHECK(s != NULL);
	const struct md_tensor *d = w.m.layers[2].down_exps;
	off_t size = (off_t)w.m.gguf.size;
	off_t keep = (off_t)((const uint8_t *)d->data - w.m.gguf.base) + (off_t)(d->nb2 * 8) + 100;
	size_t tail_len = (size_t)(size - keep);
	uint8_t *tail = malloc(tail_len);
	int fd = open(cut, O_RDWR);
	CHECK(fd >= 0 && tail && pread(fd, tail, tail_len, keep) == (ssize_t)tail_len);
	CHECK_EQ_I(ftruncate(fd, keep), 0);
	if (s) {
		struct md_expert_src *src = md_expert_store_src(s);
		int32_t order[4];
		struct md_expert_w x;
		/* Expert 8 of layer 2 is cut mid-way, 20 is gone, 7 is whole. */
		const int32_t e7 = 7, e8 = 8, e20 = 20;
		CHECK_EQ_I(md_expert_src_plan(src, 2, &e8, NULL, 1, order), 0);
		CHECK_EQ_I(md_expert_src_get(src, 2, e8, &x), -EIO);
		CHECK_EQ_I(md_expert_src_plan(src, 2, &e20, NULL, 1, order), 0);
		CHECK_EQ_I(md_expert_src_get(src, 2, e20, &x), -EIO);
		CHECK_EQ_I(md_expert_src_plan(src, 2, &e7, NULL, 1, order), 0);
		CHECK_EQ_I(md_expert_src_get(src, 2, e7, &x), 0);
		CHECK(same_as_file(&w.m, 2, e7, &x));
		md_expert_src_release(src, 2, e7);

		md_forward_set_expert_src(w.f, src);
		CHECK_EQ_I(run(&w, got), -EIO);
		struct md_expert_store_stats st;
		md_expert_store_get_stats(s, &st);
		CHECK(st.read_errors >= 3);
		/* Whole again: the failed experts are read anew, the logits are the reference's. */
		CHECK(pwrite(fd, tail, tail_len, keep) == (ssize_t)tail_len);
		memset(got, 0, ROWS * w.V * sizeof(float));
		CHECK_EQ_I(run(&w, got), ROWS);
		CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
		md_forward_set_expert_src(w.f, NULL);
		md_expert_store_free(s);
	}
	if (fd >= 0)
		close(fd);
	free(tail);
	fw_close(&w);
	unlink(cut);
}

/* Tokens of the last layer's routing that picked an expert >= first_bad (route observer). */
struct bad_obs {
	uint32_t layer;
	int32_t first_bad;
	bool bad[64];
};

static void on_route_bad(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct bad_obs *o = ud;
	if (layer != o->layer)
		return;
	for (int t = 0; t < r->n_tokens; t++)
		for (int j = 0; j < r->n_used; j++)
			o->bad[t] |= r->ids[t * r->n_used + j] >= o->first_bad;
}

enum { PF_SEQS = 8, PF_LEN = 3, PF_TOK = PF_SEQS * PF_LEN };

/* One batch of PF_SEQS sequences of PF_LEN tokens each, logits of each sequence's last token
 * into out (PF_SEQS rows). tok_err: the batch's per-token errors, or NULL. */
static int run_partial(struct md_model *m, struct md_expert_src *src, int32_t *tok_err,
		       struct bad_obs *obs, float *out)
{
	struct md_kv_cache kv;
	if (md_kv_init(&kv, m->hp.n_layer, m->hp.n_head_kv * m->hp.head_dim, 2 * PF_SEQS, PF_SEQS))
		return -ENOMEM;
	struct md_forward_ctx *f = md_forward_new(m, 2, PF_TOK);
	int32_t tok[PF_TOK], sq[PF_TOK], ps[PF_TOK];
	for (int i = 0; i < PF_SEQS; i++) {
		int s = md_kv_seq_new(&kv);
		CHECK(s >= 0 && md_kv_reserve(&kv, s, PF_LEN) == 0);
		for (int j = 0; j < PF_LEN; j++) {
			tok[i * PF_LEN + j] = (int32_t)((i * 131 + j * 17 + 5) % (int)m->hp.n_vocab);
			sq[i * PF_LEN + j] = s;
			ps[i * PF_LEN + j] = j;
		}
	}
	md_forward_set_expert_src(f, src);
	if (obs)
		md_forward_set_route_cb(f, on_route_bad, obs);
	struct md_batch b = { PF_TOK, tok, sq, ps, NULL, tok_err };
	int rc = md_forward(f, &kv, &b, out);
	md_forward_free(f);
	md_kv_release(&kv);
	return rc;
}

/* A read error fails only the tokens routed to the expert that cannot be read: with
 * md_batch.tok_err the forward pass goes on, marks exactly those tokens, and every sequence
 * without a marked token gets the mapping's logits bit for bit. */
static void test_partial(const char *path)
{
	char cut[700];
	snprintf(cut, sizeof cut, "%s.cut2", path);
	if (rewrite_down_last(path, cut, "blk.2.ffn_down_exps.weight")) {
		failures++;
		return;
	}
	struct fw w;
	if (fw_open(&w, cut)) {
		failures++;
		unlink(cut);
		return;
	}
	float *ref = calloc((size_t)PF_SEQS * w.V, sizeof(float));
	float *got = calloc((size_t)PF_SEQS * w.V, sizeof(float));
	CHECK_EQ_I(run_partial(&w.m, NULL, NULL, NULL, ref), PF_SEQS);
	/* Experts 29..31 of layer 2 lose their down matrix (28 is cut mid-way). */
	const struct md_tensor *d = w.m.layers[2].down_exps;
	off_t keep = (off_t)((const uint8_t *)d->data - w.m.gguf.base) + (off_t)(d->nb2 * 28) + 100;
	CHECK_EQ_I(truncate(cut, keep), 0);
	char err[256];
	int rc;
	struct md_expert_store *s = store_new(&w.m, w.m.hp.n_layer * w.m.hp.n_expert, false, true,
					      err, &rc);
	CHECK(s != NULL);
	if (s) {
		int32_t tok_err[PF_TOK];
		struct bad_obs obs = { .layer = 2, .first_bad = 28 };
		CHECK_EQ_I(run_partial(&w.m, md_expert_store_src(s), tok_err, &obs, got), PF_SEQS);
		int n_bad = 0, n_good = 0;
		for (int i = 0; i < PF_SEQS; i++) {
			bool seq_bad = false;
			for (int j = 0; j < PF_LEN; j++) {
				int t = i * PF_LEN + j;
				CHECK_EQ_I(tok_err[t] != 0, obs.bad[t]);
				if (tok_err[t])
					CHECK_EQ_I(tok_err[t], -EIO);
				seq_bad |= tok_err[t] != 0;
			}
			if (seq_bad) {
				n_bad++;
				continue;
			}
			n_good++;
			CHECK(memcmp(got + (size_t)i * w.V, ref + (size_t)i * w.V,
				     w.V * sizeof(float)) == 0);
		}
		/* The batch has both kinds, or the test shows nothing. */
		CHECK(n_bad > 0 && n_good > 0);
		/* Without tok_err the same batch fails as a whole. */
		CHECK_EQ_I(run_partial(&w.m, md_expert_store_src(s), NULL, NULL, got), -EIO);
		md_expert_store_free(s);
	}
	free(ref);
	free(got);
	fw_close(&w);
	unlink(cut);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_experts MOED_GGUF\n");
		return 2;
	}
	char dir[512], path[600];
	if (gen_model(argv[1], gen_args, "store.gguf", dir, sizeof dir, path, sizeof path))
		return 1;
	float *ref = calloc((size_t)ROWS * 512, sizeof(float));
	float *got = calloc((size_t)ROWS * 512, sizeof(float));
	test_budgets(path, ref, got);
	test_in_use(path);
	test_warm(path, ref, got);
	test_device(path, ref, got);
	test_compute_where(path, ref, got);
	test_truncated(path, ref, got);
	test_partial(path);
	free(ref);
	free(got);
	gen_model_cleanup(dir, path);
	if (failures) {
		fprintf(stderr, "experts: %d failures\n", failures);
		return 1;
	}
	printf("experts: ok\n");
	return 0;
}
