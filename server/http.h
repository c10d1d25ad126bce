/* HTTP/1.1 server on libuv and llhttp: connections, limits, timeouts, responses, streams. */
#ifndef MD_HTTP_H
#define MD_HTTP_H

/*
 * DESIGN
 * Everything here runs on the loop thread. A connection parses one request at a time: when
 * llhttp completes a message the parser is paused and the request is handed to the handler;
 * bytes that arrive meanwhile (pipelined requests) are kept, unparsed, until the response
 * ends, so responses leave in request order. Reading continues while a request is in flight
 * so that a client that goes away is noticed at once: the handler's abort callback runs and
 * the handler must drop every reference to the connection before it returns.
 *
 * One timer per connection serves three purposes by state: the idle timeout between
 * requests, the read timeout while a request head or body is arriving (slow clients get 408),
 * and the handler's tick (stream heartbeats) while a request is in flight. A new connection
 * gets the header timeout, not the idle one, to send its first request.
 *
 * A client that shuts down its sending side after a whole request (half-close) still gets
 * its response: end-of-file with a request in flight does not abort it. A client that went
 * away entirely looks the same at that moment; the next write to it fails and aborts the
 * request then (within a token or a heartbeat for a stream).
 *
 * Connections are capped (max_connections) and cheap while idle (no per-connection read
 * buffer). At the cap a new connection displaces the one idle the longest (an idle list kept
 * in order by every state change); when none is idle it is answered 503 with Retry-After and
 * closed, so that clients and proxies see a status rather than a reset.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

struct md_http_server; /* opaque */
struct md_http_conn;   /* opaque */

/* One parsed request; valid until md_http_end (or the abort callback). */
struct md_http_req {
	uint64_t id;            /* per-process request number, for logs */
	const char *method;     /* "GET", "POST", ... */
	const char *path;       /* borrowed: URL path without the query */
	const char *query;      /* borrowed: after '?', or "" */
	const char *authorization; /* borrowed: header value or NULL */
	const char *content_type;  /* borrowed: header value or NULL */
	const char *body;       /* borrowed: NUL-terminated (not counted in body_len) */
	size_t body_len;
	double t_start;         /* monotonic seconds when the first byte arrived */
};

struct md_http_limits {
	size_t max_connections;
	size_t max_body_bytes;
	size_t max_header_bytes;
	double header_timeout;  /* seconds */
	double idle_timeout;
	size_t max_backlog;     /* unsent bytes before a stream is aborted */
	unsigned retry_after;   /* seconds, in the 503 a connection over the cap gets */
};

/* Handles one request. The handler answers later or at once with md_http_respond or a
 * stream; it may stash a pointer with md_http_set_handler. */
typedef void (*md_http_request_cb)(void *arg, struct md_http_conn *c, struct md_http_req *r);
/* The connection went away (or a stream overflowed) while the handler held a request. */
typedef void (*md_http_abort_cb)(void *handler_data);
/* Periodic tick while a request is in flight (every tick_interval seconds). */
typedef void (*md_http_tick_cb)(void *handler_data);

int md_http_server_new(struct md_http_server **out, uv_loop_t *loop,
		       const struct md_http_limits *lim, md_http_request_cb cb, void *arg);
/* Bind and listen. Returns 0 or a negative libuv code; *port_out gets the bound port. */
int md_http_listen(struct md_http_server *s, const char *host, int port, int *port_out);
/* Serve on a listening socket handed over by the service manager (socket activation). The
 * server owns fd from then on. Returns 0 or a negative libuv code; *port_out as above. */
int md_http_listen_fd(struct md_http_server *s, int fd, int *port_out);
/* Stop accepting; idle connections are closed, busy ones close after their response. */
void md_http_stop_accepting(struct md_http_server *s);
/* Close every connection now (aborting in-flight requests) and the listener. Run the loop
 * until it has no handles left, then md_http_server_free. */
void md_http_server_close(struct md_http_server *s);
void md_http_server_free(struct md_http_server *s);
size_t md_http_n_connections(const struct md_http_server *s);
size_t md_http_n_busy(const struct md_http_server *s);
/* Connections closed to make room at the cap, and connections refused (503) for want of one. */
uint64_t md_http_n_evicted(const struct md_http_server *s);
uint64_t md_http_n_refused(const struct md_http_server *s);
/* Raise the soft RLIMIT_NOFILE to the hard limit (start-up; each connection is a descriptor).
 * Returns the soft limit now in force. */
size_t md_http_raise_fd_limit(void);
/* Connections with a request in flight or a response still being written and shut down
 * (each of the latter closes within 5 s). */
size_t md_http_n_unflushed(const struct md_http_server *s);

void md_http_set_handler(struct md_http_conn *c, void *data, md_http_abort_cb abort_cb,
			 md_http_tick_cb tick_cb, double tick_interval);

/* A complete response. extra_headers: "Name: value\r\n" lines or NULL. The request ends. */
void md_http_respond(struct md_http_conn *c, int status, const char *content_type,
		     const char *extra_headers, const char *body, size_t len);

/* Streams (chunked transfer encoding): begin, write pieces, end. write returns 0, or -ENOBUFS
 * when the client's backlog exceeds the limit (the connection is then aborted: the abort
 * callback has run when this returns). */
void md_http_stream_begin(struct md_http_conn *c, int status, const char *content_type,
			  const char *extra_headers);
int md_http_stream_write(struct md_http_conn *c, const char *data, size_t len);
void md_http_stream_end(struct md_http_conn *c);

/* Status of the response in progress (for the access log). */
int md_http_status(const struct md_http_conn *c);
double md_http_now(void); /* monotonic seconds */
const char *md_http_reason(int status);

/* For tests and fuzzing: serve an already connected stream socket (e.g. one end of a
 * socketpair) as if it had been accepted; the server owns fd from then on. Bypasses the
 * connection cap. Returns 0 or a negative libuv code (fd is closed either way). */
int md_http__adopt(struct md_http_server *s, int fd);

#endif
