/* Token sampling: logit bias, penalties, temperature, top-k/top-p/min-p, seeded RNG, logprobs. */
#include "engine/sampler.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void md_sampling_default(struct md_sampling *s)
{
	memset(s, 0, sizeof(*s));
	s->temperature = 1.0f;
	s->top_p = 1.0f;
	s->repetition_penalty = 1.0f;
	s->top_logprobs = -1;
}

void md_sampling_release(struct md_sampling *s)
{
	free(s->logit_bias);
	s->logit_bias = NULL;
	s->n_logit_bias = 0;
}

uint64_t md_sampler_mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

/* xoroshiro128+: small, fast, and its sequence is fixed by the seed on every platform. */
static double rng_uniform(struct md_sampler *sm)
{
	uint64_t s0 = sm->rng[0], s1 = sm->rng[1];
	uint64_t r = s0 + s1;
	s1 ^= s0;
	sm->rng[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
	sm->rng[1] = rotl(s1, 37);
	return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

int md_sampler_init(struct md_sampler *sm, uint32_t n_vocab, uint64_t seed)
{
	memset(sm, 0, sizeof(*sm));
	sm->n_vocab = n_vocab;
	sm->rng[0] = md_sampler_mix(seed);
	sm->rng[1] = md_sampler_mix(sm->rng[0] ^ 0x6a09e667f3bcc909ull);
	if (sm->rng[0] == 0 && sm->rng[1] == 0)
		sm->rng[1] = 1;
	sm->probs = malloc(sizeof(float) * n_vocab);
	sm->idx = malloc(sizeof(int32_t) * n_vocab);
	if (!sm->probs || !sm->idx) {
		md_sampler_release(sm);
		return -ENOMEM;
	}
	return 0;
}

void md_sampler_release(struct md_sampler *sm)
{
	free(sm->probs);
	free(sm->idx);
	free(sm->hist);
	sm->probs = NULL;
	sm->idx = NULL;
	sm->hist = NULL;
	sm->hist_cap = 0;
}

static int cmp_i32(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	return (x > y) - (x < y);
}

/* Copy tokens into the sorted scratch so runs of equal ids can be counted. With no tokens at
 * all (a penalty on the first generated token) it touches nothing: sm->hist may still be NULL,
 * and qsort/memcpy on a NULL pointer are undefined even for zero elements. */
static int sorted_hist(struct md_sampler *sm, const int32_t *a, uint32_t na, const int32_t *b,
		       uint32_t nb, uint32_t *n)
{
	uint32_t total = na + nb;
	*n = 0;
	if (total == 0)
		return 0;
	if (total > sm->hist_cap) {
		int32_t *h = realloc(sm->hist, sizeof(int32_t) * total);
		if (!h)
			return -ENOMEM;
		sm->hist = h;
		sm->hist_cap = total;
	}
	if (na)
		memcpy(sm->hist, a, sizeof(int32_t) * na);
	if (nb)
		memcpy(sm->hist + na, b, sizeof(int32_t) * nb);
	qsort(sm->hist, total, sizeof(int32_t), cmp_i32);
	*n = total;
	return 0;
}

/* Higher key first; ties broken by lower id so every ordering is deterministic. */
static inline bool before(const float *key, int32_t a, int32_t b)
{
	return key[a] > key[b] || (key[a] == key[b] && a < b);
}

/* Partition idx[0..n) so that its first k entries are the k best by key (unordered).
 * Keys are totally ordered (ties go to the lower id), so Lomuto partitioning always shrinks
 * the range. */
static void select_top(int32_t *idx, uint32_t n, uint32_t k, const float *key)
{
	uint32_t lo = 0, hi = n;
	while (hi - lo > 1) {
		uint32_t mid = lo + (hi - lo) / 2, last = hi - 1;
		int32_t a = idx[lo], b = idx[mid], c = idx[last];
		uint32_t pi;
		if (before(key, a, b))
			pi = before(key, b, c) ? mid : (before(key, a, c) ? last : lo);
		else
			pi = before(key, a, c) ? lo : (before(key, b, c) ? last : mid);
		int32_t pv = idx[pi], t;
		idx[pi] = idx[last];
		idx[last] = pv;
		uint32_t store = lo;
		for (uint32_t i = lo; i < last; i++)
			if (before(key, idx[i], pv)) {
				t = idx[i];
				idx[i] = idx[store];
				idx[store++] = t;
			}
		idx[last] = idx[store];
		idx[store] = pv;
		if (k == store || k == store + 1)
			return;
		if (k < store)
			hi = store;
		else
			lo = store + 1;
	}
}

static const float *g_sort_key;

static int cmp_desc(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	if (before(g_sort_key, x, y))
		return -1;
	if (before(g_sort_key, y, x))
		return 1;
	return 0;
}

/* Sort the first n entries of idx best-first by key. qsort with a file-level key pointer is
 * fine: sampling runs on the engine thread only. */
static void sort_desc(int32_t *idx, uint32_t n, const float *key)
{
	g_sort_key = key;
	qsort(idx, n, sizeof(int32_t), cmp_desc);
}

static void raw_logprobs(struct md_sampler *sm, const struct md_sampling *p, const float *logits,
			 struct md_sample_out *out)
{
	uint32_t V = sm->n_vocab;
	float mx = -INFINITY;
	for (uint32_t i = 0; i < V; i++)
		if (logits[i] > mx)
			mx = logits[i];
	double z = 0;
	for (uint32_t i = 0; i < V; i++)
		z += exp((double)logits[i] - mx);
	float lse = mx + (float)log(z);
	out->logprob = logits[out->token] - lse;
	out->n_top = 0;
	uint32_t k = p->top_logprobs > 20 ? 20 : (uint32_t)p->top_logprobs;
	if (k > V)
		k = V;
	if (k == 0)
		return;
	for (uint32_t i = 0; i < V; i++)
		sm->idx[i] = (int32_t)i;
	select_top(sm->idx, V, k, logits);
	sort_desc(sm->idx, k, logits);
	for (uint32_t i = 0; i < k; i++) {
		out->top_id[i] = sm->idx[i];
		out->top_logprob[i] = logits[sm->idx[i]] - lse;
	}
	out->n_top = k;
}

int md_sampler_sample(struct md_sampler *sm, const struct md_sampling *p, float *logits,
		      const int32_t *prompt, uint32_t n_prompt, const int32_t *gen, uint32_t n_gen,
		      struct md_sample_out *out)
{
	uint32_t V = sm->n_vocab;
	float *w = sm->probs;
	memcpy(w, logits, sizeof(float) * V);

	for (uint32_t i = 0; i < p->n_logit_bias; i++) {
		int32_t id = p->logit_bias[i].id;
		if (id >= 0 && (uint32_t)id < V)
			w[id] += p->logit_bias[i].bias;
	}
	uint32_t nh;
	if (p->repetition_penalty != 1.0f && p->repetition_penalty > 0) {
		if (sorted_hist(sm, prompt, n_prompt, gen, n_gen, &nh))
			return -ENOMEM;
		for (uint32_t i = 0; i < nh; i++) {
			int32_t id = sm->hist[i];
			if (i > 0 && sm->hist[i - 1] == id)
				continue;
			if (id < 0 || (uint32_t)id >= V)
				continue;
			w[id] = w[id] > 0 ? w[id] / p->repetition_penalty : w[id] * p->repetition_penalty;
		}
	}
	if (p->presence_penalty != 0 || p->frequency_penalty != 0) {
		if (sorted_hist(sm, gen, n_gen, NULL, 0, &nh))
			return -ENOMEM;
		for (uint32_t i = 0; i < nh;) {
			uint32_t j = i;
			while (j < nh && sm->hist[j] == sm->hist[i])
				j++;
			int32_t id = sm->hist[i];
			if (id >= 0 && (uint32_t)id < V)
				w[id] -= p->frequency_penalty * (float)(j - i) + p->presence_penalty;
			i = j;
		}
	}

	int32_t tok = 0;
	if (p->temperature <= 1e-6f) {
		float best = w[0];
		for (uint32_t i = 1; i < V; i++)
			if (w[i] > best) {
				best = w[i];
				tok = (int32_t)i;
			}
	} else {
		float mx = -INFINITY;
		for (uint32_t i = 0; i < V; i++)
			if (w[i] > mx)
				mx = w[i];
		float inv_t = 1.0f / p->temperature;
		uint32_t n = 0;
		for (uint32_t i = 0; i < V; i++) {
			w[i] = expf((w[i] - mx) * inv_t);
			if (w[i] > 0)
				sm->idx[n++] = (int32_t)i;
		}
		if (n == 0) { /* everything masked to -inf: fall back to the raw argmax */
			sm->idx[n++] = 0;
			w[0] = 1;
		}
		if (p->top_k > 0 && (uint32_t)p->top_k < n) {
			select_top(sm->idx, n, (uint32_t)p->top_k, w);
			n = (uint32_t)p->top_k;
		}
		if (p->min_p > 0) {
			float pmax = 0;
			for (uint32_t i = 0; i < n; i++)
				if (w[sm->idx[i]] > pmax)
					pmax = w[sm->idx[i]];
			uint32_t m = 0;
			for (uint32_t i = 0; i < n; i++)
				if (w[sm->idx[i]] >= p->min_p * pmax)
					sm->idx[m++] = sm->idx[i];
			n = m;
		}
		if (p->top_p < 1.0f) {
			double total = 0;
			for (uint32_t i = 0; i < n; i++)
				total += w[sm->idx[i]];
			/* Sort only as many of the best as the nucleus needs, growing the prefix. */
			for (uint32_t m = 64;; m *= 4) {
				if (m > n)
					m = n;
				if (m < n)
					select_top(sm->idx, n, m, w);
				sort_desc(sm->idx, m, w);
				double cum = 0;
				uint32_t cut = 0;
				while (cut < m) {
					cum += w[sm->idx[cut++]];
					if (cum >= p->top_p * total)
						break;
				}
				if (cum >= p->top_p * total || m == n) {
					n = cut;
					break;
				}
			}
		}
		double sum = 0;
		for (uint32_t i = 0; i < n; i++)
			sum += w[sm->idx[i]];
		double u = rng_uniform(sm) * sum, acc = 0;
		tok = sm->idx[n - 1];
		for (uint32_t i = 0; i < n; i++) {
			acc += w[sm->idx[i]];
			if (u < acc) {
				tok = sm->idx[i];
				break;
			}
		}
	}
	out->token = tok;
	out->logprob = 0;
	out->n_top = 0;
	if (p->top_logprobs >= 0)
		raw_logprobs(sm, p, logits, out);
	return 0;
}
