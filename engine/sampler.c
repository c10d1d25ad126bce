/* Token sampling in three stages: logits transforms, the filtered distribution, the draw. */
#include "engine/sampler.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"

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
double md_sampler_uniform(struct md_sampler *sm)
{
	uint64_t s0 = sm->rng[0], s1 = sm->rng[1];
	uint64_t r = s0 + s1;
	s1 ^= s0;
	sm->rng[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
	sm->rng[1] = rotl(s1, 37);
	return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- ordering, selection and sorting of token ids by a key ------------------------------ */

/* Higher key first; ties broken by lower id so every ordering is deterministic. The keys
 * ordered here (positive weights, or raw logits for logprobs) are never NaN in practice; with
 * a NaN the order is not total and the result, though memory-safe, is unspecified. */
static inline bool before(const float *key, int32_t a, int32_t b)
{
	return key[a] > key[b] || (key[a] == key[b] && a < b);
}

static inline void swap_id(int32_t *a, int32_t *b)
{
	int32_t t = *a;
	*a = *b;
	*b = t;
}

/* Partition idx[lo..hi) (hi - lo >= 2) around a median-of-three pivot, Lomuto style: on return
 * the pivot sits at the returned position, everything before it comes before it in the order
 * and everything after does not. */
static uint32_t partition(int32_t *idx, uint32_t lo, uint32_t hi, const float *key)
{
	uint32_t mid = lo + (hi - lo) / 2, last = hi - 1;
	int32_t a = idx[lo], b = idx[mid], c = idx[last];
	uint32_t pi;
	if (before(key, a, b))
		pi = before(key, b, c) ? mid : (before(key, a, c) ? last : lo);
	else
		pi = before(key, a, c) ? lo : (before(key, b, c) ? last : mid);
	int32_t pv = idx[pi];
	swap_id(&idx[pi], &idx[last]);
	uint32_t store = lo;
	for (uint32_t i = lo; i < last; i++)
		if (before(key, idx[i], pv))
			swap_id(&idx[i], &idx[store++]);
	idx[last] = idx[store];
	idx[store] = pv;
	return store;
}

/* Partition idx[0..n) so that its first k entries are the k best by key (unordered).
 * Keys are totally ordered (ties go to the lower id), so each partition shrinks the range.
 * The permutation it leaves is part of the sampler's contract: the draw walks the top-k
 * support in this order, so changing this function changes seeded results. */
static void select_top(int32_t *idx, uint32_t n, uint32_t k, const float *key)
{
	uint32_t lo = 0, hi = n;
	while (hi - lo > 1) {
		uint32_t store = partition(idx, lo, hi, key);
		if (k == store || k == store + 1)
			return;
		if (k < store)
			hi = store;
		else
			lo = store + 1;
	}
}

/* Restore the heap below i in h[0..n), a heap whose root is the worst entry in the order. */
static void sift_worst(int32_t *h, uint32_t i, uint32_t n, const float *key)
{
	for (;;) {
		uint32_t c = 2 * i + 1;
		if (c >= n)
			return;
		if (c + 1 < n && before(key, h[c], h[c + 1]))
			c++;
		if (!before(key, h[i], h[c]))
			return;
		swap_id(&h[i], &h[c]);
		i = c;
	}
}

static void heap_sort_desc(int32_t *a, uint32_t n, const float *key)
{
	for (uint32_t i = n / 2; i-- > 0;)
		sift_worst(a, i, n, key);
	for (uint32_t m = n; m > 1; m--) {
		swap_id(&a[0], &a[m - 1]);
		sift_worst(a, 0, m - 1, key);
	}
}

static void insertion_sort_desc(int32_t *a, uint32_t n, const float *key)
{
	for (uint32_t i = 1; i < n; i++) {
		int32_t v = a[i];
		uint32_t j = i;
		while (j > 0 && before(key, v, a[j - 1])) {
			a[j] = a[j - 1];
			j--;
		}
		a[j] = v;
	}
}

/* Partition a[0..n) (n >= 3) around a median-of-three pivot, Hoare style (fewer swaps than
 * Lomuto, and the pivot's key is held in a register): returns p with the pivot at a[p],
 * everything before it coming before it in the order and everything after coming after. */
static uint32_t sort_partition(int32_t *a, uint32_t n, const float *key)
{
	uint32_t mid = n / 2, last = n - 1;
	if (before(key, a[mid], a[0]))
		swap_id(&a[mid], &a[0]);
	if (before(key, a[last], a[0]))
		swap_id(&a[last], &a[0]);
	if (before(key, a[last], a[mid]))
		swap_id(&a[last], &a[mid]);
	/* a[0] <= a[mid] <= a[last] in the order: a[0] and a[last] act as sentinels. */
	swap_id(&a[mid], &a[last - 1]);
	int32_t pid = a[last - 1];
	float pk = key[pid];
	uint32_t i = 0, j = last - 1;
	for (;;) {
		do
			i++;
		while (key[a[i]] > pk || (key[a[i]] == pk && a[i] < pid));
		do
			j--;
		while (pk > key[a[j]] || (pk == key[a[j]] && pid < a[j]));
		if (i >= j)
			break;
		swap_id(&a[i], &a[j]);
	}
	swap_id(&a[i], &a[last - 1]);
	return i;
}

/* Sort idx[0..n) best-first by key. Introsort: quicksort (Hoare partition), insertion sort
 * below 16 entries, heapsort when the depth passes 2 log2 n, so O(n log n) in every case and
 * O(log n) stack. It replaced qsort, whose comparator could reach the key only through a
 * file-level pointer; the order is total, so any correct sort gives the same result. */
static void introsort_desc(int32_t *idx, uint32_t n, const float *key, unsigned depth)
{
	while (n > 16) {
		if (depth-- == 0) {
			heap_sort_desc(idx, n, key);
			return;
		}
		uint32_t p = sort_partition(idx, n, key);
		/* Recurse into the smaller side, loop on the larger. */
		if (p < n - p - 1) {
			introsort_desc(idx, p, key, depth);
			idx += p + 1;
			n -= p + 1;
		} else {
			introsort_desc(idx + p + 1, n - p - 1, key, depth);
			n = p;
		}
	}
	insertion_sort_desc(idx, n, key);
}

static void sort_desc(int32_t *idx, uint32_t n, const float *key)
{
	unsigned depth = 0;
	for (uint32_t m = n; m > 1; m >>= 1)
		depth += 2;
	introsort_desc(idx, n, key, depth);
}

/* ---- stage (a): logits transforms -------------------------------------------------------- */

int md_sampler_init(struct md_sampler *sm, uint32_t n_vocab, uint64_t seed)
{
	memset(sm, 0, sizeof(*sm));
	sm->n_vocab = n_vocab;
	sm->rng[0] = md_sampler_mix(seed);
	sm->rng[1] = md_sampler_mix(sm->rng[0] ^ 0x6a09e667f3bcc909ull);
	if (sm->rng[0] == 0 && sm->rng[1] == 0)
		sm->rng[1] = 1;
	return md_sampler_dist_init(&sm->dist, n_vocab);
}

void md_sampler_release(struct md_sampler *sm)
{
	md_sampler_dist_release(&sm->dist);
	free(sm->hist);
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

int md_sampler_transform(struct md_sampler *sm, const struct md_sampling *p,
			 const struct md_sampler_ctx *ctx, const float *logits, float *out)
{
	const struct md_sampler_ctx none = { 0 };
	uint32_t V = sm->n_vocab, nh;
	if (!ctx)
		ctx = &none;
	if (out != logits)
		memcpy(out, logits, sizeof(float) * V);

	/* 1. logit_bias */
	for (uint32_t i = 0; i < p->n_logit_bias; i++) {
		int32_t id = p->logit_bias[i].id;
		if (id >= 0 && (uint32_t)id < V)
			out[id] += p->logit_bias[i].bias;
	}
	/* 2. repetition penalty: once per distinct id of prompt + generated tokens, dividing a
	 * positive logit and multiplying a negative one (so it always lowers the token). */
	if (p->repetition_penalty != 1.0f && p->repetition_penalty > 0) {
		if (sorted_hist(sm, ctx->prompt, ctx->n_prompt, ctx->gen, ctx->n_gen, &nh))
			return -ENOMEM;
		for (uint32_t i = 0; i < nh; i++) {
			int32_t id = sm->hist[i];
			if (i > 0 && sm->hist[i - 1] == id)
				continue;
			if (id < 0 || (uint32_t)id >= V)
				continue;
			out[id] = out[id] > 0 ? out[id] / p->repetition_penalty
					      : out[id] * p->repetition_penalty;
		}
	}
	/* 3. presence (once per distinct id) and frequency (per occurrence) penalties over the
	 * generated tokens, subtracted in one step as OpenAI documents it. */
	if (p->presence_penalty != 0 || p->frequency_penalty != 0) {
		if (sorted_hist(sm, ctx->gen, ctx->n_gen, NULL, 0, &nh))
			return -ENOMEM;
		for (uint32_t i = 0; i < nh;) {
			uint32_t j = i;
			while (j < nh && sm->hist[j] == sm->hist[i])
				j++;
			int32_t id = sm->hist[i];
			if (id >= 0 && (uint32_t)id < V)
				out[id] -= p->frequency_penalty * (float)(j - i) + p->presence_penalty;
			i = j;
		}
	}
	/* 4. the allowed-token mask (grammar slot), last: nothing after it can lift a token it
	 * removed. */
	if (ctx->allowed) {
		for (uint32_t wi = 0; wi < (V + 31) / 32; wi++) {
			uint32_t bits = ctx->allowed[wi];
			if (bits == UINT32_MAX)
				continue;
			uint32_t end = V - wi * 32 < 32 ? V - wi * 32 : 32;
			for (uint32_t b = 0; b < end; b++)
				if (!(bits >> b & 1))
					out[wi * 32 + b] = -INFINITY;
		}
	}
	return 0;
}

/* ---- stage (b): the filtered distribution ------------------------------------------------ */

int md_sampler_dist_init(struct md_sampler_dist *d, uint32_t n_vocab)
{
	memset(d, 0, sizeof(*d));
	d->n_vocab = n_vocab;
	d->_cut_id = -1;
	d->id = malloc(sizeof(int32_t) * (n_vocab ? n_vocab : 1));
	d->w = malloc(sizeof(float) * (n_vocab ? n_vocab : 1));
	if (!d->id || !d->w) {
		md_sampler_dist_release(d);
		return -ENOMEM;
	}
	return 0;
}

void md_sampler_dist_release(struct md_sampler_dist *d)
{
	free(d->id);
	free(d->w);
	d->id = NULL;
	d->w = NULL;
	d->n = 0;
}

int md_sampler_dist_build(struct md_sampler_dist *d, const struct md_sampling *p,
			  const float *logits)
{
	uint32_t V = d->n_vocab, n = 0;
	float *w = d->w;
	int32_t *idx = d->id;
	d->n = 0;
	d->greedy = false;
	d->sum = 0;
	d->_cut_id = -1;

	if (p->temperature <= 1e-6f) {
		/* Strict '>' from -inf: the lowest id wins ties, NaN never wins. */
		float best = -INFINITY;
		int32_t tok = -1;
		for (uint32_t i = 0; i < V; i++)
			if (logits[i] > best) {
				best = logits[i];
				tok = (int32_t)i;
			}
		if (tok < 0)
			return -EDOM;
		d->greedy = true;
		idx[0] = tok;
		d->n = 1;
		d->sum = 1;
		return 0;
	}

	float mx = -INFINITY;
	for (uint32_t i = 0; i < V; i++)
		if (logits[i] > mx)
			mx = logits[i];
	if (mx == INFINITY) {
		/* The limit of the softmax: the +inf tokens share all the mass. */
		for (uint32_t i = 0; i < V; i++) {
			w[i] = logits[i] == INFINITY ? 1.0f : 0.0f;
			if (w[i] > 0)
				idx[n++] = (int32_t)i;
		}
	} else {
		/* mx == -inf (all -inf or NaN) makes every weight NaN: an empty support. */
		float inv_t = 1.0f / p->temperature;
		for (uint32_t i = 0; i < V; i++) {
			w[i] = expf((logits[i] - mx) * inv_t);
			if (w[i] > 0)
				idx[n++] = (int32_t)i;
		}
	}
	if (n == 0)
		return -EDOM;

	/* Each filter keeps a best-first prefix of the order (weight desc, id asc), so the support
	 * is everything up to its worst member; 'cut' says whether a filter dropped anything. */
	bool cut = false;
	if (p->top_k > 0 && (uint32_t)p->top_k < n) {
		select_top(idx, n, (uint32_t)p->top_k, w);
		n = (uint32_t)p->top_k;
		cut = true;
	}
	if (p->min_p > 0) {
		float pmax = 0;
		for (uint32_t i = 0; i < n; i++)
			if (w[idx[i]] > pmax)
				pmax = w[idx[i]];
		uint32_t m = 0;
		for (uint32_t i = 0; i < n; i++)
			if (w[idx[i]] >= p->min_p * pmax)
				idx[m++] = idx[i];
		cut |= m < n;
		n = m;
	}
	if (p->top_p < 1.0f) {
		double total = 0;
		for (uint32_t i = 0; i < n; i++)
			total += w[idx[i]];
		/* Sort only as many of the best as the nucleus needs, growing the prefix. */
		for (uint32_t m = 64;; m *= 4) {
			if (m > n)
				m = n;
			if (m < n)
				select_top(idx, n, m, w);
			sort_desc(idx, m, w);
			double cum = 0;
			uint32_t k = 0;
			while (k < m) {
				cum += w[idx[k++]];
				if (cum >= p->top_p * total)
					break;
			}
			if (cum >= p->top_p * total || m == n) {
				cut |= k < n;
				n = k;
				break;
			}
		}
	}
	double sum = 0;
	for (uint32_t i = 0; i < n; i++)
		sum += w[idx[i]];
	if (cut) {
		int32_t worst = idx[0];
		for (uint32_t i = 1; i < n; i++)
			if (before(w, worst, idx[i]))
				worst = idx[i];
		d->_cut_id = worst;
	}
	d->n = n;
	d->sum = sum;
	return 0;
}

float md_sampler_dist_prob(const struct md_sampler_dist *d, int32_t token)
{
	if (d->n == 0 || token < 0 || (uint32_t)token >= d->n_vocab)
		return 0;
	if (d->greedy)
		return token == d->id[0] ? 1.0f : 0.0f;
	if (!(d->w[token] > 0))
		return 0;
	if (d->_cut_id >= 0 && token != d->_cut_id && !before(d->w, token, d->_cut_id))
		return 0;
	return (float)(d->w[token] / d->sum);
}

float md_sampler_dist_prob_at(const struct md_sampler_dist *d, uint32_t i)
{
	MD_ASSERT(i < d->n);
	if (d->greedy)
		return 1.0f;
	return (float)(d->w[d->id[i]] / d->sum);
}

int md_sampler_dist_residual(struct md_sampler_dist *r, const struct md_sampler_dist *p,
			     const struct md_sampler_dist *q)
{
	MD_ASSERT(r != p && r != q);
	MD_ASSERT(r->n_vocab == p->n_vocab && q->n_vocab == p->n_vocab);
	uint32_t V = p->n_vocab, n = 0;
	double sum = 0;
	r->n = 0;
	r->greedy = false;
	r->sum = 0;
	r->_cut_id = -1;
	if (p->n == 0)
		return -EDOM;
	/* The dense weights must be 0 off the support for md_sampler_dist_prob. This pass over
	 * the vocabulary happens only on a rejection. */
	memset(r->w, 0, sizeof(float) * V);
	for (uint32_t i = 0; i < p->n; i++) {
		int32_t t = p->id[i];
		float x = md_sampler_dist_prob_at(p, i) - md_sampler_dist_prob(q, t);
		if (x > 0) {
			r->w[t] = x;
			r->id[n++] = t;
			sum += x;
		}
	}
	if (n == 0) {
		r->greedy = p->greedy;
		memcpy(r->id, p->id, sizeof(int32_t) * p->n);
		if (!p->greedy)
			memcpy(r->w, p->w, sizeof(float) * V);
		r->_cut_id = p->_cut_id;
		n = p->n;
		sum = p->sum;
	}
	r->n = n;
	r->sum = sum;
	return 0;
}

/* ---- stage (c): the draw ------------------------------------------------------------------ */

int32_t md_sampler_draw(struct md_sampler *sm, const struct md_sampler_dist *d)
{
	if (d->n == 0)
		return -1;
	if (d->greedy)
		return d->id[0];
	/* Inverse CDF over the support in its order; the last entry catches rounding. */
	double u = md_sampler_uniform(sm) * d->sum, acc = 0;
	int32_t tok = d->id[d->n - 1];
	for (uint32_t i = 0; i < d->n; i++) {
		acc += d->w[d->id[i]];
		if (u < acc) {
			tok = d->id[i];
			break;
		}
	}
	return tok;
}

/* ---- logprobs and the whole pipeline ----------------------------------------------------- */

void md_sampler_logprobs(const float *logits, uint32_t n_vocab, int32_t token, int32_t n_top,
			 struct md_sample_out *out)
{
	uint32_t V = n_vocab;
	float mx = -INFINITY;
	for (uint32_t i = 0; i < V; i++)
		if (logits[i] > mx)
			mx = logits[i];
	double z = 0;
	for (uint32_t i = 0; i < V; i++)
		z += exp((double)logits[i] - mx);
	float lse = mx + (float)log(z);
	out->token = token;
	out->logprob = token >= 0 && (uint32_t)token < V ? logits[token] - lse : -INFINITY;
	out->n_top = 0;
	uint32_t k = n_top <= 0 ? 0 : n_top > MD_SAMPLER_MAX_TOP ? MD_SAMPLER_MAX_TOP
								 : (uint32_t)n_top;
	if (k > V)
		k = V;
	if (k == 0)
		return;
	/* The k best in one pass: a heap of k ids with the worst at the root. A later id beats the
	 * root only with a strictly higher logit (on a tie the lower id, already kept, wins), so
	 * most of the vocabulary costs one comparison and no index array is needed. */
	int32_t *h = out->top_id;
	for (uint32_t i = 0; i < k; i++)
		h[i] = (int32_t)i;
	for (uint32_t i = k / 2; i-- > 0;)
		sift_worst(h, i, k, logits);
	float thr = logits[h[0]];
	for (uint32_t i = k; i < V; i++)
		if (logits[i] > thr) {
			h[0] = (int32_t)i;
			sift_worst(h, 0, k, logits);
			thr = logits[h[0]];
		}
	insertion_sort_desc(h, k, logits);
	for (uint32_t i = 0; i < k; i++)
		out->top_logprob[i] = logits[h[i]] - lse;
	out->n_top = k;
}

int md_sampler_sample(struct md_sampler *sm, const struct md_sampling *p, const float *logits,
		      const int32_t *prompt, uint32_t n_prompt, const int32_t *gen, uint32_t n_gen,
		      struct md_sample_out *out)
{
	struct md_sampler_ctx ctx = {
		.prompt = prompt, .n_prompt = n_prompt, .gen = gen, .n_gen = n_gen,
	};
	return md_sampler_sample_ctx(sm, p, logits, &ctx, out);
}

int md_sampler_sample_ctx(struct md_sampler *sm, const struct md_sampling *p, const float *logits,
			  const struct md_sampler_ctx *ctx, struct md_sample_out *out)
{
	struct md_sampler_dist *d = &sm->dist;
	int rc = md_sampler_transform(sm, p, ctx, logits, d->w);
	if (rc)
		return rc;
	rc = md_sampler_dist_build(d, p, d->w);
	if (rc)
		return rc;
	int32_t tok = md_sampler_draw(sm, d);
	if (p->top_logprobs >= 0) {
		md_sampler_logprobs(logits, sm->n_vocab, tok, p->top_logprobs, out);
	} else {
		out->token = tok;
		out->logprob = 0;
		out->n_top = 0;
	}
	return 0;
}
