/* Routing traces: every MoE layer's expert choices, written as the engine runs, read back by
 * bench/cache-replay and the tests.
 *
 * DESIGN
 * A trace is a text file, one record per (token, MoE layer), so that it can be read with
 * head/grep/awk and diffed; a record is ~40 bytes, ~240 per token of a 6-layer model, which is
 * small next to the time it takes to compute that token. The format (version 2):
 *
 *   # moed routing trace 2
 *   # n_layer 6 n_expert 64 n_used 4
 *   <step> <layer> <seq> <pos> <e_1> .. <e_k> <w_1> .. <w_k>
 *   p <step> <layer> <seq> <pos> <e_1> .. <e_k>
 *
 * Lines starting with '#' are comments; the two above come first and are required. step is
 * the engine step (one forward pass; records of a step are consecutive, layer-major in the
 * order the forward pass ran them), layer the MoE layer index, seq the sequence: the request
 * id in the server, the sequence index in moed-bench, pos the token's position in its
 * sequence, e_1..e_k the experts the router chose in selection order (highest score first),
 * w_1..w_k the weights the layer combines them with: the router's softmax probabilities,
 * renormalised over the k when the model says so (qwen3moe does), printed with 4 decimals.
 * A "p" line is the pre-gating prediction of that token's experts at that layer: layer's
 * router applied to the residual stream leaving the layer before (engine/forward.c
 * prefetch_next, what the store's prefetcher reads ahead), written after the layer before's
 * records and before the records it predicts. Version 1 traces have no "p" lines; the reader
 * takes both.
 *
 * Writing is done on the engine thread: md_route_trace_step names the sequence and position
 * of each batch row before the forward pass, md_route_trace_layer writes the records of one
 * layer from the routing the forward pass reports (md_forward_set_route_cb), and
 * md_route_trace_flush ends the step (one write(2) per step through stdio's buffer, so a
 * trace can be read while the server runs, up to the last whole step).
 */
#ifndef MD_ROUTE_TRACE_H
#define MD_ROUTE_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/router.h"

#define MD_ROUTE_TRACE_MAX_USED 64 /* k the reader accepts */

struct md_route_trace; /* opaque writer */

/* Create (truncate) path and write the header. NULL with err set when it cannot. */
struct md_route_trace *md_route_trace_open(const char *path, uint32_t n_layer, uint32_t n_expert,
					   uint32_t n_used, char *err, size_t errlen);
/* Flush and close; returns 0 or -errno of a failed write (the first one seen). */
int md_route_trace_close(struct md_route_trace *t);

/* Start step number step: row i of the coming batch is token pos[i] of sequence seq[i].
 * Both arrays are borrowed until md_route_trace_flush. */
void md_route_trace_step(struct md_route_trace *t, uint64_t step, uint32_t n_rows,
			 const uint64_t *seq, const int32_t *pos);
/* Write one layer's records (r->n_tokens must not exceed the rows of the step). */
void md_route_trace_layer(struct md_route_trace *t, uint32_t layer, const struct md_routing *r);
/* Write the pre-gating prediction of layer's routing (the "p" lines), rows as for _layer. */
void md_route_trace_pregate(struct md_route_trace *t, uint32_t layer, const struct md_routing *r);
/* End the step: push what was written to the file. */
void md_route_trace_flush(struct md_route_trace *t);

/* ---- reading ---- */

struct md_route_rec {
	uint64_t step, seq;
	uint32_t layer, pos;
	uint64_t first;   /* index of its first expert in md_route_log.experts / weights /
			     pregate */
	bool has_pregate; /* a "p" line predicted it: pregate[first ..] holds its experts */
};

/* A whole trace in memory. */
struct md_route_log {
	uint32_t n_layer, n_expert, n_used;
	uint64_t n_rec;
	struct md_route_rec *rec;  /* owned (n_rec), in file order */
	int32_t *experts;          /* owned (n_rec * n_used) */
	float *weights;            /* owned (n_rec * n_used) */
	int32_t *pregate;          /* owned (n_rec * n_used): predicted experts, -1 where none */
	uint64_t n_pregate;        /* records with a prediction */
};

/* Read a trace. Returns 0, or -EINVAL with err naming the line of a malformed record (a
 * layer or expert out of range, a step going backwards, too few fields; a "p" line whose
 * record does not follow in its step is dropped, as a failed step leaves), -ENOENT/-EACCES
 * when the file cannot be opened, -ENOMEM. log is zeroed on failure. */
int md_route_log_read(struct md_route_log *log, const char *path, char *err, size_t errlen);
void md_route_log_release(struct md_route_log *log);

#endif
