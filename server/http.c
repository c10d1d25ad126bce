/* HTTP/1.1 server on libuv and llhttp: connections, limits, timeouts, responses, streams. */
#include "server/http.h"

#include <errno.h>
#include <llhttp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

enum conn_state {
	C_IDLE,     /* between requests */
	C_READING,  /* a request head/body is arriving */
	C_BUSY,     /* the handler holds the request */
	C_SHUTDOWN, /* response sent, write side shutting down */
	C_CLOSING,  /* uv_close called */
};

struct md_http_server {
	uv_loop_t *loop;             /* borrowed */
	uv_tcp_t listener;
	bool listening;
	bool draining;
	struct md_http_limits lim;
	md_http_request_cb cb;
	void *cb_arg;                /* borrowed */
	llhttp_settings_t settings;
	struct md_http_conn *conns;  /* owned: doubly linked list of open connections */
	/* borrowed (members of conns): connections in C_IDLE, longest idle first */
	struct md_http_conn *idle_head, *idle_tail;
	size_t n_conns, n_busy;
	struct refusal *refusals;    /* owned: over-cap connections being answered 503 */
	size_t n_refusing;
	uint64_t n_evicted, n_refused;
	double last_refuse_log;
	uint64_t next_req_id;
	/* One read buffer for every connection: libuv calls alloc and read back to back on this
	 * thread, and on_read copies what arrived into the connection's pending buffer, so no
	 * connection needs its own (64 KiB per idle connection would cap thousands of them). */
	char rbuf[65536];
};

struct md_http_conn {
	uv_tcp_t tcp;
	uv_timer_t timer;
	uv_shutdown_t shutdown_req;
	int open_handles;            /* freed when both handles have closed */
	struct md_http_server *srv;  /* borrowed */
	struct md_http_conn *prev, *next;
	struct md_http_conn *idle_prev, *idle_next; /* borrowed: the server's idle list */
	bool in_idle;                /* on the idle list */
	bool peer_eof;               /* the client shut down its side (no more requests) */
	uint64_t n_requests;         /* requests dispatched on this connection */
	llhttp_t parser;
	enum conn_state state;
	bool keep_alive;             /* of the request in progress */
	bool close_after;            /* close once the response is written */
	bool linger;                 /* answered before its request was read in full: after our
	                              * FIN, read and drop until the client closes (or 5 s) */
	bool chunked;                /* stream uses chunked encoding */
	bool in_pump;
	bool expect_continue;
	bool in_value;               /* last header callback was a value */
	int status;                  /* status of the response in progress */
	int err_status;              /* set by a parser callback that hit a limit */
	size_t head_bytes;

	char *url;                   /* owned: request target (head_cap bounded) */
	size_t url_len;
	char field[64];              /* current header name (longer names are not ours) */
	size_t field_len;
	char *value;                 /* owned: current header value */
	size_t value_len, value_cap;
	char *authorization;         /* owned */
	char *content_type;          /* owned */
	char *body;                  /* owned: (body_cap) */
	size_t body_len, body_cap;
	char *pending;               /* owned: received bytes not yet parsed */
	size_t pending_len, pending_cap;

	struct md_http_req req;
	char method[16];
	void *hdata;                 /* borrowed: the handler's request state */
	md_http_abort_cb abort_cb;
	md_http_tick_cb tick_cb;
	double tick_interval;
};

struct wreq {
	uv_write_t w;
	struct md_http_conn *c;      /* borrowed: valid until the write callback */
	size_t len;
	char data[];
};

static void conn_close(struct md_http_conn *c);
static void conn_pump(struct md_http_conn *c);

/* Every state change goes through here: it keeps the idle list (C_IDLE connections, longest
 * idle first) in step, so the connection to give up at the cap is found in O(1). */
static void set_state(struct md_http_conn *c, enum conn_state st)
{
	struct md_http_server *s = c->srv;
	if (c->in_idle && st != C_IDLE) {
		if (c->idle_prev)
			c->idle_prev->idle_next = c->idle_next;
		else
			s->idle_head = c->idle_next;
		if (c->idle_next)
			c->idle_next->idle_prev = c->idle_prev;
		else
			s->idle_tail = c->idle_prev;
		c->idle_prev = c->idle_next = NULL;
		c->in_idle = false;
	} else if (!c->in_idle && st == C_IDLE) {
		c->idle_prev = s->idle_tail;
		c->idle_next = NULL;
		if (s->idle_tail)
			s->idle_tail->idle_next = c;
		else
			s->idle_head = c;
		s->idle_tail = c;
		c->in_idle = true;
	}
	c->state = st;
}

double md_http_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

