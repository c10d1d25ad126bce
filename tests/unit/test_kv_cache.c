/* Unit tests for the paged KV cache: block accounting, reservation limits, truncation,
 * reference-counted sharing (fork), copy-on-write, speculative rollback, batch validation,
 * and (given the path of moed-gguf) that the forward pass over a forked prefix computes
 * exactly what it computes from scratch.
 *
 * usage: test_kv_cache [MOED_GGUF] */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "tests/check.h"
#include "gen_model.h"

#define DIM 8

/* A recognisable value for (layer, seq tag, position, element). */
static float val(uint32_t l, int tag, uint32_t p, int i)
{
	return (float)(l * 100000 + tag * 1000 + p * 10 + i);
}

/* Write K and V rows of every layer at positions [p0, p1) of seq through the write path:
 * validate as a batch, write, commit. Returns md_kv_batch_begin's code. */
static int write_span(struct md_kv_cache *kv, int seq, uint32_t p0, uint32_t p1, int tag)
{
	int32_t sq[64], ps[64];
	int n = (int)(p1 - p0);
	for (int t = 0; t < n; t++) {
		sq[t] = seq;
		ps[t] = (int32_t)(p0 + (uint32_t)t);
	}
	int rc = md_kv_batch_begin(kv, n, sq, ps);
	if (rc)
		return rc;
	for (uint32_t l = 0; l < kv->n_layer; l++)
		for (uint32_t p = p0; p < p1; p++) {
			float *k, *v;
			md_kv_write_rows(kv, l, seq, p, &k, &v);
			for (int i = 0; i < DIM; i++) {
				k[i] = val(l, tag, p, i);
				v[i] = -val(l, tag, p, i);
			}
		}
	CHECK_EQ_I(md_kv_commit(kv, seq, p1), 0);
	return 0;
}

/* True when positions [p0, p1) of seq hold tag's values in every layer, K and V. */
static int holds(const struct md_kv_cache *kv, int seq, uint32_t p0, uint32_t p1, int tag)
{
	for (uint32_t l = 0; l < kv->n_layer; l++)
		for (uint32_t p = p0; p < p1; p++)
			for (int i = 0; i < DIM; i++)
				if (md_kv_k(kv, l, seq, p)[i] != val(l, tag, p, i) ||
				    md_kv_v(kv, l, seq, p)[i] != -val(l, tag, p, i))
					return 0;
	return 1;
}

/* Sum of all reference counts must equal the blocks in all tables; used = distinct ids. */
static void check_accounting(const struct md_kv_cache *kv)
{
	uint64_t refs = 0, held = 0, distinct = 0;
	for (uint32_t b = 0; b < md_kv_blocks_total(kv); b++) {
		refs += (uint64_t)md_kv_block_refs(kv, (int32_t)b);
		distinct += md_kv_block_refs(kv, (int32_t)b) > 0;
	}
	for (uint32_t s = 0; s < kv->max_seqs; s++)
		held += md_kv_seq_capacity(kv, (int)s) / MD_KV_BLOCK_TOKENS;
	CHECK_EQ_U(refs, held);
	CHECK_EQ_U(md_kv_blocks_used(kv), distinct);
	CHECK_EQ_U(md_kv_blocks_used(kv) + md_kv_blocks_free(kv), md_kv_blocks_total(kv));
}

static void test_basic(void)
{
	struct md_kv_cache kv;
	CHECK_EQ_I(md_kv_init(&kv, 2, DIM, 10, 3), 0);
	int a = md_kv_seq_new(&kv), b = md_kv_seq_new(&kv), c = md_kv_seq_new(&kv);
	CHECK_EQ_I(a, 0);
	CHECK_EQ_I(b, 1);
	CHECK_EQ_I(c, 2);
	CHECK_EQ_I(md_kv_seq_new(&kv), -ENOSPC);

	/* 33 positions need 3 blocks of 16. */
	CHECK_EQ_I(md_kv_reserve(&kv, a, 33), 0);
	CHECK_EQ_U(md_kv_seq_capacity(&kv, a), 48);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);
	/* Reserving less is a no-op. */
	CHECK_EQ_I(md_kv_reserve(&kv, a, 10), 0);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);
	/* 7 blocks left: 8 blocks for b fail and change nothing. */
	CHECK_EQ_I(md_kv_reserve(&kv, b, 8 * 16), -ENOSPC);
	CHECK_EQ_U(md_kv_seq_capacity(&kv, b), 0);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);
	CHECK_EQ_I(md_kv_reserve(&kv, b, 7 * 16), 0);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 10);
	CHECK_EQ_I(md_kv_reserve(&kv, c, 1), -ENOSPC);
	CHECK_EQ_I(md_kv_reserve(&kv, 7, 1), -EINVAL);

	/* Rows of different sequences and layers never alias. */
	CHECK_EQ_I(write_span(&kv, a, 0, 33, 1), 0);
	CHECK_EQ_I(write_span(&kv, b, 0, 40, 2), 0);
	CHECK(holds(&kv, a, 0, 33, 1));
	CHECK(holds(&kv, b, 0, 40, 2));
	CHECK_EQ_U(md_kv_seq_len(&kv, a), 33);

	/* Truncation frees whole blocks only; the rows below stay. */
	md_kv_truncate(&kv, a, 17);
	CHECK_EQ_U(md_kv_seq_capacity(&kv, a), 32);
	CHECK_EQ_U(md_kv_seq_len(&kv, a), 17);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 9);
	CHECK(holds(&kv, a, 0, 17, 1));
	CHECK_EQ_I(md_kv_reserve(&kv, c, 16), 0);

	/* Freeing a sequence returns all its blocks and its slot. */
	md_kv_seq_free(&kv, b);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);
	CHECK_EQ_I(md_kv_seq_new(&kv), 1);
	CHECK_EQ_U(md_kv_seq_capacity(&kv, 1), 0);
	CHECK_EQ_U(md_kv_seq_len(&kv, 1), 0);
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* Fork shares blocks (count + 1 each, no new blocks); truncation and free drop references;
 * a block returns to the pool only with its last reference. */
