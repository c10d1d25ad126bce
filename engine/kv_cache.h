/* Paged KV cache: fixed-size blocks from one pool, a block table per sequence, blocks shared
 * between sequences by reference count.
 *
 * This module is the only one that changes sequence state (lengths, block tables, reference
 * counts). The forward pass validates a batch with md_kv_batch_begin, writes rows through
 * md_kv_write_rows, reads them with md_kv_k/_v and commits lengths with md_kv_commit.
 *
 * Sharing: md_kv_seq_fork makes a sequence that references the first blocks of another
 * (a prefix cache, parallel samples, speculation branches). A block is returned to the pool
 * when its last reference goes. A shared block is never written: whoever is about to write
 * into one (md_kv_reserve for the positions it makes room for, md_kv_batch_begin for the
 * positions of the batch) first copies it into a block of its own (copy-on-write), so the
 * other holders keep their rows. Only positions at or beyond a sequence's committed length
 * are ever written, so the copy happens at most once per shared block per writer: it is the
 * partly filled tail block of a fork, or a block a truncation cut into.
 *
 * Prefix cache (md_kv_prefix_enable): a full block whose positions are committed can be
 * registered under a hash of its tokens and of every token before it (a chain hash), after
 * which a new sequence with the same leading tokens attaches it instead of computing it again
 * (md_kv_prefix_attach). A registered block whose last holder lets go is not freed but kept,
 * least recently released first out, until the pool needs a block (md_kv_blocks_free counts
 * it as free). A registered block is never written: a holder about to write into it copies it
 * when it is shared, and takes it out of the cache when it is the only holder.
 *
 * Every function runs on the thread that owns the cache (the engine thread). */
#ifndef MD_KV_CACHE_H
#define MD_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MD_KV_BLOCK_TOKENS 16

/* Callers outside kv_cache.c read these only through the functions below. */
struct md_kv_seq {
	int32_t *blocks;   /* owned: block ids (cap_blocks), the first n_blocks in use */
	uint32_t n_blocks; /* blocks in the table: positions < n_blocks * MD_KV_BLOCK_TOKENS are reserved */
	uint32_t cap_blocks;
	uint32_t n_pos;    /* positions stored and committed (the sequence length so far) */
	uint32_t _next;    /* md_kv_batch_begin's scratch: next expected position in the batch */
	uint64_t *chain;   /* owned (cap_blocks) with the prefix cache: chain hash of block i */
	uint32_t n_chain;  /* blocks whose chain hash is known (full, committed, registered or
			      a duplicate of a registered one) */
	bool in_use;
};

/* The prefix cache's index and its list of unreferenced registered blocks. */
struct md_kv_prefix {
	uint64_t *hash;      /* owned (n_blocks): chain hash of a registered block */
	uint64_t *parent;    /* owned (n_blocks): chain hash of the block before it (0: first) */
	int32_t *toks;       /* owned (n_blocks * MD_KV_BLOCK_TOKENS): its tokens */
	uint8_t *reg;        /* owned (n_blocks): 1 registered (a whole block, indexed by its
			      * chain hash), 2 a sequence's last, partial block registered when
			      * the sequence ended (found by its parent only, never shared: copied) */
	uint8_t *len;        /* owned (n_blocks): tokens of a partial block (reg 2) */
	int32_t *bucket;     /* owned (mask + 1): first block of each hash bucket, -1: none */
	int32_t *hnext;      /* owned (n_blocks): next block in the bucket */
	uint32_t mask;
	int32_t *prev, *next; /* owned (n_blocks): the unreferenced list, oldest at head */
	int32_t head, tail;
	uint32_t n_lru;      /* registered blocks no sequence holds */
	uint32_t n_reg;      /* registered blocks */
	uint64_t evicted;    /* registered blocks reused for something else */
};

struct md_kv_cache {
	uint32_t n_layer;
	uint32_t kv_dim;            /* elements per K row (n_head_kv * head_dim; the latent row of
				     * multi-head latent attention: kv_lora_rank + rope dims) */
	uint32_t k_bytes;           /* bytes per K element: 4 (float) or 2 (IEEE half) */
	uint32_t v_dim;             /* floats per V row; 0: no V rows (the model reads its values
				     * from the K rows, as latent attention does) */
	uint32_t n_blocks;          /* pool size */
	uint32_t n_free;
	int32_t *free_list;         /* owned (n_blocks): the first n_free are free block ids */
	uint32_t *refs;             /* owned (n_blocks): block tables holding each block, 0 = free */
	uint32_t *_writers;         /* owned (n_blocks): md_kv_batch_begin's scratch, all 0 between calls */
	void *k;                    /* owned: (n_layer, n_blocks, MD_KV_BLOCK_TOKENS, kv_dim) of
				     * float or half (k_bytes) */
	float *v;                   /* owned: (n_layer, n_blocks, MD_KV_BLOCK_TOKENS, v_dim); NULL
				     * when v_dim is 0 */
	struct md_kv_seq *seqs;     /* owned (max_seqs) */
	uint32_t max_seqs;
	struct md_kv_prefix *px;    /* owned: the prefix cache, NULL while disabled */
	/* Called after every copy of a block's rows (md_kv_set_copy_hook), NULL: none. */
	void (*copy_hook)(void *ud, int32_t dst, int32_t src);
	void *copy_ud;
};