const char *md_http_reason(int status)
{
	switch (status) {
	case 100: return "Continue";
	case 200: return "OK";
	case 204: return "No Content";
	case 400: return "Bad Request";
	case 401: return "Unauthorized";
	case 403: return "Forbidden";
	case 404: return "Not Found";
	case 405: return "Method Not Allowed";
	case 408: return "Request Timeout";
	case 411: return "Length Required";
	case 413: return "Payload Too Large";
	case 415: return "Unsupported Media Type";
	case 422: return "Unprocessable Entity";
	case 429: return "Too Many Requests";
	case 431: return "Request Header Fields Too Large";
	case 500: return "Internal Server Error";
	case 501: return "Not Implemented";
	case 503: return "Service Unavailable";
	case 505: return "HTTP Version Not Supported";
	default: return "Unknown";
	}
}

static struct md_http_conn *conn_of(llhttp_t *p)
{
	return (struct md_http_conn *)p->data;
}

/* Grow *buf to hold need bytes plus a NUL, never past limit. */
static int grow(char **buf, size_t *cap, size_t need, size_t limit)
{
	if (need + 1 <= *cap)
		return 0;
	if (need > limit)
		return -E2BIG;
	size_t nc = *cap ? *cap : 256;
	while (nc < need + 1)
		nc *= 2;
	if (nc > limit + 1)
		nc = limit + 1;
	char *nb = realloc(*buf, nc);
	if (!nb)
		return -ENOMEM;
	*buf = nb;
	*cap = nc;
	return 0;
}

static int count_head(struct md_http_conn *c, size_t n)
{
	c->head_bytes += n;
	if (c->head_bytes > c->srv->lim.max_header_bytes) {
		c->err_status = 431;
		return -1;
	}
	return 0;
}

static int on_message_begin(llhttp_t *p)
{
	struct md_http_conn *c = conn_of(p);
	c->url_len = 0;
	c->field_len = 0;
	c->value_len = 0;
	c->body_len = 0;
	c->head_bytes = 0;
	c->in_value = false;
	c->expect_continue = false;
	free(c->authorization);
	free(c->content_type);
	c->authorization = c->content_type = NULL;
	return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t len)
{
	struct md_http_conn *c = conn_of(p);
	if (count_head(c, len))
		return -1;
	char *nu = realloc(c->url, c->url_len + len + 1); /* bounded by the head limit */
	if (!nu) {
		c->err_status = 500;
		return -1;
	}
	c->url = nu;
	memcpy(c->url + c->url_len, at, len);
	c->url_len += len;
	c->url[c->url_len] = 0;
	return 0;
}

static void header_done(struct md_http_conn *c)
{
	if (!c->in_value && c->field_len == 0)
		return;
	c->value[c->value_len] = 0;
	if (strcasecmp(c->field, "authorization") == 0) {
		free(c->authorization);
		c->authorization = strdup(c->value);
	} else if (strcasecmp(c->field, "content-type") == 0) {
		free(c->content_type);
		c->content_type = strdup(c->value);
	} else if (strcasecmp(c->field, "expect") == 0) {
		c->expect_continue = strcasecmp(c->value, "100-continue") == 0;
	}
	c->field_len = 0;
	c->value_len = 0;
	c->in_value = false;
}

static int on_header_field(llhttp_t *p, const char *at, size_t len)
{
	struct md_http_conn *c = conn_of(p);
	if (count_head(c, len))
		return -1;
	if (c->in_value)
		header_done(c);
	size_t n = len;
	if (c->field_len + n > sizeof(c->field) - 1)
		n = sizeof(c->field) - 1 - c->field_len; /* long names are never ours: truncate */
	memcpy(c->field + c->field_len, at, n);
	c->field_len += n;
	c->field[c->field_len] = 0;
	return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t len)
{
	struct md_http_conn *c = conn_of(p);
	if (count_head(c, len))
		return -1;
	c->in_value = true;
	if (grow(&c->value, &c->value_cap, c->value_len + len, c->srv->lim.max_header_bytes)) {
		c->err_status = 431;
		return -1;
	}
	memcpy(c->value + c->value_len, at, len);
	c->value_len += len;
	c->value[c->value_len] = 0;
	return 0;
}

static int conn_write2(struct md_http_conn *c, const char *a, size_t alen, const char *b,
		       size_t blen, const char *z, size_t zlen);