static void test_fork_refcounts(void)
{
	struct md_kv_cache kv;
	CHECK_EQ_I(md_kv_init(&kv, 2, DIM, 12, 4), 0);
	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 40), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 40, 1), 0);
	int32_t a0 = md_kv_seq_block(&kv, a, 0), a1 = md_kv_seq_block(&kv, a, 16);
	int32_t a2 = md_kv_seq_block(&kv, a, 32);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);

	/* Forking beyond the source's length, or from nothing, fails and changes nothing. */
	CHECK_EQ_I(md_kv_seq_fork(&kv, a, 41), -EINVAL);
	CHECK_EQ_I(md_kv_seq_fork(&kv, 3, 0), -EINVAL);

	int b = md_kv_seq_fork(&kv, a, 40);
	CHECK(b >= 0 && b != a);
	CHECK_EQ_U(md_kv_seq_len(&kv, b), 40);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3); /* distinct blocks: sharing is free */
	CHECK_EQ_I(md_kv_block_refs(&kv, a0), 2);
	CHECK_EQ_I(md_kv_block_refs(&kv, a2), 2);
	CHECK_EQ_I(md_kv_seq_block(&kv, b, 33), a2);
	CHECK(holds(&kv, b, 0, 40, 1));

	int c = md_kv_seq_fork(&kv, a, 20); /* two blocks: the second partly */
	CHECK_EQ_U(md_kv_seq_capacity(&kv, c), 32);
	CHECK_EQ_I(md_kv_block_refs(&kv, a0), 3);
	CHECK_EQ_I(md_kv_block_refs(&kv, a1), 3);
	CHECK_EQ_I(md_kv_block_refs(&kv, a2), 2);
	int d = md_kv_seq_fork(&kv, c, 0); /* an empty fork holds nothing */
	CHECK_EQ_U(md_kv_seq_capacity(&kv, d), 0);
	CHECK_EQ_I(md_kv_seq_fork(&kv, a, 1), -ENOSPC); /* no slot left */
	CHECK_EQ_I(md_kv_block_refs(&kv, a0), 3);
	check_accounting(&kv);

	/* Truncating c drops its reference to the second block only. */
	md_kv_truncate(&kv, c, 10);
	CHECK_EQ_I(md_kv_block_refs(&kv, a0), 3);
	CHECK_EQ_I(md_kv_block_refs(&kv, a1), 2);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);

	/* Freeing the source keeps every block b still holds. */
	md_kv_seq_free(&kv, a);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);
	CHECK_EQ_I(md_kv_block_refs(&kv, a0), 2);
	CHECK_EQ_I(md_kv_block_refs(&kv, a2), 1);
	CHECK(holds(&kv, b, 0, 40, 1));
	md_kv_truncate(&kv, b, 16);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 1);
	CHECK_EQ_I(md_kv_block_refs(&kv, a2), 0);
	md_kv_seq_free(&kv, b);
	md_kv_seq_free(&kv, c);
	md_kv_seq_free(&kv, d);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 12);
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* Whoever writes into a shared block gets a copy; the other holders keep their rows. */
static void test_copy_on_write(void)
{
	struct md_kv_cache kv;
	CHECK_EQ_I(md_kv_init(&kv, 3, DIM, 8, 4), 0);
	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 20), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 20, 1), 0);
	int32_t a1 = md_kv_seq_block(&kv, a, 16);

	/* The fork writes first: md_kv_reserve copies the shared tail block. */
	int b = md_kv_seq_fork(&kv, a, 20);
	CHECK_EQ_I(md_kv_seq_block(&kv, b, 16), a1);
	CHECK_EQ_I(md_kv_reserve(&kv, b, 24), 0);
	CHECK(md_kv_seq_block(&kv, b, 16) != a1);
	CHECK_EQ_I(md_kv_seq_block(&kv, b, 0), md_kv_seq_block(&kv, a, 0)); /* full block: shared */
	CHECK_EQ_I(md_kv_block_refs(&kv, a1), 1);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 3);
	CHECK(holds(&kv, b, 0, 20, 1)); /* the copy carries the rows */
	CHECK_EQ_I(write_span(&kv, b, 20, 24, 2), 0);
	CHECK(holds(&kv, b, 20, 24, 2));
	CHECK_EQ_I(write_span(&kv, a, 20, 22, 3), 0); /* a's block is its own again: no copy */
	CHECK_EQ_I(md_kv_seq_block(&kv, a, 16), a1);
	CHECK(holds(&kv, a, 0, 20, 1) && holds(&kv, a, 20, 22, 3));
	CHECK(holds(&kv, b, 0, 20, 1) && holds(&kv, b, 20, 24, 2));

	/* The source writes first, through a batch (no reserve on the way): md_kv_batch_begin
	 * copies; the fork keeps the original block and its rows. */
	int c = md_kv_seq_fork(&kv, a, 18);
	CHECK_EQ_I(md_kv_block_refs(&kv, a1), 2);
	CHECK_EQ_I(write_span(&kv, a, 22, 24, 4), 0);
	CHECK(md_kv_seq_block(&kv, a, 16) != a1);
	CHECK_EQ_I(md_kv_seq_block(&kv, c, 16), a1);
	CHECK_EQ_I(md_kv_block_refs(&kv, a1), 1);
	CHECK(holds(&kv, a, 0, 20, 1) && holds(&kv, a, 20, 22, 3) && holds(&kv, a, 22, 24, 4));
	CHECK(holds(&kv, c, 0, 18, 1));
	CHECK_EQ_I(write_span(&kv, c, 18, 20, 5), 0); /* c alone holds it now: written in place */
	CHECK_EQ_I(md_kv_seq_block(&kv, c, 16), a1);
	CHECK(holds(&kv, a, 0, 20, 1) && holds(&kv, c, 18, 20, 5));

	/* Both holders of a shared block write it in one batch: one copy is enough (the last
	 * writer keeps the original), and the batch is not refused for want of a second. */
	md_kv_seq_free(&kv, b);
	md_kv_seq_free(&kv, c);
	int d = md_kv_seq_fork(&kv, a, 24), e2 = md_kv_seq_fork(&kv, a, 24);
	md_kv_seq_free(&kv, a);
	CHECK_EQ_I(md_kv_reserve(&kv, d, 32), 0);
	CHECK_EQ_I(md_kv_block_refs(&kv, md_kv_seq_block(&kv, e2, 16)), 1);
	/* d copied on reserve; now share again via a fork of e2 and fill the pool. */
	md_kv_seq_free(&kv, d);
	int f = md_kv_seq_fork(&kv, e2, 24);
	int32_t shared = md_kv_seq_block(&kv, f, 16);
	CHECK_EQ_I(md_kv_block_refs(&kv, shared), 2);
	int g = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, g, (md_kv_blocks_free(&kv) - 1) * 16), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 1);
	int32_t sq[2] = { e2, f }, ps[2] = { 24, 24 };
	CHECK_EQ_I(md_kv_batch_begin(&kv, 2, sq, ps), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 0);
	CHECK(md_kv_seq_block(&kv, e2, 16) != md_kv_seq_block(&kv, f, 16));
	CHECK_EQ_I(md_kv_block_refs(&kv, md_kv_seq_block(&kv, e2, 16)), 1);
	CHECK_EQ_I(md_kv_block_refs(&kv, md_kv_seq_block(&kv, f, 16)), 1);
	CHECK(holds(&kv, e2, 0, 20, 1) && holds(&kv, f, 0, 20, 1));
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* Speculation: write k rows, reject them (truncate back), the earlier rows are intact and
 * the positions can be written again - also on a fork whose rollback cuts into a full block
 * it shares. */
