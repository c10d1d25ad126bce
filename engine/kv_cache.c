/* Paged KV cache: one pool of fixed-size blocks shared by all sequences, by reference count.
 *
 * DESIGN. A block is free exactly when its count is 0 and then it sits on the free list; the
 * count is the number of block tables that hold it. Sharing is only ever created by
 * md_kv_seq_fork and undone by truncation, free, or a copy-on-write, so the invariant
 * "a block with count > 1 is read-only" is kept by checking the count wherever rows are made
 * writable (reserve, batch_begin) and asserting it where they are written. Rejected: sharing
 * only full blocks and copying a fork's partial tail eagerly. A truncation can still cut into
 * a shared full block (speculation rolled back below the fork point), so copy-on-write is
 * needed anyway, and the lazy copy costs nothing for a fork that never writes (a prefix that
 * is only read, or a branch dropped before it diverges).
 *
 * The prefix cache adds a second state for a block with count 0: registered and unreferenced,
 * on a list in release order instead of the free list. block_take uses the free list first
 * and then the oldest such block (taking it out of the index), so to every caller the pool's
 * free blocks are both kinds together (avail()). Registration is by content: the chain hash
 * h(block) = mix(h(previous block), its 16 tokens), checked against the stored tokens and
 * previous hash on lookup, so a 64-bit collision cannot attach wrong rows. Rejected: keeping
 * registered blocks referenced by the cache itself (an extra count): every "count > 1 is
 * read-only" check would then see cache-held blocks as shared and copy them needlessly. */
#include "engine/kv_cache.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"

