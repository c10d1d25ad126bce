/* libFuzzer target for the HTTP request path: raw client bytes (pipelined requests, chunked
 * bodies, split at any point, half-closed or not) through llhttp's callbacks into the request
 * object handed to the handler, and the responses back, on the real server over a
 * socketpair. The handler answers at once, by stream, or on a later loop turn, as the path's
 * second byte says, so ordering of pipelined responses and aborts are exercised too. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "tests/fuzz/http_harness.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void handle(struct md_http_conn *c, struct md_http_req *r)
{
	char body[64];
	switch (r->path[0] ? r->path[1] : 0) {
	case 'd':
		md_fz_defer(c);
		return;
	case 's':
		md_http_stream_begin(c, 200, "text/event-stream", NULL);
		if (md_http_stream_write(c, "data: x\n\n", 9) == 0)
			md_http_stream_end(c);
		return;
	default: {
		int n = snprintf(body, sizeof(body), "{\"len\":%zu}", r->body_len);
		md_http_respond(c, 200, "application/json", NULL, body, (size_t)n);
	}
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static int ready;
	if (!ready) {
		md_fz_init(handle, 4096, 2048);
		ready = 1;
	}
	md_fz_run(data, size);
	return 0;
}