/* What one token's rows hold per layer (md_model_kv_rows says it for a model): k_dim elements
 * per K row and v_dim floats per V row, v_dim 0 for a model whose values live in its K rows.
 * k_half: the K rows are IEEE half, not float. Multi-head latent attention caches one
 * compressed row per token and layer, in half as llama.cpp does (its default F16 cache);
 * every other model caches float K and V rows. */
struct md_kv_rows {
	uint32_t k_dim, v_dim;
	bool k_half;
};

/* Allocate a pool of n_blocks blocks for up to max_seqs sequences, float K and V rows of
 * kv_dim. Returns 0, -EINVAL (a zero size), -EOVERFLOW or -ENOMEM (kv zeroed then). */
int md_kv_init(struct md_kv_cache *kv, uint32_t n_layer, uint32_t kv_dim, uint32_t n_blocks,
	       uint32_t max_seqs);
/* The same with the rows a model says (md_model_kv_rows). */
int md_kv_init_rows(struct md_kv_cache *kv, uint32_t n_layer, struct md_kv_rows rows,
		    uint32_t n_blocks, uint32_t max_seqs);
/* Bytes one token's rows take over all layers (the pool's unit of memory). */
uint64_t md_kv_token_bytes(uint32_t n_layer, struct md_kv_rows rows);
void md_kv_release(struct md_kv_cache *kv);

/* Claim a free sequence slot (empty: length 0, no blocks); returns its id or -ENOSPC. */
int md_kv_seq_new(struct md_kv_cache *kv);
/* Free a sequence: drop its references to all its blocks and release its slot. Unknown ids
 * are ignored. */
void md_kv_seq_free(struct md_kv_cache *kv, int seq);
/* A new sequence whose first n_pos positions are those of src: it references src's first
 * ceil(n_pos / MD_KV_BLOCK_TOKENS) blocks (each block's count + 1) and has length n_pos.
 * Nothing is copied now; the shared tail block is copied when either side writes into it.
 * Returns the new id, -EINVAL (src unknown, or n_pos > src's length), -ENOSPC (no free slot)
 * or -ENOMEM; on failure nothing changed. */
int md_kv_seq_fork(struct md_kv_cache *kv, int src, uint32_t n_pos);

/* Make room to write positions [length, n_pos) of seq: blocks up to n_pos (exclusive), and a
 * private copy of any shared block in that range. Returns 0, -EINVAL (unknown seq), -ENOSPC
 * (not enough free blocks) or -ENOMEM; on failure nothing changed. Reserving less than is
 * already reserved is a no-op. */
int md_kv_reserve(struct md_kv_cache *kv, int seq, uint32_t n_pos);
/* Forget positions >= n_pos (rollback): the length becomes min(length, n_pos), blocks past
 * ceil(n_pos / MD_KV_BLOCK_TOKENS) are dropped (returned to the pool when no other sequence
 * holds them). Rows below n_pos are untouched. Unknown ids are ignored. */
void md_kv_truncate(struct md_kv_cache *kv, int seq, uint32_t n_pos);

/* Turn the prefix cache on (before any sequence exists). Returns 0 or -ENOMEM. */
int md_kv_prefix_enable(struct md_kv_cache *kv);
/* Attach to the empty sequence seq the longest run of registered blocks whose tokens are
 * toks[0, n_tok) block by block (shared, not copied), then, from the registered blocks that
 * follow the last of them (whole ones and tails, md_kv_prefix_register_tail), copy the rows of
 * the one whose first tokens agree longest with the next tokens into a block of seq's own
 * (taken from the pool now, when it has one). Returns the positions attached, at most n_tok (0
 * when the cache is off, seq is unknown or not empty, or nothing matched); the sequence's
 * length becomes that. */
uint32_t md_kv_prefix_attach(struct md_kv_cache *kv, int seq, const int32_t *toks,
			     uint32_t n_tok);
/* Register seq's full, committed blocks below position n_tok, whose tokens are toks[0, n_tok)
 * (the sequence's tokens from its start). Blocks whose content is already registered are left
 * alone. No-op when the cache is off. */