static int on_headers_complete(llhttp_t *p)
{
	struct md_http_conn *c = conn_of(p);
	if (c->in_value)
		header_done(c);
	if ((p->flags & F_CONTENT_LENGTH) && p->content_length > c->srv->lim.max_body_bytes) {
		c->err_status = 413;
		return -1;
	}
	if (c->expect_continue) {
		static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
		conn_write2(c, cont, sizeof(cont) - 1, NULL, 0, NULL, 0);
	}
	return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len)
{
	struct md_http_conn *c = conn_of(p);
	int rc = grow(&c->body, &c->body_cap, c->body_len + len, c->srv->lim.max_body_bytes);
	if (rc) {
		c->err_status = rc == -E2BIG ? 413 : 500;
		return -1;
	}
	memcpy(c->body + c->body_len, at, len);
	c->body_len += len;
	return 0;
}

static int on_message_complete(llhttp_t *p)
{
	struct md_http_conn *c = conn_of(p);
	c->keep_alive = llhttp_should_keep_alive(p);
	/* Hand the request over only after llhttp_execute returns: pause here. */
	return HPE_PAUSED;
}

static void on_timer(uv_timer_t *t);

static void timer_arm(struct md_http_conn *c, double seconds, bool repeat)
{
	uint64_t ms = (uint64_t)(seconds * 1000.0 + 0.5);
	if (ms == 0)
		ms = 1;
	uv_timer_start(&c->timer, on_timer, ms, repeat ? ms : 0);
}

static void on_conn_closed(uv_handle_t *h)
{
	struct md_http_conn *c = h->data;
	if (--c->open_handles > 0)
		return;
	free(c->url);
	free(c->value);
	free(c->authorization);
	free(c->content_type);
	free(c->body);
	free(c->pending);
	free(c);
}

static void conn_close(struct md_http_conn *c)
{
	if (c->state == C_CLOSING)
		return;
	struct md_http_server *s = c->srv;
	if (c->state == C_BUSY) {
		s->n_busy--;
		md_http_abort_cb ab = c->abort_cb;
		void *hd = c->hdata;
		c->hdata = NULL;
		c->abort_cb = NULL;
		c->tick_cb = NULL;
		set_state(c, C_CLOSING);
		if (ab)
			ab(hd);
	}
	set_state(c, C_CLOSING);
	if (c->prev)
		c->prev->next = c->next;
	else
		s->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	s->n_conns--;
	uv_timer_stop(&c->timer);
	uv_close((uv_handle_t *)&c->timer, on_conn_closed);
	uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void on_write(uv_write_t *w, int status)
{
	struct wreq *r = (struct wreq *)w;
	struct md_http_conn *c = r->c;
	if (status < 0 && status != UV_ECANCELED && c->state != C_CLOSING) {
		md_log(MD_LOG_DEBUG, "write failed: %s", uv_strerror(status));
		conn_close(c);
	}
	free(r);
}

/* Queue up to three pieces as one write. Returns 0 or a negative code (connection closed). */
static int conn_write2(struct md_http_conn *c, const char *a, size_t alen, const char *b,
		       size_t blen, const char *z, size_t zlen)
{
	if (c->state == C_CLOSING)
		return -EPIPE;
	struct wreq *r = malloc(sizeof(*r) + alen + blen + zlen);
	if (!r) {
		conn_close(c);
		return -ENOMEM;
	}
	r->c = c;
	r->len = alen + blen + zlen;
	if (alen)
		memcpy(r->data, a, alen);
	if (blen)
		memcpy(r->data + alen, b, blen);
	if (zlen)
		memcpy(r->data + alen + blen, z, zlen);
	uv_buf_t buf = uv_buf_init(r->data, (unsigned)r->len);
	int rc = uv_write(&r->w, (uv_stream_t *)&c->tcp, &buf, 1, on_write);
	if (rc) {
		free(r);
		conn_close(c);
		return rc;
	}
	return 0;
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
	struct md_http_conn *c = req->data;
	/* Closing with unread input sends a reset, which can destroy the response before the
	 * client reads it (a 413 while its body is still arriving): linger, reading, until its
	 * FIN (on_read) or the timer conn_shutdown armed. */
	if (c->linger && !c->peer_eof && status == 0)
		return;
	conn_close(c);
}

/* Send our FIN once the queued writes are out, then close (within 5 s at most). */
static void conn_shutdown(struct md_http_conn *c)
{
	set_state(c, C_SHUTDOWN);
	c->shutdown_req.data = c;
	timer_arm(c, 5.0, false);
	if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, on_shutdown))
		conn_close(c);
}

/* Buffers sized by one large request are not kept by a connection that then sits idle. */
static void trim_buffers(struct md_http_conn *c)
{
	if (c->body_cap > 65536) {
		free(c->body);
		c->body = NULL;
		c->body_cap = 0;
	}
	if (c->pending_len == 0 && c->pending_cap > 65536) {
		free(c->pending);
		c->pending = NULL;
		c->pending_cap = 0;
	}
}

