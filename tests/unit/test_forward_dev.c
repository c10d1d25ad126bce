/* The forward pass on a device (engine/forward_dev.h) against the CPU forward pass, on the
 * simulated device (engine/backend_sim.h), so that it runs in CI without a GPU: every
 * architecture the device path takes and several weight types, experts resident on the
 * device, computed on the CPU from the mapping, or served by the expert store with a device
 * tier; a scenario of two sequences prefilling in chunks and decoding together, a fork whose
 * shared tail block is copied on write, a rollback, and a self-speculation draft pass.
 *
 * What is asserted: the logits of every row equal the CPU pass's bit for bit (the simulated
 * device computes with the CPU's kernels in the CPU pass's order), except where the CPU pass
 * sums in double (Qwen2-MoE's shared-expert gate: within 1e-5 of the row's largest logit);
 * greedy choices equal everywhere; the route observer sees the same routings; a device too
 * small for the weights is refused with the reason. tests/gpu/ runs the same comparison on a
 * real GPU through tests/gpu/test_gpu.c. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend_sim.h"
#include "engine/expert_cost.h"
#include "engine/experts.h"
#include "engine/forward.h"
#include "engine/forward_dev.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "tests/check.h"
#include "tests/unit/fwd_scenario.h"
#include "gen_model.h"

struct route_count {
	unsigned long calls, slots;
	uint64_t hash;
};

static void on_route(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct route_count *c = ud;
	c->calls++;
	c->slots += (unsigned long)r->off[r->n_expert];
	for (int s = 0; s < r->off[r->n_expert]; s++)
		c->hash = c->hash * 1000003u + (uint64_t)(r->tok[s] * 131 + layer * 7 + s);
	for (int a = 0; a < r->n_active; a++)
		c->hash = c->hash * 31u + (uint64_t)r->active[a];
}

enum mode { RESIDENT, HOST_EXPERTS, STORE_DEVICE, STORE_COPY };
static const char *const mode_name[] = { "experts resident", "experts on the CPU (mapping)",
					  "expert store with a device tier",
					  "expert store, every device miss copied up" };

/* One model through the scenario on the CPU and on the simulated device in each mode. */
static void check_model(const char *moed_gguf, const char *label, const char *const *args,
			bool exact)
{
	char dir[512], path[600], err[256];
	if (gen_model(moed_gguf, args, "m.gguf", dir, sizeof dir, path, sizeof path)) {
		failures++;
		return;
	}
	struct md_model m;
	if (md_model_load(&m, path, err, sizeof err)) {
		fprintf(stderr, "%s: load: %s\n", label, err);
		failures++;
		gen_model_cleanup(dir, path);
		return;
	}
	const size_t V = m.hp.n_vocab;
	float *ref = calloc(FWS_MAX_ROWS * V, sizeof(float));
	float *got = calloc(FWS_MAX_ROWS * V, sizeof(float));
	struct route_count rc_cpu = { 0 }, rc_dev = { 0 };
	int n_ref = fws_run(&m, NULL, NULL, on_route, &rc_cpu, ref);
	CHECK_MSG(n_ref > 0, "%s: CPU scenario failed (%d)", label, n_ref);
	for (int mode = RESIDENT; mode <= STORE_COPY && n_ref > 0; mode++) {
		if (mode != RESIDENT && !m.hp.n_expert)
			break;
		struct md_backend *dev = md_backend_sim_new((size_t)1 << 32, 0);
		struct md_expert_store *store = NULL;
		static struct md_xcost copy_up; /* the CPU "costs" forever: misses go up */
		md_xcost_init(&copy_up, 1.0, 0, 0);
		if (mode >= STORE_DEVICE) {
			size_t slot = md_expert_store_slot_bytes(&m);
			uint32_t units = m.hp.n_layer * m.hp.n_expert;
			struct md_expert_store_config c = {
				.host_bytes = (units / 2 + 8) * slot, .policy = MD_EPOL_LRU,
				.io_threads = 2, .max_tokens = FWS_BATCH, .dev = dev,
				.dev_bytes = (units / 4 + 4) * slot,
				.rates = mode == STORE_COPY ? &copy_up : NULL,
			};
			CHECK_EQ_I(md_expert_store_new(&store, &m, &c, err, sizeof err), 0);
		}
		struct fws_dev fd = { .dev = dev, .resident = mode == RESIDENT,
				      .src = store ? md_expert_store_src(store) : NULL };
		memset(&rc_dev, 0, sizeof rc_dev);
		memset(got, 0, FWS_MAX_ROWS * V * sizeof(float));
		int n_got = fws_run(&m, &fd, NULL, on_route, &rc_dev, got);
		CHECK_MSG(n_got == n_ref, "%s, %s: %d rows, the CPU %d (%s)", label, mode_name[mode],
			  n_got, n_ref, fd.err);
		int n_argmax = 0, n_exact = 0;
		double worst = 0;
		for (int r = 0; r < n_ref && n_got == n_ref; r++) {
			const float *a = ref + (size_t)r * V, *b = got + (size_t)r * V;
			size_t ia = 0, ib = 0;
			float amax = 0;
			double d = 0;
			for (size_t i = 0; i < V; i++) {
				ia = a[i] > a[ia] ? i : ia;
				ib = b[i] > b[ib] ? i : ib;
				amax = fabsf(a[i]) > amax ? fabsf(a[i]) : amax;
				d = fabs((double)a[i] - b[i]) > d ? fabs((double)a[i] - b[i]) : d;
			}
			n_argmax += ia == ib;
			n_exact += memcmp(a, b, V * sizeof(float)) == 0;
			if (amax > 0 && d / amax > worst)
				worst = d / amax;
		}
		CHECK_MSG(n_argmax == n_ref, "%s, %s: greedy choice differs in %d of %d rows", label,
			  mode_name[mode], n_ref - n_argmax, n_ref);
		if (exact)
			CHECK_MSG(n_exact == n_ref, "%s, %s: %d of %d rows differ (largest %.3g of the "
				  "row's scale)", label, mode_name[mode], n_ref - n_exact, n_ref, worst);
		else
			CHECK_MSG(worst <= 1e-5, "%s, %s: logits differ by %.3g of the row's scale",
				  label, mode_name[mode], worst);
		/* Resident experts: every exact pass routes on the device (the draft passes on the
		 * host); experts from a source: on the host. */
		if (mode == RESIDENT && m.hp.n_expert)
			CHECK_MSG(fd.n_fast > 0 && fd.n_host > 0, "%s: %llu layer passes routed on the "
				  "device, %llu on the host", label, (unsigned long long)fd.n_fast,
				  (unsigned long long)fd.n_host);
		else if (m.hp.n_expert)
			CHECK_MSG(fd.n_fast == 0, "%s, %s: routed on the device", label, mode_name[mode]);
		CHECK_EQ_U(rc_dev.calls, rc_cpu.calls);
		CHECK_MSG(rc_dev.hash == rc_cpu.hash, "%s, %s: the route observer saw other routings",
			  label, mode_name[mode]);
		if (store) {
			struct md_expert_store_stats st;
			md_expert_store_get_stats(store, &st);
			/* both kinds ran: device hits on the device, misses on the CPU or copied up */
			CHECK_MSG(st.dev_hits > 0 && st.hits > 0, "%s: device hits %llu, hits %llu", label,
				  (unsigned long long)st.dev_hits, (unsigned long long)st.hits);
			if (mode == STORE_COPY)
				CHECK_MSG(st.dev_compute_dev > 0, "%s: %llu device misses copied up, %llu "
					  "on the CPU", label, (unsigned long long)st.dev_compute_dev,
					  (unsigned long long)st.dev_compute_host);
			md_expert_store_free(store);
		}
		printf("%s, %s: %d rows, %d bit-identical, greedy equal in %d, worst %.2g; MoE layer "
		       "passes routed on the device %llu, on the host %llu\n", label, mode_name[mode],
		       n_got, n_exact, n_argmax, worst, (unsigned long long)fd.n_fast,
		       (unsigned long long)fd.n_host);
		md_backend_sim_free(dev);
	}
	free(ref);
	free(got);
	md_model_free(&m);
	gen_model_cleanup(dir, path);
}

