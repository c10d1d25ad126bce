/* Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): a compressed KV cache, attention
 * computed in the latent space.
 *
 * Each token caches one row per layer: its latent c = RMSNorm(W_kv_a x)[0, C) (C =
 * kv_lora_rank) and its rope key k_pe (R = n_rot dims, roped, shared by every head), C + R
 * halves in all (md_model_kv_rows; no V rows). Head h's key and value would be the
 * decompressions W_k_b,h c and W_v_b,h c; instead the query is absorbed into the latent
 * space: q_abs,h = W_k_b,h^T q_nope,h (C wide; attn_k_b stores that transposed product's
 * matrix), so q_h . k_h = [q_abs,h, q_pe,h] . [c, k_pe], one dot of C + R with the cached row;
 * the softmax-weighted sum of the cached latents is turned into head h's value output by W_v_b,h
 * afterwards. The result is the decompressed attention's (with the cached values rounded to
 * half), with the cache 2 (C + R) bytes per token and layer instead of the 4 H (Dn + R + Dv) of
 * float K and V rows: DeepSeek-V3's C = 512, R = 64, H = 128, Dn = Dv = 128 is 1152 bytes
 * against 160 KiB, 1/142.
 *
 * Runs on md_forward's thread; the products and the score loop fan out over its pool. */
#ifndef MD_ATTN_MLA_H
#define MD_ATTN_MLA_H

#include <stddef.h>
#include <stdint.h>

#include "engine/forward.h"
#include "engine/kern/threadpool.h"
#include "engine/kv_cache.h"
#include "engine/model.h"

struct md_mla; /* opaque: scratch buffers for up to max_tokens tokens */

/* Scratch for m (hp.kv_lora_rank > 0) and batches of up to max_tokens tokens on pool (or any
 * pool of its size). NULL on bad sizes or no memory. */
struct md_mla *md_mla_new(const struct md_model *m, const struct md_pool *pool, int max_tokens);
void md_mla_free(struct md_mla *a);

/*
 * The attention sub-layer of layer il for batch b (validated by md_kv_batch_begin): xn (n, N)
 * is the attn-normed input, out (n, N) gets the output projection (before the residual add).
 * Writes each token's cache row, then attends over each token's sequence up to its position.
 * scores: per-thread scratch of at least cap floats per thread (cap > the largest position
 * in the batch), thread i's at scores + i * cap. kv's rows must be md_model_kv_rows'.
 */
void md_mla_attention(struct md_mla *a, struct md_pool *pool, struct md_kv_cache *kv,
		      const struct md_batch *b, uint32_t il, const float *xn, float *out,
		      float *scores, size_t cap);

#endif