static void test_rollback(void)
{
	struct md_kv_cache kv;
	CHECK_EQ_I(md_kv_init(&kv, 2, DIM, 8, 2), 0);
	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 20), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 20, 1), 0);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 20 + 6), 0);
	CHECK_EQ_I(write_span(&kv, a, 20, 26, 9), 0); /* 6 drafted positions */
	md_kv_truncate(&kv, a, 22);                   /* 2 accepted */
	CHECK_EQ_U(md_kv_seq_len(&kv, a), 22);
	CHECK(holds(&kv, a, 0, 20, 1) && holds(&kv, a, 20, 22, 9));
	CHECK_EQ_I(write_span(&kv, a, 22, 24, 3), 0);
	CHECK(holds(&kv, a, 0, 20, 1) && holds(&kv, a, 20, 22, 9) && holds(&kv, a, 22, 24, 3));
	/* A rollback below a block boundary returns the block. */
	md_kv_truncate(&kv, a, 16);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 1);
	CHECK(holds(&kv, a, 0, 16, 1));

	/* The fork speculates past a full shared block, then rolls back into it. */
	CHECK_EQ_I(md_kv_reserve(&kv, a, 32), 0);
	CHECK_EQ_I(write_span(&kv, a, 16, 32, 1), 0);
	int b = md_kv_seq_fork(&kv, a, 32);
	int32_t a1 = md_kv_seq_block(&kv, a, 16);
	CHECK_EQ_I(md_kv_reserve(&kv, b, 36), 0);
	CHECK_EQ_I(write_span(&kv, b, 32, 36, 7), 0);
	md_kv_truncate(&kv, b, 30);
	CHECK_EQ_I(md_kv_seq_block(&kv, b, 16), a1); /* still shared: nothing written yet */
	CHECK_EQ_I(write_span(&kv, b, 30, 32, 8), 0);
	CHECK(md_kv_seq_block(&kv, b, 16) != a1);
	CHECK(holds(&kv, a, 0, 32, 1));
	CHECK(holds(&kv, b, 0, 30, 1) && holds(&kv, b, 30, 32, 8));
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* Snapshot of everything observable, to prove a failed call changed nothing. */
struct snap {
	uint32_t used, free_, len[4], cap[4];
	int64_t refs[16];
	int32_t blk[4][4];
};