/* After the last byte of a response: close, or go back to idle and parse what is buffered.
 * A client that shut down its side after sending (peer_eof) gets the answers to what it sent,
 * then our FIN. */
static void finish_request(struct md_http_conn *c)
{
	if (c->state == C_CLOSING)
		return;
	if (c->state == C_BUSY)
		c->srv->n_busy--;
	c->hdata = NULL;
	c->abort_cb = NULL;
	c->tick_cb = NULL;
	if (c->close_after || !c->keep_alive || c->srv->draining ||
	    (c->peer_eof && c->pending_len == 0)) {
		conn_shutdown(c);
		return;
	}
	trim_buffers(c);
	set_state(c, C_IDLE);
	llhttp_resume(&c->parser);
	timer_arm(c, c->srv->lim.idle_timeout, false);
	if (!c->in_pump)
		conn_pump(c);
}

static void write_head(struct md_http_conn *c, int status, const char *content_type,
		       const char *extra, const char *body, size_t len, bool stream)
{
	char head[1024];
	int n;
	c->status = status;
	if (c->srv->draining)
		c->close_after = true;
	bool ka = c->keep_alive && !c->close_after;
	if (stream) {
		c->chunked = llhttp_get_http_minor(&c->parser) >= 1;
		if (!c->chunked)
			c->close_after = true, ka = false;
		n = snprintf(head, sizeof(head), "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s%s",
			     status, md_http_reason(status), content_type,
			     c->chunked ? "Transfer-Encoding: chunked\r\n" : "",
			     ka ? "" : "Connection: close\r\n");
	} else {
		n = snprintf(head, sizeof(head),
			     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s", status,
			     md_http_reason(status), content_type, len,
			     ka ? "" : "Connection: close\r\n");
	}
	if (n < 0 || (size_t)n >= sizeof(head))
		n = 0;
	/* extra headers and the blank line go in the middle piece */
	size_t el = extra ? strlen(extra) : 0;
	char *mid = malloc(el + 3);
	if (!mid) {
		conn_close(c);
		return;
	}
	if (el)
		memcpy(mid, extra, el);
	memcpy(mid + el, "\r\n", 3);
	if (conn_write2(c, head, (size_t)n, mid, el + 2, body, stream ? 0 : len) == 0)
		(void)0;
	free(mid);
}

void md_http_respond(struct md_http_conn *c, int status, const char *content_type,
		     const char *extra_headers, const char *body, size_t len)
{
	if (c->state == C_CLOSING)
		return;
	write_head(c, status, content_type, extra_headers, body, len, false);
	finish_request(c);
}

void md_http_stream_begin(struct md_http_conn *c, int status, const char *content_type,
			  const char *extra_headers)
{
	if (c->state == C_CLOSING)
		return;
	write_head(c, status, content_type, extra_headers, NULL, 0, true);
}

int md_http_stream_write(struct md_http_conn *c, const char *data, size_t len)
{
	if (c->state == C_CLOSING)
		return -EPIPE;
	if (len == 0)
		return 0;
	int rc;
	if (c->chunked) {
		char pre[24];
		int n = snprintf(pre, sizeof(pre), "%zx\r\n", len);
		rc = conn_write2(c, pre, (size_t)n, data, len, "\r\n", 2);
	} else {
		rc = conn_write2(c, data, len, NULL, 0, NULL, 0);
	}
	if (rc)
		return rc;
	if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > c->srv->lim.max_backlog) {
		md_log(MD_LOG_WARN, "req=%llu client too slow: %zu bytes unsent, closing",
		       (unsigned long long)c->req.id,
		       uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp));
		conn_close(c);
		return -ENOBUFS;
	}
	return 0;
}

void md_http_stream_end(struct md_http_conn *c)
{
	if (c->state == C_CLOSING)
		return;
	if (c->chunked)
		conn_write2(c, "0\r\n\r\n", 5, NULL, 0, NULL, 0);
	finish_request(c);
}

int md_http_status(const struct md_http_conn *c)
{
	return c->status;
}

void md_http_set_handler(struct md_http_conn *c, void *data, md_http_abort_cb abort_cb,
			 md_http_tick_cb tick_cb, double tick_interval)
{
	c->hdata = data;
	c->abort_cb = abort_cb;
	c->tick_cb = tick_cb;
	c->tick_interval = tick_interval;
	if (c->state == C_BUSY) {
		if (tick_cb)
			timer_arm(c, tick_interval, true);
		else
			uv_timer_stop(&c->timer);
	}
}