void md_kv_prefix_register(struct md_kv_cache *kv, int seq, const int32_t *toks, uint32_t n_tok);
/* At the end of seq (before md_kv_seq_free): register its blocks below n_tok as
 * md_kv_prefix_register does, and its last, partial block too (the positions past the last
 * whole block, when seq alone holds that block), for md_kv_prefix_attach to copy rows from. */
void md_kv_prefix_register_tail(struct md_kv_cache *kv, int seq, const int32_t *toks,
				uint32_t n_tok);
/* Registered blocks (held or not), and those reused since for other content. */
uint32_t md_kv_prefix_blocks(const struct md_kv_cache *kv);
uint64_t md_kv_prefix_evictions(const struct md_kv_cache *kv);

/* Tell fn(ud, dst, src) each time the cache copies every layer's rows of block src into
 * block dst (copy-on-write, a prefix attached in part), after the copy: a mirror of the pool
 * elsewhere (the device forward pass's, engine/forward_dev.h) copies its own rows the same
 * way. NULL removes it. */
void md_kv_set_copy_hook(struct md_kv_cache *kv, void (*fn)(void *ud, int32_t dst, int32_t src),
			 void *ud);

/* Free the pool's rows, keeping its bookkeeping (block tables, counts, the prefix cache): the
 * rows live in a mirror elsewhere (the device forward pass's, told of every block copy by
 * the copy hook). Afterwards nothing may read or write rows through this cache (md_kv_k,
 * md_kv_write_rows ...). */
void md_kv_drop_rows(struct md_kv_cache *kv);

/* Distinct blocks held by any sequence (a block shared by three counts once). */
uint32_t md_kv_blocks_used(const struct md_kv_cache *kv);
/* Blocks free in the pool (registered blocks no sequence holds included), and its size. */
uint32_t md_kv_blocks_free(const struct md_kv_cache *kv);
uint32_t md_kv_blocks_total(const struct md_kv_cache *kv);

/* Committed length of seq (0 for an unknown id). */
uint32_t md_kv_seq_len(const struct md_kv_cache *kv, int seq);
/* Positions reserved for seq (a multiple of MD_KV_BLOCK_TOKENS; 0 for an unknown id). */
uint32_t md_kv_seq_capacity(const struct md_kv_cache *kv, int seq);
/* Block id holding position pos of seq, or -1 where pos is not reserved. */
int32_t md_kv_seq_block(const struct md_kv_cache *kv, int seq, uint32_t pos);
/* Block tables referencing block id blk (0: free; -1 for an id outside the pool). */
int64_t md_kv_block_refs(const struct md_kv_cache *kv, int32_t blk);

/*
 * Validate a batch of n tokens against the cache and make its rows writable: every seq[t]
 * is a live sequence, and each sequence's positions in the batch are contiguous, increasing,
 * start at its committed length and lie within its reservation. Shared blocks the batch will
 * write into are copied first (the one step here that takes blocks from the pool). Returns 0,
 * -EINVAL (unknown sequence, negative position, gap, repeat), -ENOSPC (a position beyond the
 * reservation, or no free block for a copy); on failure nothing changed. Lengths do not move:
 * md_kv_commit does that once the rows are written.
 */
int md_kv_batch_begin(struct md_kv_cache *kv, int n, const int32_t *seq, const int32_t *pos);

/* Rows of layer l where K and V of (seq, pos) are to be written, kv_dim and v_dim floats (*v is
 * NULL when v_dim is 0). pos must be at or beyond seq's committed length and made writable by
 * md_kv_batch_begin or md_kv_reserve (asserted: the block is reserved and not shared). Float
 * K rows only; md_kv_write_k16 is the half rows' writer. */
void md_kv_write_rows(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos, float **k,
		      float **v);
uint16_t *md_kv_write_k16(struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos);

/* Positions [0, n_pos) of seq are written: its length becomes n_pos. Returns 0, or -EINVAL
 * (unknown seq, n_pos below its length - use md_kv_truncate - or beyond its reservation). */
int md_kv_commit(struct md_kv_cache *kv, int seq, uint32_t n_pos);

/* Row of K (or V) for layer l, sequence seq, position pos, kv_dim (v_dim) floats; the position
 * must be reserved. Valid until the next call that changes seq's block table. md_kv_v must
 * not be called when v_dim is 0. md_kv_k is for float K rows, md_kv_k16 for half ones. */
const float *md_kv_k(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos);
const uint16_t *md_kv_k16(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos);
const float *md_kv_v(const struct md_kv_cache *kv, uint32_t l, int seq, uint32_t pos);

#endif