static void take(const struct md_kv_cache *kv, struct snap *s)
{
	memset(s, 0, sizeof(*s));
	s->used = md_kv_blocks_used(kv);
	s->free_ = md_kv_blocks_free(kv);
	for (int q = 0; q < 4; q++) {
		s->len[q] = md_kv_seq_len(kv, q);
		s->cap[q] = md_kv_seq_capacity(kv, q);
		for (int i = 0; i < 4; i++)
			s->blk[q][i] = md_kv_seq_block(kv, q, (uint32_t)i * MD_KV_BLOCK_TOKENS);
	}
	for (int b = 0; b < 16; b++)
		s->refs[b] = md_kv_block_refs(kv, b);
}

/* An exhausted pool refuses reservations and copies with -ENOSPC and changes nothing. */
static void test_exhaustion(void)
{
	struct md_kv_cache kv;
	struct snap s0, s1;
	CHECK_EQ_I(md_kv_init(&kv, 2, DIM, 4, 4), 0);
	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 20), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 20, 1), 0);
	int b = md_kv_seq_fork(&kv, a, 20);
	int c = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, c, 32), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 0);

	take(&kv, &s0);
	/* A reservation that needs a copy (b's shared tail) and one that needs a new block. */
	CHECK_EQ_I(md_kv_reserve(&kv, b, 21), -ENOSPC);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 33), -ENOSPC);
	/* A batch writing into the shared block: no block for the copy. */
	int32_t sq[2] = { c, b }, ps[2] = { 0, 20 };
	CHECK_EQ_I(md_kv_batch_begin(&kv, 2, sq, ps), -ENOSPC);
	take(&kv, &s1);
	CHECK(memcmp(&s0, &s1, sizeof(s0)) == 0);
	CHECK(holds(&kv, a, 0, 20, 1) && holds(&kv, b, 0, 20, 1));

	/* Room again: the same batch goes through. */
	md_kv_truncate(&kv, c, 16);
	CHECK_EQ_I(md_kv_batch_begin(&kv, 2, sq, ps), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 0);
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* md_kv_batch_begin's checks and md_kv_commit's. */
static void test_batch_checks(void)
{
	struct md_kv_cache kv;
	struct snap s0, s1;
	CHECK_EQ_I(md_kv_init(&kv, 1, DIM, 8, 4), 0);
	int a = md_kv_seq_new(&kv), b = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 16), 0);
	CHECK_EQ_I(md_kv_reserve(&kv, b, 32), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 3, 1), 0);
	take(&kv, &s0);
	{ /* interleaved sequences, each contiguous from its length: fine */
		int32_t sq[] = { a, b, a, b }, ps[] = { 3, 0, 4, 1 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 4, sq, ps), 0);
	}
	{ /* gap */
		int32_t sq[] = { a, a }, ps[] = { 3, 5 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 2, sq, ps), -EINVAL);
	}
	{ /* repeat */
		int32_t sq[] = { b, b }, ps[] = { 0, 0 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 2, sq, ps), -EINVAL);
	}
	{ /* not from the length */
		int32_t sq[] = { a }, ps[] = { 2 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 1, sq, ps), -EINVAL);
	}
	{ /* unknown sequence, negative position */
		int32_t sq[] = { 2 }, ps[] = { 0 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 1, sq, ps), -EINVAL);
		int32_t sq2[] = { -1 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 1, sq2, ps), -EINVAL);
		int32_t sq3[] = { a }, ps3[] = { -1 };
		CHECK_EQ_I(md_kv_batch_begin(&kv, 1, sq3, ps3), -EINVAL);
	}
	{ /* beyond the reservation */
		int32_t sq[16], ps[16];
		for (int t = 0; t < 14; t++) {
			sq[t] = a;
			ps[t] = 3 + t;
		}
		CHECK_EQ_I(md_kv_batch_begin(&kv, 13, sq, ps), 0);
		CHECK_EQ_I(md_kv_batch_begin(&kv, 14, sq, ps), -ENOSPC);
	}
	take(&kv, &s1);
	CHECK(memcmp(&s0, &s1, sizeof(s0)) == 0);
	CHECK_EQ_I(md_kv_commit(&kv, a, 2), -EINVAL);  /* shrinking is truncate's job */
	CHECK_EQ_I(md_kv_commit(&kv, a, 17), -EINVAL); /* beyond the reservation */
	CHECK_EQ_I(md_kv_commit(&kv, 3, 1), -EINVAL);
	CHECK_EQ_I(md_kv_commit(&kv, a, 16), 0);
	CHECK_EQ_U(md_kv_seq_len(&kv, a), 16);
	md_kv_release(&kv);
}