/* Answer a request the parser rejected (or that timed out), then close. */
static void reject(struct md_http_conn *c, int status, const char *msg)
{
	char body[512];
	const char *type = status >= 500 ? "server_error" : "invalid_request_error";
	int n = snprintf(body, sizeof(body),
			 "{\"error\":{\"message\":\"%s\",\"type\":\"%s\",\"param\":null,\"code\":%d}}",
			 msg, type, status);
	c->close_after = true;
	c->keep_alive = false;
	c->linger = c->state == C_READING;
	if (c->state != C_BUSY) {
		set_state(c, C_BUSY);
		c->srv->n_busy++;
	}
	md_log_access("-", c->url ? c->url : "-", status, (unsigned long)c->req.id, 0, 0, 0,
		      md_http_now() - c->req.t_start);
	md_http_respond(c, status, "application/json", NULL, body, (size_t)n);
}

static void dispatch(struct md_http_conn *c)
{
	struct md_http_server *s = c->srv;
	llhttp_t *p = &c->parser;
	snprintf(c->method, sizeof(c->method), "%s", llhttp_method_name((llhttp_method_t)p->method));
	if (!c->url) {
		reject(c, 400, "empty request target");
		return;
	}
	c->req.method = c->method;
	char *q = strchr(c->url, '?');
	if (q) {
		*q = 0;
		c->req.query = q + 1;
	} else {
		c->req.query = "";
	}
	c->req.path = c->url;
	c->req.authorization = c->authorization;
	c->req.content_type = c->content_type;
	if (grow(&c->body, &c->body_cap, c->body_len, s->lim.max_body_bytes + 1)) {
		reject(c, 500, "out of memory");
		return;
	}
	c->body[c->body_len] = 0;
	c->req.body = c->body;
	c->req.body_len = c->body_len;
	c->status = 0;
	c->n_requests++;
	set_state(c, C_BUSY);
	s->n_busy++;
	uv_timer_stop(&c->timer);
	s->cb(s->cb_arg, c, &c->req);
}

/* Parse buffered input until a request is dispatched, more bytes are needed, or an error. */
static void conn_pump(struct md_http_conn *c)
{
	c->in_pump = true;
	while ((c->state == C_IDLE || c->state == C_READING) && c->pending_len > 0) {
		if (c->state == C_IDLE) {
			set_state(c, C_READING);
			c->req.id = ++c->srv->next_req_id;
			c->req.t_start = md_http_now();
			c->err_status = 0;
			c->close_after = false;
			c->linger = false;
			timer_arm(c, c->srv->lim.header_timeout, false);
		}
		llhttp_errno_t err = llhttp_execute(&c->parser, c->pending, c->pending_len);
		if (err == HPE_OK) {
			c->pending_len = 0;
			break;
		}
		if (err == HPE_PAUSED) {
			size_t used = (size_t)(llhttp_get_error_pos(&c->parser) - c->pending);
			memmove(c->pending, c->pending + used, c->pending_len - used);
			c->pending_len -= used;
			dispatch(c);
			continue;
		}
		c->pending_len = 0;
		if (c->err_status == 431)
			reject(c, 431, "request head too large");
		else if (c->err_status == 413)
			reject(c, 413, "request body too large");
		else if (c->err_status)
			reject(c, c->err_status, "internal error");
		else {
			char msg[200];
			const char *reason = llhttp_get_error_reason(&c->parser);
			snprintf(msg, sizeof(msg), "malformed HTTP request: %s", reason ? reason : "");
			for (char *m = msg; *m; m++)
				if (*m == '"' || *m == '\\' || (unsigned char)*m < 0x20)
					*m = ' ';
			reject(c, 400, msg);
		}
		break;
	}
	c->in_pump = false;
	if (c->peer_eof && c->state == C_IDLE)
		conn_shutdown(c); /* everything it sent has been answered */
	else if (c->peer_eof && c->state == C_READING)
		conn_close(c);    /* a request cut short: nothing will complete it */
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct md_http_conn *c = h->data;
	*buf = uv_buf_init(c->srv->rbuf, sizeof(c->srv->rbuf));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
	struct md_http_conn *c = st->data;
	if (nread == 0)
		return;
	if (nread == UV_EOF && c->state == C_BUSY) {
		/* The client shut down its side with a request in flight: either a half-close
		 * (it still reads: answer it) or a client that went away, which the next write
		 * finds out (the peer answers it with a reset, the write after fails, and the
		 * abort callback runs). TCP cannot tell the two apart here. */
		c->peer_eof = true;
		uv_read_stop(st);
		return;
	}
	if (nread < 0) {
		conn_close(c);
		return;
	}
	if (c->state == C_SHUTDOWN || c->state == C_CLOSING)
		return;
	if (c->linger)
		return; /* the rest of a request already answered: dropped */
	size_t limit = c->srv->lim.max_body_bytes + c->srv->lim.max_header_bytes + 65536;
	if (grow(&c->pending, &c->pending_cap, c->pending_len + (size_t)nread, limit)) {
		md_log(MD_LOG_WARN, "req=%llu too much pipelined input, closing",
		       (unsigned long long)c->req.id);
		conn_close(c);
		return;
	}
	memcpy(c->pending + c->pending_len, buf->base, (size_t)nread);
	c->pending_len += (size_t)nread;
	if (c->state != C_BUSY)
		conn_pump(c);
}

