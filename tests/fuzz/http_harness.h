/* Drives the real HTTP server (server/http.c) over a socketpair, for fuzz targets. */
#ifndef MD_FUZZ_HTTP_HARNESS_H
#define MD_FUZZ_HTTP_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "server/http.h"

/* The target's request handler: answer at once, later (md_fz_defer) or by stream. */
typedef void (*md_fz_handler)(struct md_http_conn *c, struct md_http_req *r);

/* One server on one loop for the whole process, limits small enough to be reached by inputs
 * (max_body, max_header). */
void md_fz_init(md_fz_handler h, size_t max_body, size_t max_header);

/* Feed data as a client would: in pieces (split as the input's first byte says), optionally
 * half-closing after the last, then closing; the loop runs between pieces and until the
 * server has closed the connection. Aborts when a server invariant breaks: the connection
 * left open, a request left in flight, output that is not HTTP/1.1 responses. */
void md_fz_run(const uint8_t *data, size_t size);

/* Answer this request on a later loop turn (as a generation does); its abort callback is
 * set by the harness. */
void md_fz_defer(struct md_http_conn *c);

/* Touch every byte of a request so that ASan sees a bad pointer or length. */
void md_fz_touch_req(const struct md_http_req *r);

#endif