/* ---------------------------------------------------------------- forward over a fork */

struct fw {
	struct md_model m;
	struct md_kv_cache kv;
	struct md_forward_ctx *f;
	float *logits;
	uint32_t V;
};

/* Run tokens tok[0..n) of seq at positions p0.. with logits for every row into out. */
static int run(struct fw *w, int seq, uint32_t p0, const int32_t *tok, int n, float *out)
{
	int32_t sq[64], ps[64];
	bool want[64];
	for (int t = 0; t < n; t++) {
		sq[t] = seq;
		ps[t] = (int32_t)p0 + t;
		want[t] = true;
	}
	if (md_kv_reserve(&w->kv, seq, p0 + (uint32_t)n))
		return -1;
	struct md_batch b = { n, tok, sq, ps, want, NULL };
	return md_forward(w->f, &w->kv, &b, out);
}

static int same_rows(const float *x, const float *y, size_t n)
{
	if (memcmp(x, y, n * sizeof(float)) == 0)
		return 1;
	float d = 0;
	for (size_t i = 0; i < n; i++)
		d = fabsf(x[i] - y[i]) > d ? fabsf(x[i] - y[i]) : d;
	fprintf(stderr, "rows differ: max |d| %g\n", (double)d);
	return 0;
}

static void test_forward_fork_arch(const char *moed_gguf, const char *const *args, bool same_prefix);

/* For an ordinary K/V cache (qwen3moe) and for latent attention's one compressed row per
 * token and layer (deepseek2: its rows shared, copied and rolled back the same way). */
static void test_forward_fork(const char *moed_gguf)
{
	static const char *const qwen[] = { "--arch", "qwen3moe", "--seed", "5", "--n-layer", "2",
					    "--n-expert", "8", "--n-expert-used", "2", NULL };
	static const char *const ds[] = { "--arch", "deepseek2", "--seed", "5", "--n-layer", "3",
					  "--n-expert", "8", "--n-expert-used", "2",
					  "--yarn-factor", "4", NULL };
	test_forward_fork_arch(moed_gguf, qwen, false);
	test_forward_fork_arch(moed_gguf, ds, true);
}

/* same_prefix: compute the from-scratch prefix below in the same batches as the fork's source
 * (0..20, truncated to 18), not as 0..17: the results are bit-identical only for one batch
 * composition (an expert with one token of a batch sums in the decode order), and with 8
 * experts in 3 layers some expert is that at one of the prefix positions. */
static void test_forward_fork_arch(const char *moed_gguf, const char *const *args, bool same_prefix)
{
	char dir[512], path[600], err[256];
	if (gen_model(moed_gguf, args, "fork.gguf", dir, sizeof dir, path, sizeof path)) {
		failures++;
		return;
	}
	struct fw w;
	memset(&w, 0, sizeof(w));
	if (md_model_load(&w.m, path, err, sizeof err)) {
		fprintf(stderr, "load: %s\n", err);
		failures++;
		gen_model_cleanup(dir, path);
		return;
	}
	const struct md_hparams *hp = &w.m.hp;
	w.V = hp->n_vocab;
	CHECK_EQ_I(md_kv_init_rows(&w.kv, hp->n_layer, md_model_kv_rows(&w.m), 32, 8), 0);
	w.f = md_forward_new(&w.m, 2, 64);
	CHECK(w.f != NULL);
	const size_t V = w.V;
	float *ref = malloc(64 * V * sizeof(float)), *got = malloc(64 * V * sizeof(float));
	float *ref_tail = malloc(64 * V * sizeof(float));
	int32_t tok[40];
	for (int i = 0; i < 40; i++)
		tok[i] = (int32_t)((i * 37 + 11) % (int)w.V);

	/* From scratch: tokens 0..20 then 21..25 in one sequence (two batches, as below). */
	int r = md_kv_seq_new(&w.kv);
	CHECK_EQ_I(run(&w, r, 0, tok, 21, ref), 21);
	CHECK_EQ_I(run(&w, r, 21, tok + 21, 5, ref_tail), 5);

	/* Over a fork at a block-unaligned point: the prefix is a's, read through shared
	 * blocks; the continuation writes into the shared tail block (a copy). */
	int a = md_kv_seq_new(&w.kv);
	CHECK_EQ_I(run(&w, a, 0, tok, 21, got), 21);
	CHECK(same_rows(got, ref, 21 * V));
	int b = md_kv_seq_fork(&w.kv, a, 21);
	CHECK_EQ_U(md_kv_blocks_used(&w.kv), 4); /* r: 2, a: 2, b: none of its own */
	CHECK_EQ_I(run(&w, b, 21, tok + 21, 5, got), 5);
	CHECK(same_rows(got, ref_tail, 5 * V));

	/* The source continues after the fork wrote: its rows are intact. */
	CHECK_EQ_I(run(&w, a, 21, tok + 21, 5, got), 5);
	CHECK(same_rows(got, ref_tail, 5 * V));

	/* A fork at 18 continuing with the same tokens as a: its last rows equal the
	 * scratch run's rows for positions 18..25, computed as 0..17 then 18..25. */
	int c = md_kv_seq_fork(&w.kv, a, 18);
	int s = md_kv_seq_new(&w.kv);
	if (same_prefix) {
		CHECK_EQ_I(run(&w, s, 0, tok, 21, ref), 21);
		md_kv_truncate(&w.kv, s, 18);
	} else {
		CHECK_EQ_I(run(&w, s, 0, tok, 18, ref), 18);
	}
	CHECK_EQ_I(run(&w, s, 18, tok + 18, 8, ref_tail), 8);
	CHECK_EQ_I(run(&w, c, 18, tok + 18, 8, got), 8);
	CHECK(same_rows(got, ref_tail, 8 * V));

	/* Speculative rollback through the forward pass: draft 4 wrong tokens on c, reject
	 * them, feed the right ones: the same logits as if never drafted. */
	int32_t draft[4] = { 1, 2, 3, 4 };
	CHECK_EQ_I(run(&w, c, 26, draft, 4, got), 4);
	md_kv_truncate(&w.kv, c, 26);
	CHECK_EQ_I(run(&w, s, 26, tok + 26, 4, ref_tail), 4);
	CHECK_EQ_I(run(&w, c, 26, tok + 26, 4, got), 4);
	CHECK(same_rows(got, ref_tail, 4 * V));

	md_forward_free(w.f);
	md_kv_release(&w.kv);
	md_model_free(&w.m);
	free(ref);
	free(got);
	free(ref_tail);
	gen_model_cleanup(dir, path);
}