static inline uint32_t blocks_for(uint32_t n_pos)
{
	return (uint32_t)(((uint64_t)n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS);
}

/* Free blocks as callers see them: the free list and unreferenced registered blocks. */
static inline uint32_t avail(const struct md_kv_cache *kv)
{
	return kv->n_free + (kv->px ? kv->px->n_lru : 0);
}

static void px_unregister(struct md_kv_cache *kv, int32_t b);
static void lru_unlink(struct md_kv_prefix *px, int32_t b);

static inline bool seq_ok(const struct md_kv_cache *kv, int seq)
{
	return seq >= 0 && (uint32_t)seq < kv->max_seqs && kv->seqs[seq].in_use;
}

int md_kv_init(struct md_kv_cache *kv, uint32_t n_layer, uint32_t kv_dim, uint32_t n_blocks,
	       uint32_t max_seqs)
{
	const struct md_kv_rows rows = { kv_dim, kv_dim, false };
	return md_kv_init_rows(kv, n_layer, rows, n_blocks, max_seqs);
}

uint64_t md_kv_token_bytes(uint32_t n_layer, struct md_kv_rows rows)
{
	return (uint64_t)n_layer * ((uint64_t)rows.k_dim * (rows.k_half ? 2 : 4) +
				    (uint64_t)rows.v_dim * sizeof(float));
}

int md_kv_init_rows(struct md_kv_cache *kv, uint32_t n_layer, struct md_kv_rows kr,
		    uint32_t n_blocks, uint32_t max_seqs)
{
	const uint32_t k_dim = kr.k_dim, v_dim = kr.v_dim;
	memset(kv, 0, sizeof(*kv));
	if (n_layer == 0 || k_dim == 0 || n_blocks == 0 || max_seqs == 0)
		return -EINVAL;
	uint32_t dim = k_dim > v_dim ? k_dim : v_dim;
	size_t per = (size_t)n_layer * n_blocks * MD_KV_BLOCK_TOKENS * dim;
	if (per / n_layer / n_blocks / MD_KV_BLOCK_TOKENS != dim || per > SIZE_MAX / sizeof(float))
		return -EOVERFLOW;
	size_t rows = (size_t)n_layer * n_blocks * MD_KV_BLOCK_TOKENS;
	kv->n_layer = n_layer;
	kv->kv_dim = k_dim;
	kv->k_bytes = kr.k_half ? 2 : 4;
	kv->v_dim = v_dim;
	kv->n_blocks = n_blocks;
	kv->max_seqs = max_seqs;
	kv->k = malloc(rows * k_dim * kv->k_bytes);
	kv->v = v_dim ? malloc(rows * v_dim * sizeof(float)) : NULL;
	kv->free_list = malloc(n_blocks * sizeof(int32_t));
	kv->refs = calloc(n_blocks, sizeof(uint32_t));
	kv->_writers = calloc(n_blocks, sizeof(uint32_t));
	kv->seqs = calloc(max_seqs, sizeof(*kv->seqs));
	if (!kv->k || (v_dim && !kv->v) || !kv->free_list || !kv->refs || !kv->_writers || !kv->seqs) {
		md_kv_release(kv);
		return -ENOMEM;
	}
	/* Pop from the end: hand out low block ids first. */
	for (uint32_t i = 0; i < n_blocks; i++)
		kv->free_list[i] = (int32_t)(n_blocks - 1 - i);
	kv->n_free = n_blocks;
	return 0;
}

void md_kv_release(struct md_kv_cache *kv)
{
	if (kv->seqs)
		for (uint32_t s = 0; s < kv->max_seqs; s++) {
			free(kv->seqs[s].blocks);
			free(kv->seqs[s].chain);
		}
	if (kv->px) {
		struct md_kv_prefix *px = kv->px;
		free(px->hash);
		free(px->parent);
		free(px->toks);
		free(px->reg);
		free(px->len);
		free(px->bucket);
		free(px->hnext);
		free(px->prev);
		free(px->next);
		free(px);
	}
	free(kv->seqs);
	free(kv->free_list);
	free(kv->refs);
	free(kv->_writers);
	free(kv->k);
	free(kv->v);
	memset(kv, 0, sizeof(*kv));
}

/* Take a block from the pool with count 1; the caller checked avail(). The free list first,
 * then the registered block released longest ago. */
static int32_t block_take(struct md_kv_cache *kv)
{
	int32_t b;
	if (kv->n_free > 0) {
		b = kv->free_list[--kv->n_free];
	} else {
		MD_ASSERT(kv->px && kv->px->n_lru > 0);
		b = kv->px->head;
		lru_unlink(kv->px, b);
		px_unregister(kv, b);
		kv->px->evicted++;
	}
	MD_ASSERT(kv->refs[b] == 0);
	kv->refs[b] = 1;
	return b;
}

/* Drop one reference; the block returns to the pool at 0. */
static void block_put(struct md_kv_cache *kv, int32_t b)
{
	MD_ASSERT(kv->refs[b] > 0);
	if (--kv->refs[b] > 0)
		return;
	struct md_kv_prefix *px = kv->px;
	if (px && px->reg[b]) {
		px->prev[b] = px->tail;
		px->next[b] = -1;
		if (px->tail >= 0)
			px->next[px->tail] = b;
		else
			px->head = b;
		px->tail = b;
		px->n_lru++;
		return;
	}
	kv->free_list[kv->n_free++] = b;
}

/* Copy every layer's K and V rows of block src into dst. */
static void block_copy(struct md_kv_cache *kv, int32_t dst, int32_t src)
{
	const size_t kbytes = (size_t)MD_KV_BLOCK_TOKENS * kv->kv_dim * kv->k_bytes;
	const size_t vrows = (size_t)MD_KV_BLOCK_TOKENS * kv->v_dim;
	char *k = kv->k;
	for (uint32_t l = 0; l < kv->n_layer && k; l++) { /* no rows here: md_kv_drop_rows */
		size_t base = (size_t)l * kv->n_blocks;
		memcpy(k + (base + (size_t)dst) * kbytes, k + (base + (size_t)src) * kbytes, kbytes);
		if (vrows)
			memcpy(kv->v + (base + (size_t)dst) * vrows,
			       kv->v + (base + (size_t)src) * vrows, vrows * sizeof(float));
	}
	if (kv->copy_hook)
		kv->copy_hook(kv->copy_ud, dst, src);
}

void md_kv_drop_rows(struct md_kv_cache *kv)
{
	free(kv->k);
	free(kv->v);
	kv->k = NULL;
	kv->v = NULL;
}

void md_kv_set_copy_hook(struct md_kv_cache *kv, void (*fn)(void *ud, int32_t dst, int32_t src),
			 void *ud)
{
	kv->copy_hook = fn;
	kv->copy_ud = fn ? ud : NULL;
}

/* Grow s's table to hold at least need ids. Returns 0 or -ENOMEM (table unchanged). */
static int table_grow(struct md_kv_seq *s, uint32_t need)
{
	if (need <= s->cap_blocks)
		return 0;
	uint32_t cap = s->cap_blocks ? s->cap_blocks : 4;
	while (cap < need)
		cap *= 2;
	int32_t *nb = realloc(s->blocks, cap * sizeof(int32_t));
	if (!nb)
		return -ENOMEM;
	s->blocks = nb;
	uint64_t *nc = realloc(s->chain, cap * sizeof(uint64_t));
	if (!nc)
		return -ENOMEM; /* blocks grew, cap_blocks did not: the next call retries both */
	s->chain = nc;
	s->cap_blocks = cap;
	return 0;
}

/* Take the registered blocks among s's blocks holding positions [lo, hi) that s alone holds
 * out of the cache: s is about to write into them. (Shared ones are copied instead.) */
static void seq_uncache(struct md_kv_cache *kv, struct md_kv_seq *s, uint32_t lo, uint32_t hi)
{
	if (!kv->px || lo >= hi)
		return;
	uint32_t end = blocks_for(hi) < s->n_blocks ? blocks_for(hi) : s->n_blocks;
	for (uint32_t i = lo / MD_KV_BLOCK_TOKENS; i < end; i++)
		if (kv->refs[s->blocks[i]] == 1 && kv->px->reg[s->blocks[i]])
			px_unregister(kv, s->blocks[i]);
	if (s->n_chain > lo / MD_KV_BLOCK_TOKENS)
		s->n_chain = lo / MD_KV_BLOCK_TOKENS;
}

/* Shared blocks of s holding positions [lo, hi) (only existing blocks count). */
static uint32_t shared_in(const struct md_kv_cache *kv, const struct md_kv_seq *s, uint32_t lo,
			  uint32_t hi)
{
	uint32_t n = 0, end = blocks_for(hi) < s->n_blocks ? blocks_for(hi) : s->n_blocks;
	for (uint32_t i = lo / MD_KV_BLOCK_TOKENS; lo < hi && i < end; i++)
		n += kv->refs[s->blocks[i]] > 1;
	return n;
}

/* Give s a private copy of each shared block holding positions [lo, hi); the caller checked
 * that the pool has shared_in(...) free blocks. */
static void seq_unshare(struct md_kv_cache *kv, struct md_kv_seq *s, uint32_t lo, uint32_t hi)
{
	uint32_t end = blocks_for(hi) < s->n_blocks ? blocks_for(hi) : s->n_blocks;
	for (uint32_t i = lo / MD_KV_BLOCK_TOKENS; lo < hi && i < end; i++) {
		int32_t old = s->blocks[i];
		if (kv->refs[old] <= 1)
			continue;
		int32_t nb = block_take(kv);
		block_copy(kv, nb, old);
		block_put(kv, old);
		s->blocks[i] = nb;
	}
}

int md_kv_seq_new(struct md_kv_cache *kv)
{
	for (uint32_t s = 0; s < kv->max_seqs; s++) {
		if (!kv->seqs[s].in_use) {
			kv->seqs[s].in_use = true;
			kv->seqs[s].n_blocks = 0;
			kv->seqs[s].n_pos = 0;
			kv->seqs[s].n_chain = 0;
			return (int)s;
		}
	}
	return -ENOSPC;
}

void md_kv_seq_free(struct md_kv_cache *kv, int seq)
{
	if (!seq_ok(kv, seq))
		return;
	md_kv_truncate(kv, seq, 0);
	kv->seqs[seq].in_use = false;
}

int md_kv_seq_fork(struct md_kv_cache *kv, int src, uint32_t n_pos)
{
	if (!seq_ok(kv, src) || n_pos > kv->seqs[src].n_pos)
		return -EINVAL;
	int id = md_kv_seq_new(kv);
	if (id < 0)
		return id;
	struct md_kv_seq *d = &kv->seqs[id];
	const struct md_kv_seq *s = &kv->seqs[src];
	uint32_t nb = blocks_for(n_pos);
	if (table_grow(d, nb)) {
		d->in_use = false;
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < nb; i++) {
		d->blocks[i] = s->blocks[i];
		kv->refs[s->blocks[i]]++;
	}
	d->n_blocks = nb;
	d->n_pos = n_pos;
	d->n_chain = s->n_chain < n_pos / MD_KV_BLOCK_TOKENS ? s->n_chain : n_pos / MD_KV_BLOCK_TOKENS;
	if (d->n_chain)
		memcpy(d->chain, s->chain, d->n_chain * sizeof(uint64_t));
	return id;
}

int md_kv_reserve(struct md_kv_cache *kv, int seq, uint32_t n_pos)
{
	if (!seq_ok(kv, seq))
		return -EINVAL;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t need = blocks_for(n_pos);
	uint32_t add = need > s->n_blocks ? need - s->n_blocks : 0;
	uint32_t cow = shared_in(kv, s, s->n_pos, n_pos);
	if (add == 0 && cow == 0) {
		seq_uncache(kv, s, s->n_pos, n_pos);
		return 0;
	}
	if ((uint64_t)add + cow > avail(kv))
		return -ENOSPC;
	if (table_grow(s, need))
		return -ENOMEM;
	seq_unshare(kv, s, s->n_pos, n_pos);
	seq_uncache(kv, s, s->n_pos, n_pos);
	while (s->n_blocks < need)
		s->blocks[s->n_blocks++] = block_take(kv);
	return 0;
}

void md_kv_truncate(struct md_kv_cache *kv, int seq, uint32_t n_pos)
{
	if (!seq_ok(kv, seq))
		return;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t keep = blocks_for(n_pos);
	while (s->n_blocks > keep)
		block_put(kv, s->blocks[--s->n_blocks]);
	if (s->n_pos > n_pos)
		s->n_pos = n_pos;
	if (s->n_chain > n_pos / MD_KV_BLOCK_TOKENS)
		s->n_chain = n_pos / MD_KV_BLOCK_TOKENS;
}

uint32_t md_kv_blocks_used(const struct md_kv_cache *kv)
{
	return kv->n_blocks - avail(kv);
}

uint32_t md_kv_blocks_free(const struct md_kv_cache *kv)
{
	return avail(kv);
}

uint32_t md_kv_blocks_total(const struct md_kv_cache *kv)
{
	return kv->n_blocks;
}

uint32_t md_kv_seq_len(const struct md_kv_cache *kv, int seq)
{
	return seq_ok(kv, seq) ? kv->seqs[seq].n_pos : 0;
}

uint32_t md_kv_seq_capacity(const struct md_kv_cache *kv, int seq)
{
	return seq_ok(kv, seq) ? kv->seqs[seq].n_blocks * MD_KV_BLOCK_TOKENS : 0;
}

int32_t md_kv_seq_block(const struct md_kv_cache *kv, int seq, uint32_t pos)
{
	if (!seq_ok(kv, seq) || pos / MD_KV_BLOCK_TOKENS >= kv->seqs[seq].n_blocks)
		return -1;
	return kv->seqs[seq].blocks[pos / MD_KV_BLOCK_TOKENS];
}

int64_t md_kv_block_refs(const struct md_kv_cache *kv, int32_t blk)
{
	if (blk < 0 || (uint32_t)blk >= kv->n_blocks)
		return -1;
	return kv->refs[blk];
}

int md_kv_batch_begin(struct md_kv_cache *kv, int n, const int32_t *seq, const int32_t *pos)
{
	if (n < 0)
		return -EINVAL;
	/* Pass 1: known sequences; each sequence's next expected position starts at its length. */
	for (int t = 0; t < n; t++) {
		if (!seq_ok(kv, seq[t]) || pos[t] < 0)
			return -EINVAL;
		kv->seqs[seq[t]]._next = kv->seqs[seq[t]].n_pos;
	}
	/* Pass 2: contiguity and reservation. _next ends as the batch's end of each sequence. */
	int rc = 0;
	for (int t = 0; t < n && !rc; t++) {
		struct md_kv_seq *s = &kv->seqs[seq[t]];
		if ((uint32_t)pos[t] != s->_next)
			rc = -EINVAL;
		else if ((uint64_t)pos[t] >= (uint64_t)s->n_blocks * MD_KV_BLOCK_TOKENS)
			rc = -ENOSPC;
		else
			s->_next++;
	}
	if (rc)
		return rc;
	/* Pass 3: count the copies first (all or nothing), then make them. A shared block with
	 * w writers in the batch and r holders needs w copies, or w - 1 when every holder writes
	 * (the last one finds itself the only holder). A sequence's first token in the batch is
	 * the one at its length: visit each sequence once through it. */
	uint64_t cow = 0;
	for (int t = 0; t < n; t++) {
		const struct md_kv_seq *s = &kv->seqs[seq[t]];
		if ((uint32_t)pos[t] != s->n_pos)
			continue;
		for (uint32_t i = s->n_pos / MD_KV_BLOCK_TOKENS; i < blocks_for(s->_next); i++)
			if (kv->refs[s->blocks[i]] > 1)
				kv->_writers[s->blocks[i]]++;
	}
	for (int t = 0; t < n; t++) {
		const struct md_kv_seq *s = &kv->seqs[seq[t]];
		if ((uint32_t)pos[t] != s->n_pos)
			continue;
		for (uint32_t i = s->n_pos / MD_KV_BLOCK_TOKENS; i < blocks_for(s->_next); i++) {
			int32_t b = s->blocks[i];
			uint32_t w = kv->_writers[b];
			if (w) {
				cow += w < kv->refs[b] ? w : w - 1;
				kv->_writers[b] = 0;
			}
		}
	}
	if (cow > avail(kv))
		return -ENOSPC;
	for (int t = 0; t < n; t++) {
		struct md_kv_seq *s = &kv->seqs[seq[t]];
		if ((uint32_t)pos[t] != s->n_pos)
			continue;
		if (cow)
			seq_unshare(kv, s, s->n_pos, s->_next);
		seq_uncache(kv, s, s->n_pos, s->_next);
	}
	return 0;
}

/* Row index of (l, seq, pos) in the pool: times kv_dim for K, v_dim for V. */
static inline size_t kv_row(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	const struct md_kv_seq *s = &kv->seqs[seq];
	size_t blk = (size_t)s->blocks[pos / MD_KV_BLOCK_TOKENS];
	return ((size_t)l * kv->n_blocks + blk) * MD_KV_BLOCK_TOKENS + pos % MD_KV_BLOCK_TOKENS;
}

/* Row index of a position about to be written (asserted writable: md_kv_write_rows). */
static size_t write_row(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	MD_ASSERT(seq_ok(kv, seq) && l < kv->n_layer);
	const struct md_kv_seq *s = &kv->seqs[seq];
	MD_ASSERT(pos >= s->n_pos && pos / MD_KV_BLOCK_TOKENS < s->n_blocks);
	MD_ASSERT(kv->refs[s->blocks[pos / MD_KV_BLOCK_TOKENS]] == 1);
	MD_ASSERT(!kv->px || !kv->px->reg[s->blocks[pos / MD_KV_BLOCK_TOKENS]]);
	return kv_row(kv, l, seq, pos);
}

void md_kv_write_rows(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos, float **k,
		      float **v)
{
	MD_ASSERT(kv->k_bytes == sizeof(float));
	size_t row = write_row(kv, l, seq, pos);
	*k = (float *)kv->k + row * kv->kv_dim;
	*v = kv->v ? kv->v + row * kv->v_dim : NULL;
}

uint16_t *md_kv_write_k16(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	MD_ASSERT(kv->k_bytes == 2);
	return (uint16_t *)kv->k + write_row(kv, l, seq, pos) * kv->kv_dim;
}

int md_kv_commit(struct md_kv_cache *kv, int seq, uint32_t n_pos)
{
	if (!seq_ok(kv, seq))
		return -EINVAL;
	struct md_kv_seq *s = &kv->seqs[seq];
	if (n_pos < s->n_pos || (uint64_t)n_pos > (uint64_t)s->n_blocks * MD_KV_BLOCK_TOKENS)
		return -EINVAL;
	s->n_pos = n_pos;
	return 0;
}

const float *md_kv_k(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	MD_ASSERT(kv->k_bytes == sizeof(float));
	return (const float *)kv->k + kv_row(kv, l, seq, pos) * kv->kv_dim;
}

const uint16_t *md_kv_k16(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	MD_ASSERT(kv->k_bytes == 2);
	return (const uint16_t *)kv->k + kv_row(kv, l, seq, pos) * kv->kv_dim;
}

const float *md_kv_v(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	MD_ASSERT(kv->v);
	return kv->v + kv_row(kv, l, seq, pos) * kv->v_dim;
}

/* ---- prefix cache ---- */

int md_kv_prefix_enable(struct md_kv_cache *kv)
{
	if (kv->px)
		return 0;
	struct md_kv_prefix *px = calloc(1, sizeof(*px));
	if (!px)
		return -ENOMEM;
	uint32_t nbk = 16;
	while (nbk < 2 * kv->n_blocks)
		nbk *= 2;
	px->mask = nbk - 1;
	px->hash = calloc(kv->n_blocks, sizeof(uint64_t));
	px->parent = calloc(kv->n_blocks, sizeof(uint64_t));
	px->toks = calloc((size_t)kv->n_blocks * MD_KV_BLOCK_TOKENS, sizeof(int32_t));
	px->reg = calloc(kv->n_blocks, 1);
	px->len = calloc(kv->n_blocks, 1);
	px->bucket = malloc(nbk * sizeof(int32_t));
	px->hnext = calloc(kv->n_blocks, sizeof(int32_t));
	px->prev = calloc(kv->n_blocks, sizeof(int32_t));
	px->next = calloc(kv->n_blocks, sizeof(int32_t));
	kv->px = px; /* md_kv_release frees a partial one */
	if (!px->hash || !px->parent || !px->toks || !px->reg || !px->len || !px->bucket || !px->hnext ||
	    !px->prev || !px->next)
		return -ENOMEM;
	for (uint32_t i = 0; i < nbk; i++)
		px->bucket[i] = -1;
	px->head = px->tail = -1;
	return 0;
}

/* h(block) from h(previous block) and its tokens: splitmix64's finaliser over each. */
static uint64_t chain_hash(uint64_t parent, const int32_t *toks)
{
	uint64_t h = parent ^ 0x9e3779b97f4a7c15ull;
	for (int i = 0; i < MD_KV_BLOCK_TOKENS; i++) {
		h ^= (uint32_t)toks[i];
		h += 0x9e3779b97f4a7c15ull;
		h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
		h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
		h ^= h >> 31;
	}
	return h ? h : 1; /* 0 stands for "no previous block" */
}

/* The registered block with this content, or -1. */
static int32_t px_find(const struct md_kv_cache *kv, uint64_t h, uint64_t parent,
		       const int32_t *toks)
{
	const struct md_kv_prefix *px = kv->px;
	for (int32_t b = px->bucket[h & px->mask]; b >= 0; b = px->hnext[b])
		if (px->hash[b] == h && px->parent[b] == parent &&
		    memcmp(px->toks + (size_t)b * MD_KV_BLOCK_TOKENS, toks,
			   MD_KV_BLOCK_TOKENS * sizeof(int32_t)) == 0)
			return b;
	return -1;
}

static void lru_unlink(struct md_kv_prefix *px, int32_t b)
{
	if (px->prev[b] >= 0)
		px->next[px->prev[b]] = px->next[b];
	else
		px->head = px->next[b];
	if (px->next[b] >= 0)
		px->prev[px->next[b]] = px->prev[b];
	else
		px->tail = px->prev[b];
	px->n_lru--;
}

/* Take b out of the index (it stays wherever it is held, as a plain block). */
static void px_unregister(struct md_kv_cache *kv, int32_t b)
{
	struct md_kv_prefix *px = kv->px;
	if (px->reg[b] == 2) { /* a tail: in no bucket */
		px->reg[b] = 0;
		px->n_reg--;
		return;
	}
	int32_t *link = &px->bucket[px->hash[b] & px->mask];
	while (*link != b) {
		MD_ASSERT(*link >= 0);
		link = &px->hnext[*link];
	}
	*link = px->hnext[b];
	px->reg[b] = 0;
	px->n_reg--;
}

/* The registered block (whole, or a tail) after the block with chain hash parent whose first
 * tokens agree longest with toks[0, n) (n <= MD_KV_BLOCK_TOKENS); the agreement in *common. A
 * scan of the pool: once per admitted sequence, a few microseconds for thousands of blocks. */
static int32_t px_best_child(const struct md_kv_cache *kv, uint64_t parent, const int32_t *toks,
			     uint32_t n, uint32_t *common)
{
	const struct md_kv_prefix *px = kv->px;
	int32_t best = -1;
	*common = 0;
	for (uint32_t b = 0; b < kv->n_blocks; b++) {
		if (!px->reg[b] || px->parent[b] != parent)
			continue;
		const int32_t *t = px->toks + (size_t)b * MD_KV_BLOCK_TOKENS;
		uint32_t lim = px->reg[b] == 2 ? px->len[b] : MD_KV_BLOCK_TOKENS, j = 0;
		if (lim > n)
			lim = n;
		while (j < lim && t[j] == toks[j])
			j++;
		if (j > *common) {
			*common = j;
			best = (int32_t)b;
		}
	}
	return best;
}

uint32_t md_kv_prefix_attach(struct md_kv_cache *kv, int seq, const int32_t *toks,
			     uint32_t n_tok)
{
	if (!kv->px || !seq_ok(kv, seq) || kv->seqs[seq].n_blocks || kv->seqs[seq].n_pos)
		return 0;
	struct md_kv_prefix *px = kv->px;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t nb = n_tok / MD_KV_BLOCK_TOKENS, i = 0;
	uint64_t parent = 0;
	for (; i < nb; i++) {
		const int32_t *t = toks + (size_t)i * MD_KV_BLOCK_TOKENS;
		uint64_t h = chain_hash(parent, t);
		int32_t b = px_find(kv, h, parent, t);
		if (b < 0 || table_grow(s, i + 1))
			break;
		if (kv->refs[b]++ == 0)
			lru_unlink(px, b);
		s->blocks[i] = b;
		s->chain[i] = h;
		parent = h;
	}
	s->n_blocks = i;
	s->n_chain = i;
	s->n_pos = i * MD_KV_BLOCK_TOKENS;
	/* The next block in part: rows of a registered block (whole or a tail) whose first tokens
	 * are the next ones are copied into a block of the sequence's own, which it then writes
	 * on from there. So a repeated prompt recomputes its last token only, as it would if
	 * blocks were one token long. */
	uint32_t rest = n_tok - s->n_pos, j;
	int32_t src = rest ? px_best_child(kv, parent, toks + s->n_pos,
					   rest < MD_KV_BLOCK_TOKENS ? rest : MD_KV_BLOCK_TOKENS, &j)
			   : -1;
	if (src >= 0 && avail(kv) > 0 && !table_grow(s, i + 1)) {
		/* held across block_take, which could otherwise hand src itself out */
		if (kv->refs[src]++ == 0)
			lru_unlink(px, src);
		if (avail(kv) > 0) {
			int32_t own = block_take(kv);
			block_copy(kv, own, src);
			s->blocks[i] = own;
			s->n_blocks = i + 1;
			s->n_pos += j;
		}
		block_put(kv, src);
	}
	return s->n_pos;
}

void md_kv_prefix_register_tail(struct md_kv_cache *kv, int seq, const int32_t *toks,
				uint32_t n_tok)
{
	if (!kv->px || !seq_ok(kv, seq))
		return;
	struct md_kv_prefix *px = kv->px;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t n = n_tok < s->n_pos ? n_tok : s->n_pos;
	uint32_t i = n / MD_KV_BLOCK_TOKENS, k = n % MD_KV_BLOCK_TOKENS;
	md_kv_prefix_register(kv, seq, toks, n); /* the whole blocks before it, if not yet */
	if (k == 0 || i >= s->n_blocks || s->n_chain != i)
		return;
	int32_t b = s->blocks[i];
	/* only a block nobody else holds: a shared one may be another sequence's to copy */
	if (kv->refs[b] != 1 || px->reg[b])
		return;
	px->reg[b] = 2;
	px->n_reg++;
	px->len[b] = (uint8_t)k;
	px->parent[b] = i ? s->chain[i - 1] : 0;
	px->hash[b] = 0;
	memcpy(px->toks + (size_t)b * MD_KV_BLOCK_TOKENS, toks + (size_t)i * MD_KV_BLOCK_TOKENS,
	       k * sizeof(int32_t));
}

void md_kv_prefix_register(struct md_kv_cache *kv, int seq, const int32_t *toks, uint32_t n_tok)
{
	if (!kv->px || !seq_ok(kv, seq))
		return;
	struct md_kv_prefix *px = kv->px;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t end = (n_tok < s->n_pos ? n_tok : s->n_pos) / MD_KV_BLOCK_TOKENS;
	for (uint32_t i = s->n_chain; i < end; i++) {
		const int32_t *t = toks + (size_t)i * MD_KV_BLOCK_TOKENS;
		uint64_t parent = i ? s->chain[i - 1] : 0;
		uint64_t h = chain_hash(parent, t);
		int32_t b = s->blocks[i];
		s->chain[i] = h;
		s->n_chain = i + 1;
		if (px->reg[b] || px_find(kv, h, parent, t) >= 0)
			continue;
		px->reg[b] = 1;
		px->n_reg++;
		px->hash[b] = h;
		px->parent[b] = parent;
		memcpy(px->toks + (size_t)b * MD_KV_BLOCK_TOKENS, t,
		       MD_KV_BLOCK_TOKENS * sizeof(int32_t));
		uint32_t k = (uint32_t)(h & px->mask);
		px->hnext[b] = px->bucket[k];
		px->bucket[k] = b;
	}
}

uint32_t md_kv_prefix_blocks(const struct md_kv_cache *kv)
{
	return kv->px ? kv->px->n_reg : 0;
}

uint64_t md_kv_prefix_evictions(const struct md_kv_cache *kv)
{
	return kv->px ? kv->px->evicted : 0;
}
