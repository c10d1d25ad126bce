/* Paged KV cache: fixed-size blocks from one pool, a block table per sequence. */
#ifndef MD_KV_CACHE_H
#define MD_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MD_KV_BLOCK_TOKENS 16

struct md_kv_seq {
	int32_t *blocks;   /* owned: block ids, (cap_blocks) */
	uint32_t n_blocks;
	uint32_t cap_blocks;
	uint32_t n_pos;    /* positions stored (the sequence length so far) */
	bool in_use;
};

struct md_kv_cache {
	uint32_t n_layer, kv_dim;   /* kv_dim = n_head_kv * head_dim */
	uint32_t n_blocks;          /* pool size */
	uint32_t n_free;
	int32_t *free_list;         /* owned (n_blocks) */
	float *k, *v;               /* owned: (n_layer, n_blocks, MD_KV_BLOCK_TOKENS, kv_dim) */
	struct md_kv_seq *seqs;     /* owned (max_seqs) */
	uint32_t max_seqs;
};

int md_kv_init(struct md_kv_cache *kv, uint32_t n_layer, uint32_t kv_dim, uint32_t n_blocks,
	       uint32_t max_seqs);
void md_kv_release(struct md_kv_cache *kv);

/* Claim a free sequence slot; returns its id or -ENOSPC. */
int md_kv_seq_new(struct md_kv_cache *kv);
/* Free a sequence and all its blocks. */
void md_kv_seq_free(struct md_kv_cache *kv, int seq);
/* Make room for positions up to n_pos (exclusive); returns 0 or -ENOSPC (nothing changed). */
int md_kv_reserve(struct md_kv_cache *kv, int seq, uint32_t n_pos);
/* Forget positions >= n_pos (rollback); frees blocks no longer needed. */
void md_kv_truncate(struct md_kv_cache *kv, int seq, uint32_t n_pos);
uint32_t md_kv_blocks_used(const struct md_kv_cache *kv);
/* Blocks free in the pool, and the pool size. */
uint32_t md_kv_blocks_free(const struct md_kv_cache *kv);
uint32_t md_kv_blocks_total(const struct md_kv_cache *kv);

/* Row of K (or V) for layer l, sequence seq, position pos; the position must be reserved. */
float *md_kv_k(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos);
float *md_kv_v(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos);

#endif