/* Prefix cache: registered blocks survive their holder, are attached by content, are never
 * written (copied when shared, uncached when the only holder writes), and go when the pool
 * needs them. */
static void test_prefix_cache(void)
{
	struct md_kv_cache kv;
	REQUIRE(CHECK_EQ_I(md_kv_init(&kv, 2, DIM, 8, 4), 0));
	REQUIRE(CHECK_EQ_I(md_kv_prefix_enable(&kv), 0));
	int32_t toks[128], other[128];
	for (int i = 0; i < 128; i++) {
		toks[i] = 1000 + i;
		other[i] = toks[i];
	}
	other[20] = 7; /* differs in the second block */

	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 40), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 40, 1), 0);
	md_kv_prefix_register(&kv, a, toks, 40);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 2); /* two full blocks; the third is partial */
	int32_t b0 = md_kv_seq_block(&kv, a, 0), b1 = md_kv_seq_block(&kv, a, 16);
	md_kv_seq_free(&kv, a);
	check_accounting(&kv);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 8);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 2);

	/* Same tokens: both blocks attach, rows as written; no sequence: nothing attaches. */
	CHECK_EQ_U(md_kv_prefix_attach(&kv, 3, toks, 40), 0);
	int b = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, b, toks, 40), 32);
	CHECK_EQ_U(md_kv_seq_len(&kv, b), 32);
	CHECK_EQ_I(md_kv_seq_block(&kv, b, 0), b0);
	CHECK_EQ_I(md_kv_seq_block(&kv, b, 31), b1);
	CHECK(holds(&kv, b, 0, 32, 1));
	CHECK_EQ_U(md_kv_prefix_attach(&kv, b, toks, 40), 0); /* not empty any more */
	check_accounting(&kv);
	/* Different second block: the first attaches, and the 4 tokens the second shares come
	 * as rows copied into a block of c's own; shorter than a block: copied rows only. */
	int c = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, c, other, 40), 20);
	CHECK_EQ_I(md_kv_block_refs(&kv, b0), 2);
	CHECK(md_kv_seq_block(&kv, c, 16) != b1);
	CHECK(holds(&kv, c, 0, 20, 1));
	int d = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, d, toks, 15), 15);
	CHECK(md_kv_seq_block(&kv, d, 0) != b0 && holds(&kv, d, 0, 15, 1));
	md_kv_seq_free(&kv, d);
	check_accounting(&kv);

	/* c continues at 20 in its own block; b0 stays shared and registered. */
	CHECK_EQ_I(md_kv_reserve(&kv, c, 40), 0);
	CHECK_EQ_I(write_span(&kv, c, 20, 40, 2), 0);
	CHECK(holds(&kv, c, 0, 20, 1) && holds(&kv, c, 20, 40, 2));
	CHECK_EQ_I(md_kv_seq_block(&kv, c, 0), b0);
	md_kv_prefix_register(&kv, c, other, 40);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 3);

	/* b rolls back into the shared first block and rewrites it: a copy, b0 keeps its rows
	 * and its registration for c and later sequences. */
	md_kv_truncate(&kv, b, 8);
	CHECK_EQ_I(md_kv_reserve(&kv, b, 16), 0);
	CHECK_EQ_I(write_span(&kv, b, 8, 16, 3), 0);
	CHECK(md_kv_seq_block(&kv, b, 0) != b0);
	CHECK(holds(&kv, b, 0, 8, 1) && holds(&kv, b, 8, 16, 3));
	CHECK(holds(&kv, c, 0, 16, 1));
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 3);
	/* b1 was dropped by the truncation: unreferenced, still registered. */
	CHECK_EQ_I(md_kv_block_refs(&kv, b1), 0);
	check_accounting(&kv);

	/* c alone holds its registered second block; rolling back into it and writing takes it
	 * out of the cache instead of copying. */
	int32_t c1 = md_kv_seq_block(&kv, c, 16);
	md_kv_truncate(&kv, c, 20);
	CHECK_EQ_I(write_span(&kv, c, 20, 24, 4), 0);
	CHECK_EQ_I(md_kv_seq_block(&kv, c, 16), c1);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 2);
	CHECK(holds(&kv, c, 16, 20, 1) && holds(&kv, c, 20, 24, 4));
	md_kv_seq_free(&kv, b);
	md_kv_seq_free(&kv, c);
	check_accounting(&kv);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 0);

	/* The pool needs every block: the registered ones are reused, oldest released first. */
	int e = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, e, 8 * MD_KV_BLOCK_TOKENS), 0);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 0);
	CHECK_EQ_U(md_kv_prefix_evictions(&kv), 2);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 0);
	md_kv_seq_free(&kv, e);
	int f = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, f, toks, 40), 0);
	check_accounting(&kv);
	md_kv_release(&kv);

	/* Off: attach and register do nothing. */
	REQUIRE(CHECK_EQ_I(md_kv_init(&kv, 1, DIM, 4, 2), 0));
	a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 16), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 16, 1), 0);
	md_kv_prefix_register(&kv, a, toks, 16);
	md_kv_seq_free(&kv, a);
	a = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, a, toks, 16), 0);
	CHECK_EQ_U(md_kv_blocks_free(&kv), 4);
	md_kv_release(&kv);
}