static void on_timer(uv_timer_t *t)
{
	struct md_http_conn *c = t->data;
	switch (c->state) {
	case C_IDLE:
		conn_close(c);
		break;
	case C_READING:
		md_log(MD_LOG_INFO, "req=%llu request not received within %.1fs",
		       (unsigned long long)c->req.id, c->srv->lim.header_timeout);
		reject(c, 408, "request not received in time");
		break;
	case C_BUSY:
		if (c->tick_cb)
			c->tick_cb(c->hdata);
		break;
	case C_SHUTDOWN:
		conn_close(c);
		break;
	case C_CLOSING:
		break;
	}
}

/*
 * A connection over the cap, when no idle one can make room, is answered rather than reset:
 * "503 Service Unavailable" with Retry-After, written at once without reading the request,
 * then our FIN. What the client sends meanwhile is read and dropped until it closes (or for
 * REFUSE_LINGER_MS at most): closing with unread bytes would send a reset that can destroy
 * the 503 before the client reads it. At most MAX_REFUSING such connections linger; beyond
 * that a client is closed without a word, as before.
 */
#define REFUSE_LINGER_MS 1000
#define MAX_REFUSING 256

struct refusal {
	uv_tcp_t tcp;
	uv_timer_t timer;
	uv_write_t w;
	uv_shutdown_t sd;
	int open_handles;            /* freed when both handles have closed */
	struct md_http_server *srv;  /* borrowed */
	struct refusal *prev, *next; /* the server's list */
	char data[512];              /* the response */
};

static void on_refusal_closed(uv_handle_t *h)
{
	struct refusal *r = h->data;
	if (--r->open_handles == 0)
		free(r);
}

static void refusal_close(struct refusal *r)
{
	if (uv_is_closing((uv_handle_t *)&r->tcp))
		return;
	struct md_http_server *s = r->srv;
	if (r->prev)
		r->prev->next = r->next;
	else
		s->refusals = r->next;
	if (r->next)
		r->next->prev = r->prev;
	s->n_refusing--;
	uv_close((uv_handle_t *)&r->timer, on_refusal_closed);
	uv_close((uv_handle_t *)&r->tcp, on_refusal_closed);
}

static void on_refusal_timer(uv_timer_t *t)
{
	refusal_close(t->data);
}

static void on_refusal_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct refusal *r = h->data;
	*buf = uv_buf_init(r->srv->rbuf, sizeof(r->srv->rbuf));
}

static void on_refusal_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
	if (nread < 0)
		refusal_close(st->data);
}

static void on_refusal_shutdown(uv_shutdown_t *req, int status)
{
}

static void on_refusal_written(uv_write_t *w, int status)
{
	struct refusal *r = w->data;
	if (status < 0) {
		if (status != UV_ECANCELED)
			refusal_close(r);
		return;
	}
	r->sd.data = r;
	if (uv_shutdown(&r->sd, (uv_stream_t *)&r->tcp, on_refusal_shutdown))
		refusal_close(r);
}

static void on_plain_closed(uv_handle_t *h)
{
	free(h);
}

