/* Drives the real HTTP server (server/http.c) over a socketpair, for fuzz targets. */
#include "tests/fuzz/http_harness.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/log.h"

static uv_loop_t loop;
static struct md_http_server *srv;
static md_fz_handler handler;
static volatile uint64_t sink;

/* Requests answered later: at most one per connection is in flight, and one connection per
 * input, but keep a small list anyway. */
#define MAX_DEFERRED 8
static struct md_http_conn *deferred[MAX_DEFERRED];
static size_t n_deferred;

static void on_abort(void *data)
{
	for (size_t i = 0; i < n_deferred; i++) {
		if (deferred[i] == data) {
			deferred[i] = deferred[--n_deferred];
			return;
		}
	}
}

void md_fz_defer(struct md_http_conn *c)
{
	if (n_deferred == MAX_DEFERRED)
		abort();
	deferred[n_deferred++] = c;
	md_http_set_handler(c, c, on_abort, NULL, 0);
}

static void answer_deferred(void)
{
	while (n_deferred) {
		struct md_http_conn *c = deferred[--n_deferred];
		md_http_set_handler(c, NULL, NULL, NULL, 0);
		md_http_stream_begin(c, 200, "text/event-stream", "Cache-Control: no-cache\r\n");
		if (md_http_stream_write(c, "data: a\n\n", 9) == 0 &&
		    md_http_stream_write(c, "data: [DONE]\n\n", 14) == 0)
			md_http_stream_end(c);
	}
}

void md_fz_touch_req(const struct md_http_req *r)
{
	uint64_t h = 0;
	for (const char *s = r->method; *s; s++)
		h += (unsigned char)*s;
	for (const char *s = r->path; *s; s++)
		h += (unsigned char)*s;
	for (const char *s = r->query; *s; s++)
		h += (unsigned char)*s;
	if (r->authorization)
		for (const char *s = r->authorization; *s; s++)
			h += (unsigned char)*s;
	if (r->content_type)
		for (const char *s = r->content_type; *s; s++)
			h += (unsigned char)*s;
	for (size_t i = 0; i <= r->body_len; i++)
		h += (unsigned char)r->body[i];
	if (r->body[r->body_len] != 0)
		abort(); /* the body is NUL-terminated for the JSON parser */
	sink += h;
}

static void on_request(void *arg, struct md_http_conn *c, struct md_http_req *r)
{
	md_fz_touch_req(r);
	handler(c, r);
}

void md_fz_init(md_fz_handler h, size_t max_body, size_t max_header)
{
	handler = h;
	md_log_setup(MD_LOG_ERROR, false); /* access lines and warnings would dominate the run */
	uv_loop_init(&loop);
	struct md_http_limits lim = {
		.max_connections = 16,
		.max_body_bytes = max_body,
		.max_header_bytes = max_header,
		.header_timeout = 3600,
		.idle_timeout = 3600,
		.max_backlog = 1 << 20,
		.retry_after = 1,
	};
	if (md_http_server_new(&srv, &loop, &lim, on_request, NULL))
		abort();
}

/* Read what the server sent so far; returns false once the server has closed its end. */
static bool drain_client(int fd, char *out, size_t cap, size_t *len)
{
	for (;;) {
		static char buf[65536]; /* static: ASan poisons large stack frames on every call */
		ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
		if (n > 0) {
			size_t k = (size_t)n;
			if (*len + k > cap)
				k = cap - *len;
			memcpy(out + *len, buf, k);
			*len += k;
			continue;
		}
		if (n == 0)
			return false;
		return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
	}
}

static void turn(int cfd, char *out, size_t cap, size_t *len, bool *open)
{
	uv_run(&loop, UV_RUN_NOWAIT);
	answer_deferred();
	uv_run(&loop, UV_RUN_NOWAIT);
	if (*open)
		*open = drain_client(cfd, out, cap, len);
}

void md_fz_run(const uint8_t *data, size_t size)
{
	if (size == 0)
		return;
	uint8_t mode = data[0];
	data++, size--;
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv))
		abort();
	int cfd = sv[1];
	if (md_http__adopt(srv, sv[0]))
		abort();
	static char out[1 << 20];
	size_t len = 0;
	bool open = true;
	size_t pieces = 1 + (mode & 3), off = 0;
	for (size_t i = 0; i < pieces; i++) {
		size_t n = i + 1 == pieces ? size - off : size / pieces;
		size_t put = 0;
		while (put < n) {
			ssize_t w = send(cfd, data + off + put, n - put, MSG_DONTWAIT | MSG_NOSIGNAL);
			if (w > 0)
				put += (size_t)w;
			else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
				break; /* the server closed: the rest is not read */
			turn(cfd, out, sizeof(out), &len, &open);
			if (!open)
				break;
		}
		off += n;
		turn(cfd, out, sizeof(out), &len, &open);
	}
	if (mode & 4)
		shutdown(cfd, SHUT_WR); /* half-close: answers still due */
	/* Let the server answer what it can: stop once a turn brings nothing new (a keep-alive
	 * connection then waits for a next request that will not come). */
	for (int i = 0, quiet = 0; i < 256 && open && md_http_n_connections(srv) > 0 && quiet < 2;
	     i++) {
		size_t before = len;
		size_t pending = n_deferred;
		turn(cfd, out, sizeof(out), &len, &open);
		quiet = len == before && pending == 0 ? quiet + 1 : 0;
	}
	close(cfd);
	/* the server must notice the client is gone and let go of everything */
	for (int i = 0; i < 1000 && (md_http_n_connections(srv) > 0 || n_deferred); i++)
		turn(cfd, out, sizeof(out), &len, &(bool){ false });
	for (int i = 0; i < 4; i++)
		uv_run(&loop, UV_RUN_NOWAIT); /* close callbacks */
	if (md_http_n_connections(srv) != 0 || md_http_n_busy(srv) != 0 || n_deferred) {
		fprintf(stderr, "http harness: connection left open (%zu, %zu busy)\n",
			md_http_n_connections(srv), md_http_n_busy(srv));
		abort();
	}
	if (getenv("MOED_FUZZ_VERBOSE")) { /* statuses of the responses, for checking seeds */
		for (size_t i = 0; i + 12 <= len; i++)
			if (memcmp(out + i, "HTTP/1.1 ", 9) == 0)
				fprintf(stderr, "%.3s ", out + i + 9);
		fprintf(stderr, "(%zu bytes)\n", len);
	}
	if (len > 0 && (len < 9 || memcmp(out, "HTTP/1.1 ", 9) != 0)) {
		fprintf(stderr, "http harness: output is not an HTTP/1.1 response\n");
		abort();
	}
}
