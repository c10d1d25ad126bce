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
 * is only read, or a branch dropped before it diverges). */
#include "engine/kv_cache.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"

static inline uint32_t blocks_for(uint32_t n_pos)
{
	return (uint32_t)(((uint64_t)n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS);
}

static inline bool seq_ok(const struct md_kv_cache *kv, int seq)
{
	return seq >= 0 && (uint32_t)seq < kv->max_seqs && kv->seqs[seq].in_use;
}

int md_kv_init(struct md_kv_cache *kv, uint32_t n_layer, uint32_t kv_dim, uint32_t n_blocks,
	       uint32_t max_seqs)
{
	memset(kv, 0, sizeof(*kv));
	if (n_layer == 0 || kv_dim == 0 || n_blocks == 0 || max_seqs == 0)
		return -EINVAL;
	size_t per = (size_t)n_layer * n_blocks * MD_KV_BLOCK_TOKENS * kv_dim;
	if (per / n_layer / n_blocks / MD_KV_BLOCK_TOKENS != kv_dim || per > SIZE_MAX / sizeof(float))
		return -EOVERFLOW;
	kv->n_layer = n_layer;
	kv->kv_dim = kv_dim;
	kv->n_blocks = n_blocks;
	kv->max_seqs = max_seqs;
	kv->k = malloc(per * sizeof(float));
	kv->v = malloc(per * sizeof(float));
	kv->free_list = malloc(n_blocks * sizeof(int32_t));
	kv->refs = calloc(n_blocks, sizeof(uint32_t));
	kv->_writers = calloc(n_blocks, sizeof(uint32_t));
	kv->seqs = calloc(max_seqs, sizeof(*kv->seqs));
	if (!kv->k || !kv->v || !kv->free_list || !kv->refs || !kv->_writers || !kv->seqs) {
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
		for (uint32_t s = 0; s < kv->max_seqs; s++)
			free(kv->seqs[s].blocks);
	free(kv->seqs);
	free(kv->free_list);
	free(kv->refs);
	free(kv->_writers);
	free(kv->k);
	free(kv->v);
	memset(kv, 0, sizeof(*kv));
}

/* Take a block from the pool with count 1; the caller checked n_free. */
static int32_t block_take(struct md_kv_cache *kv)
{
	MD_ASSERT(kv->n_free > 0);
	int32_t b = kv->free_list[--kv->n_free];
	MD_ASSERT(kv->refs[b] == 0);
	kv->refs[b] = 1;
	return b;
}

/* Drop one reference; the block returns to the pool at 0. */
static void block_put(struct md_kv_cache *kv, int32_t b)
{
	MD_ASSERT(kv->refs[b] > 0);
	if (--kv->refs[b] == 0)
		kv->free_list[kv->n_free++] = b;
}

/* Copy every layer's K and V rows of block src into dst. */
static void block_copy(struct md_kv_cache *kv, int32_t dst, int32_t src)
{
	const size_t rows = (size_t)MD_KV_BLOCK_TOKENS * kv->kv_dim;
	for (uint32_t l = 0; l < kv->n_layer; l++) {
		size_t base = (size_t)l * kv->n_blocks;
		memcpy(kv->k + (base + (size_t)dst) * rows, kv->k + (base + (size_t)src) * rows,
		       rows * sizeof(float));
		memcpy(kv->v + (base + (size_t)dst) * rows, kv->v + (base + (size_t)src) * rows,
		       rows * sizeof(float));
	}
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
	s->cap_blocks = cap;
	return 0;
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
	if (add == 0 && cow == 0)
		return 0;
	if ((uint64_t)add + cow > kv->n_free)
		return -ENOSPC;
	if (table_grow(s, need))
		return -ENOMEM;
	seq_unshare(kv, s, s->n_pos, n_pos);
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
}

uint32_t md_kv_blocks_used(const struct md_kv_cache *kv)
{
	return kv->n_blocks - kv->n_free;
}

uint32_t md_kv_blocks_free(const struct md_kv_cache *kv)
{
	return kv->n_free;
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
	if (cow > kv->n_free)
		return -ENOSPC;
	if (cow)
		for (int t = 0; t < n; t++) {
			struct md_kv_seq *s = &kv->seqs[seq[t]];
			if ((uint32_t)pos[t] == s->n_pos)
				seq_unshare(kv, s, s->n_pos, s->_next);
		}
	return 0;
}

static inline size_t kv_offset(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	const struct md_kv_seq *s = &kv->seqs[seq];
	size_t blk = (size_t)s->blocks[pos / MD_KV_BLOCK_TOKENS];
	size_t row = ((size_t)l * kv->n_blocks + blk) * MD_KV_BLOCK_TOKENS + pos % MD_KV_BLOCK_TOKENS;
	return row * kv->kv_dim;
}

void md_kv_write_rows(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos, float **k,
		      float **v)
{
	MD_ASSERT(seq_ok(kv, seq) && l < kv->n_layer);
	const struct md_kv_seq *s = &kv->seqs[seq];
	MD_ASSERT(pos >= s->n_pos && pos / MD_KV_BLOCK_TOKENS < s->n_blocks);
	MD_ASSERT(kv->refs[s->blocks[pos / MD_KV_BLOCK_TOKENS]] == 1);
	size_t off = kv_offset(kv, l, seq, pos);
	*k = kv->k + off;
	*v = kv->v + off;
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
	return kv->k + kv_offset(kv, l, seq, pos);
}

const float *md_kv_v(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	return kv->v + kv_offset(kv, l, seq, pos);
}