/* Accept a connection only to answer it 503 (or, past MAX_REFUSING, to close it). */
static void refuse(struct md_http_server *s, uv_stream_t *ls, const char *why)
{
	s->n_refused++;
	double now = md_http_now();
	if (now - s->last_refuse_log >= 1.0) {
		md_log(MD_LOG_WARN, "%s: refusing client(s) with 503 (%llu so far)", why,
		       (unsigned long long)s->n_refused);
		s->last_refuse_log = now;
	}
	struct refusal *r = s->n_refusing < MAX_REFUSING ? calloc(1, sizeof(*r)) : NULL;
	if (!r) {
		uv_tcp_t *t = malloc(sizeof(*t));
		if (!t)
			return;
		uv_tcp_init(s->loop, t);
		uv_accept(ls, (uv_stream_t *)t);
		uv_close((uv_handle_t *)t, on_plain_closed);
		return;
	}
	r->srv = s;
	uv_tcp_init(s->loop, &r->tcp);
	uv_timer_init(s->loop, &r->timer);
	r->tcp.data = r->timer.data = r->w.data = r;
	r->open_handles = 2;
	r->next = s->refusals;
	if (s->refusals)
		s->refusals->prev = r;
	s->refusals = r;
	s->n_refusing++;
	if (uv_accept(ls, (uv_stream_t *)&r->tcp)) {
		refusal_close(r);
		return;
	}
	static const char body[] = "{\"error\":{\"message\":\"server at its connection limit, "
				   "retry later\",\"type\":\"server_error\",\"param\":null,"
				   "\"code\":503}}";
	int n = snprintf(r->data, sizeof(r->data),
			 "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
			 "Content-Length: %zu\r\nRetry-After: %u\r\nConnection: close\r\n\r\n%s",
			 sizeof(body) - 1, s->lim.retry_after, body);
	uv_buf_t b = uv_buf_init(r->data, (unsigned)n);
	if (uv_write(&r->w, (uv_stream_t *)&r->tcp, &b, 1, on_refusal_written) ||
	    uv_read_start((uv_stream_t *)&r->tcp, on_refusal_alloc, on_refusal_read)) {
		refusal_close(r);
		return;
	}
	uv_timer_start(&r->timer, on_refusal_timer, REFUSE_LINGER_MS, 0);
}

static void conn_start(struct md_http_conn *c);

static void on_connection(uv_stream_t *ls, int status)
{
	struct md_http_server *s = ls->data;
	if (status < 0) {
		md_log(MD_LOG_WARN, "accept failed: %s", uv_strerror(status));
		return;
	}
	if (s->draining) {
		refuse(s, ls, "draining");
		return;
	}
	if (s->n_conns >= s->lim.max_connections) {
		/* Make room by closing the connection idle the longest (a keep-alive client
		 * reconnects; one that never sent a request loses nothing). */
		if (!s->idle_head) {
			refuse(s, ls, "connection limit reached, none idle");
			return;
		}
		s->n_evicted++;
		md_log(MD_LOG_DEBUG, "connection limit (%zu) reached: closing the longest idle one",
		       s->lim.max_connections);
		conn_close(s->idle_head);
	}
	struct md_http_conn *c = calloc(1, sizeof(*c));
	if (!c) {
		refuse(s, ls, "out of memory");
		return;
	}
	c->srv = s;
	uv_tcp_init(s->loop, &c->tcp);
	uv_timer_init(s->loop, &c->timer);
	c->open_handles = 2;
	c->tcp.data = c;
	c->timer.data = c;
	if (uv_accept(ls, (uv_stream_t *)&c->tcp)) {
		set_state(c, C_CLOSING);
		uv_close((uv_handle_t *)&c->timer, on_conn_closed);
		uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
		return;
	}
	conn_start(c);
}

/* A connected, accepted socket becomes an idle connection, reading. */
static void conn_start(struct md_http_conn *c)
{
	struct md_http_server *s = c->srv;
	uv_tcp_nodelay(&c->tcp, 1);
	llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
	c->parser.data = c;
	set_state(c, C_IDLE);
	c->next = s->conns;
	if (s->conns)
		s->conns->prev = c;
	s->conns = c;
	s->n_conns++;
	/* A new connection has header-timeout seconds to send its first request head, not the
	 * (longer) keep-alive idle timeout: connections that never send cannot pile up. */
	timer_arm(c, s->lim.header_timeout, false);
	uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

int md_http__adopt(struct md_http_server *s, int fd)
{
	struct md_http_conn *c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		return -ENOMEM;
	}
	c->srv = s;
	uv_tcp_init(s->loop, &c->tcp);
	uv_timer_init(s->loop, &c->timer);
	c->open_handles = 2;
	c->tcp.data = c;
	c->timer.data = c;
	int rc = uv_tcp_open(&c->tcp, (uv_os_sock_t)fd);
	if (rc) {
		close(fd); /* not the handle's */
		set_state(c, C_CLOSING);
		uv_close((uv_handle_t *)&c->timer, on_conn_closed);
		uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
		return rc;
	}
	conn_start(c);
	return 0;
}

int md_http_server_new(struct md_http_server **out, uv_loop_t *loop,
		       const struct md_http_limits *lim, md_http_request_cb cb, void *arg)
{
	struct md_http_server *s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->loop = loop;
	s->lim = *lim;
	s->cb = cb;
	s->cb_arg = arg;
	llhttp_settings_init(&s->settings);
	s->settings.on_message_begin = on_message_begin;
	s->settings.on_url = on_url;
	s->settings.on_header_field = on_header_field;
	s->settings.on_header_value = on_header_value;
	s->settings.on_headers_complete = on_headers_complete;
	s->settings.on_body = on_body;
	s->settings.on_message_complete = on_message_complete;
	uv_tcp_init(loop, &s->listener);
	s->listener.data = s;
	*out = s;
	return 0;
}