/* A half value of (l, tag, p, i), distinct for the sizes here. */
static uint16_t hval(uint32_t l, int tag, uint32_t p, int i)
{
	return md_f32_to_f16(val(l, tag, p, i) / 4096.0f);
}

/* Rows without V, in half (latent attention): K rows of their own width and element size, no
 * V storage, the same sharing and copy-on-write. */
static void test_k_only(void)
{
	enum { W = 12 };
	const struct md_kv_rows rows = { W, 0, true };
	struct md_kv_cache kv;
	CHECK_EQ_I(md_kv_init_rows(&kv, 2, rows, 6, 2), 0);
	CHECK(kv.v == NULL);
	CHECK_EQ_U(md_kv_token_bytes(2, rows), 2 * W * sizeof(uint16_t));
	const struct md_kv_rows full = { W, W, false };
	CHECK_EQ_U(md_kv_token_bytes(2, full), 4 * W * sizeof(float));
	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 20), 0);
	int32_t sq[20], ps[20];
	for (int t = 0; t < 20; t++)
		sq[t] = a, ps[t] = t;
	CHECK_EQ_I(md_kv_batch_begin(&kv, 20, sq, ps), 0);
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t p = 0; p < 20; p++) {
			uint16_t *k = md_kv_write_k16(&kv, l, a, p);
			for (int i = 0; i < W; i++)
				k[i] = hval(l, 1, p, i);
		}
	CHECK_EQ_I(md_kv_commit(&kv, a, 20), 0);
	/* A fork at 18 writes into the shared tail block: a copy of every layer's rows, a's stay. */
	int b = md_kv_seq_fork(&kv, a, 18);
	CHECK_EQ_I(md_kv_reserve(&kv, b, 19), 0);
	CHECK(md_kv_seq_block(&kv, a, 17) != md_kv_seq_block(&kv, b, 17));
	uint16_t *k = md_kv_write_k16(&kv, 1, b, 18);
	for (int i = 0; i < W; i++)
		k[i] = hval(1, 2, 18, i);
	int ok = 1;
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t p = 0; p < 20; p++)
			for (int i = 0; i < W; i++) {
				ok &= md_kv_k16(&kv, l, a, p)[i] == hval(l, 1, p, i);
				if (p < 18)
					ok &= md_kv_k16(&kv, l, b, p)[i] == hval(l, 1, p, i);
			}
	for (int i = 0; i < W; i++)
		ok &= md_kv_k16(&kv, 1, b, 18)[i] == hval(1, 2, 18, i);
	CHECK(ok);
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* A sequence's last, partial block, registered when it ends, gives its rows to the next
 * sequence with those tokens (copied: it is never shared); evicted like any block. */