/* A device without room for the weights: refused at creation with the reason, nothing held. */
static void check_refused(const char *moed_gguf)
{
	char dir[512], path[600], err[256] = "";
	struct md_model m;
	struct md_kv_cache kv;
	struct md_fwd_dev *d = NULL;
	static const char *const a2[] = { "--arch", "qwen3moe", "--head-dim", "32", NULL };
	CHECK_EQ_I(gen_model(moed_gguf, a2, "q.gguf", dir, sizeof dir, path, sizeof path), 0);
	CHECK_EQ_I(md_model_load(&m, path, err, sizeof err), 0);
	CHECK_EQ_I(md_kv_init_rows(&kv, m.hp.n_layer, md_model_kv_rows(&m), 8, 2), 0);
	struct md_backend *dev = md_backend_sim_new(64 * 1024, 0);
	CHECK_EQ_I(md_fwd_dev_new(&m, dev, &kv, 4, true, &d, err, sizeof err), -ENOMEM);
	CHECK(d == NULL && strstr(err, "cannot upload") != NULL);
	CHECK_EQ_U(md_backend_sim_used(dev), 0);
	printf("too small a device refused: %s\n", err);
	md_backend_sim_free(dev);
	md_kv_release(&kv);
	md_model_free(&m);
	gen_model_cleanup(dir, path);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_forward_dev MOED_GGUF\n");
		return 2;
	}
	const char *g = argv[1];
	setvbuf(stdout, NULL, _IOLBF, 0); /* gen_model forks: nothing buffered twice */
	for (size_t i = 0; i < fws_n_cases; i++)
		check_model(g, fws_cases[i].label, fws_cases[i].args, fws_cases[i].exact);
	check_refused(g);
	if (failures) {
		fprintf(stderr, "forward-dev: %d failures\n", failures);
		return 1;
	}
	printf("forward-dev: ok\n");
	return 0;
}
