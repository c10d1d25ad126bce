/* Paged KV cache: one pool of fixed-size blocks shared by all sequences. */
#include "engine/kv_cache.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int md_kv_init(struct md_kv_cache *kv, uint32_t n_layer, uint32_t kv_dim, uint32_t n_blocks,
	       uint32_t max_seqs)
{
	memset(kv, 0, sizeof(*kv));
	if (n_layer == 0 || kv_dim == 0 || n_blocks == 0 || max_seqs == 0)
		return -EINVAL;
	size_t per = (size_t)n_layer * n_blocks * MD_KV_BLOCK_TOKENS * kv_dim;
	if (per / n_layer / n_blocks / MD_KV_BLOCK_TOKENS != kv_dim)
		return -EOVERFLOW;
	kv->n_layer = n_layer;
	kv->kv_dim = kv_dim;
	kv->n_blocks = n_blocks;
	kv->max_seqs = max_seqs;
	kv->k = malloc(per * sizeof(float));
	kv->v = malloc(per * sizeof(float));
	kv->free_list = malloc(n_blocks * sizeof(int32_t));
	kv->seqs = calloc(max_seqs, sizeof(*kv->seqs));
	if (!kv->k || !kv->v || !kv->free_list || !kv->seqs) {
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
	free(kv->k);
	free(kv->v);
	memset(kv, 0, sizeof(*kv));
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
	if (seq < 0 || (uint32_t)seq >= kv->max_seqs || !kv->seqs[seq].in_use)
		return;
	md_kv_truncate(kv, seq, 0);
	kv->seqs[seq].in_use = false;
}

int md_kv_reserve(struct md_kv_cache *kv, int seq, uint32_t n_pos)
{
	if (seq < 0 || (uint32_t)seq >= kv->max_seqs || !kv->seqs[seq].in_use)
		return -EINVAL;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t need = (n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
	if (need <= s->n_blocks)
		return 0;
	if (need - s->n_blocks > kv->n_free)
		return -ENOSPC;
	if (need > s->cap_blocks) {
		uint32_t cap = s->cap_blocks ? s->cap_blocks : 4;
		while (cap < need)
			cap *= 2;
		int32_t *nb = realloc(s->blocks, cap * sizeof(int32_t));
		if (!nb)
			return -ENOMEM;
		s->blocks = nb;
		s->cap_blocks = cap;
	}
	while (s->n_blocks < need)
		s->blocks[s->n_blocks++] = kv->free_list[--kv->n_free];
	return 0;
}

void md_kv_truncate(struct md_kv_cache *kv, int seq, uint32_t n_pos)
{
	if (seq < 0 || (uint32_t)seq >= kv->max_seqs || !kv->seqs[seq].in_use)
		return;
	struct md_kv_seq *s = &kv->seqs[seq];
	uint32_t keep = (n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
	while (s->n_blocks > keep)
		kv->free_list[kv->n_free++] = s->blocks[--s->n_blocks];
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

static inline size_t kv_offset(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	const struct md_kv_seq *s = &kv->seqs[seq];
	size_t blk = (size_t)s->blocks[pos / MD_KV_BLOCK_TOKENS];
	size_t row = ((size_t)l * kv->n_blocks + blk) * MD_KV_BLOCK_TOKENS + pos % MD_KV_BLOCK_TOKENS;
	return row * kv->kv_dim;
}

float *md_kv_k(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	return kv->k + kv_offset(kv, l, seq, pos);
}

float *md_kv_v(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos)
{
	return kv->v + kv_offset(kv, l, seq, pos);
}