static void test_prefix_tail(void)
{
	struct md_kv_cache kv;
	REQUIRE(CHECK_EQ_I(md_kv_init(&kv, 2, DIM, 6, 4), 0));
	REQUIRE(CHECK_EQ_I(md_kv_prefix_enable(&kv), 0));
	int32_t toks[128], other[128];
	for (int i = 0; i < 128; i++)
		toks[i] = other[i] = 500 + i;
	other[18] = 3;

	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, 21), 0);
	CHECK_EQ_I(write_span(&kv, a, 0, 21, 1), 0);
	int32_t at = md_kv_seq_block(&kv, a, 16);
	md_kv_prefix_register_tail(&kv, a, toks, 21);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 2); /* the whole first block and the tail */
	md_kv_seq_free(&kv, a);
	check_accounting(&kv);
	CHECK_EQ_U(md_kv_blocks_used(&kv), 0);

	/* The same 21 tokens and more: 16 shared, 5 copied; the tail itself stays unheld. */
	int b = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, b, toks, 30), 21);
	CHECK(md_kv_seq_block(&kv, b, 16) != at && md_kv_block_refs(&kv, at) == 0);
	CHECK(holds(&kv, b, 0, 21, 1));
	CHECK_EQ_I(md_kv_reserve(&kv, b, 30), 0);
	CHECK_EQ_I(write_span(&kv, b, 21, 30, 2), 0);
	CHECK(holds(&kv, b, 0, 21, 1) && holds(&kv, b, 21, 30, 2));
	/* A repeat that must recompute its last token (attach up to 20 of 21): 20. */
	int c = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, c, toks, 20), 20);
	CHECK(holds(&kv, c, 0, 20, 1));
	/* Tokens that part at 18: two rows of the tail. */
	int d = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, d, other, 30), 18);
	CHECK(holds(&kv, d, 0, 18, 1));
	check_accounting(&kv);
	md_kv_seq_free(&kv, b);
	md_kv_seq_free(&kv, c);
	md_kv_seq_free(&kv, d);
	check_accounting(&kv);

	/* A shared last block (a fork's) is not registered as a tail. */
	int e = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, e, toks, 16), 16);
	int f = md_kv_seq_fork(&kv, e, 16);
	REQUIRE(CHECK(f >= 0));
	md_kv_prefix_register_tail(&kv, e, toks, 16);
	md_kv_seq_free(&kv, f);
	md_kv_seq_free(&kv, e);

	/* The pool needs every block: the tail goes like the others. */
	int g = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, g, 6 * MD_KV_BLOCK_TOKENS), 0);
	CHECK_EQ_U(md_kv_prefix_blocks(&kv), 0);
	md_kv_seq_free(&kv, g);
	int h = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, h, toks, 30), 0);
	check_accounting(&kv);
	md_kv_release(&kv);
}

/* The prefix cache on half rows without V: a finished sequence's partial last block is copied,
 * K rows only, into the next sequence with those tokens. */
static void test_k_only_prefix_tail(void)
{
	enum { W = 12, NT = 21 };
	const struct md_kv_rows rows = { W, 0, true };
	struct md_kv_cache kv;
	REQUIRE(CHECK_EQ_I(md_kv_init_rows(&kv, 2, rows, 6, 2), 0));
	REQUIRE(CHECK_EQ_I(md_kv_prefix_enable(&kv), 0));
	int32_t toks[32], sq[NT], ps[NT];
	for (int i = 0; i < 32; i++)
		toks[i] = 700 + i;
	int a = md_kv_seq_new(&kv);
	CHECK_EQ_I(md_kv_reserve(&kv, a, NT), 0);
	for (int t = 0; t < NT; t++)
		sq[t] = a, ps[t] = t;
	CHECK_EQ_I(md_kv_batch_begin(&kv, NT, sq, ps), 0);
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t p = 0; p < NT; p++) {
			uint16_t *k = md_kv_write_k16(&kv, l, a, p);
			for (int i = 0; i < W; i++)
				k[i] = hval(l, 1, p, i);
		}
	CHECK_EQ_I(md_kv_commit(&kv, a, NT), 0);
	md_kv_prefix_register_tail(&kv, a, toks, NT);
	md_kv_seq_free(&kv, a);
	int b = md_kv_seq_new(&kv);
	CHECK_EQ_U(md_kv_prefix_attach(&kv, b, toks, 30), NT);
	int ok = 1;
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t p = 0; p < NT; p++)
			for (int i = 0; i < W; i++)
				ok &= md_kv_k16(&kv, l, b, p)[i] == hval(l, 1, p, i);
	CHECK(ok);
	check_accounting(&kv);
	md_kv_seq_free(&kv, b);
	check_accounting(&kv);
	md_kv_release(&kv);
}

int main(int argc, char **argv)
{
	if (argc > 1) {
		test_forward_fork(argv[1]);
	} else {
		test_basic();
		test_fork_refcounts();
		test_copy_on_write();
		test_rollback();
		test_exhaustion();
		test_batch_checks();
		test_prefix_cache();
		test_k_only();
		test_prefix_tail();
		test_k_only_prefix_tail();
	}
	if (failures) {
		fprintf(stderr, "kv_cache: %d failures\n", failures);
		return 1;
	}
	printf("kv_cache: ok\n");
	return 0;
}