int md_http_listen(struct md_http_server *s, const char *host, int port, int *port_out)
{
	struct sockaddr_storage ss;
	int rc;
	if (strcmp(host, "localhost") == 0)
		host = "127.0.0.1"; /* no resolver on the loop; loopback is what is meant */
	if (strchr(host, ':'))
		rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss);
	else
		rc = uv_ip4_addr(host, port, (struct sockaddr_in *)&ss);
	if (rc)
		return rc;
	if ((rc = uv_tcp_bind(&s->listener, (struct sockaddr *)&ss, 0)))
		return rc;
	/* The kernel caps the backlog at net.core.somaxconn; ask for enough for a burst of
	 * thousands of clients. */
	if ((rc = uv_listen((uv_stream_t *)&s->listener, 4096, on_connection)))
		return rc;
	s->listening = true;
	struct sockaddr_storage got;
	int len = sizeof(got);
	*port_out = port;
	if (uv_tcp_getsockname(&s->listener, (struct sockaddr *)&got, &len) == 0) {
		if (got.ss_family == AF_INET)
			*port_out = ntohs(((struct sockaddr_in *)&got)->sin_port);
		else
			*port_out = ntohs(((struct sockaddr_in6 *)&got)->sin6_port);
	}
	return 0;
}

int md_http_listen_fd(struct md_http_server *s, int fd, int *port_out)
{
	int rc;
	if ((rc = uv_tcp_open(&s->listener, (uv_os_sock_t)fd)))
		return rc;
	/* listen() again on a listening socket only sets the backlog */
	if ((rc = uv_listen((uv_stream_t *)&s->listener, 4096, on_connection)))
		return rc;
	s->listening = true;
	struct sockaddr_storage got;
	int len = sizeof(got);
	*port_out = 0;
	if (uv_tcp_getsockname(&s->listener, (struct sockaddr *)&got, &len) == 0) {
		if (got.ss_family == AF_INET)
			*port_out = ntohs(((struct sockaddr_in *)&got)->sin_port);
		else if (got.ss_family == AF_INET6)
			*port_out = ntohs(((struct sockaddr_in6 *)&got)->sin6_port);
	}
	return 0;
}

void md_http_stop_accepting(struct md_http_server *s)
{
	s->draining = true;
	if (s->listening) {
		s->listening = false;
		uv_close((uv_handle_t *)&s->listener, NULL);
	}
	struct md_http_conn *c = s->conns, *next;
	for (; c; c = next) {
		next = c->next;
		if (c->state == C_IDLE)
			conn_close(c);
		else
			c->close_after = true;
	}
}

void md_http_server_close(struct md_http_server *s)
{
	s->draining = true;
	if (s->listening) {
		s->listening = false;
		uv_close((uv_handle_t *)&s->listener, NULL);
	} else if (!uv_is_closing((uv_handle_t *)&s->listener)) {
		uv_close((uv_handle_t *)&s->listener, NULL);
	}
	while (s->conns)
		conn_close(s->conns);
	while (s->refusals)
		refusal_close(s->refusals);
}

void md_http_server_free(struct md_http_server *s)
{
	free(s);
}

size_t md_http_n_connections(const struct md_http_server *s)
{
	return s->n_conns;
}

size_t md_http_n_busy(const struct md_http_server *s)
{
	return s->n_busy;
}

size_t md_http_raise_fd_limit(void)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl))
		return 0;
	if (rl.rlim_cur < rl.rlim_max) {
		struct rlimit want = { .rlim_cur = rl.rlim_max, .rlim_max = rl.rlim_max };
		if (setrlimit(RLIMIT_NOFILE, &want) == 0)
			rl.rlim_cur = rl.rlim_max;
	}
	return rl.rlim_cur == RLIM_INFINITY ? SIZE_MAX : (size_t)rl.rlim_cur;
}

uint64_t md_http_n_evicted(const struct md_http_server *s)
{
	return s->n_evicted;
}

uint64_t md_http_n_refused(const struct md_http_server *s)
{
	return s->n_refused;
}

size_t md_http_n_unflushed(const struct md_http_server *s)
{
	size_t n = 0;
	for (const struct md_http_conn *c = s->conns; c; c = c->next)
		if (c->state == C_BUSY || c->state == C_SHUTDOWN)
			n++;
	return n;
}
