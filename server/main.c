/* moed: parse the configuration, start the engine thread, serve HTTP on the libuv loop. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "engine/engine.h"
#include "server/api.h"
#include "server/config.h"
#include "server/http.h"
#include "common/assert.h"
#include "common/log.h"
#include "server/notify.h"

struct app {
	struct md_config cfg;
	uv_loop_t *loop;               /* borrowed: the default loop */
	uv_async_t wake;
	uv_signal_t sigterm, sigint, sighup;
	uv_timer_t drain_timer, watchdog;
	struct md_engine *eng;         /* owned */
	struct md_api *api;            /* owned */
	struct md_http_server *http;   /* owned */
	double drain_start;
	bool draining, cancelled, closed;
	int exit_code;
	char model_path[4096];
};

static void on_wake(uv_async_t *h)
{
	struct app *a = h->data;
	md_api_on_engine_events(a->api);
}

static void engine_wake(void *arg)
{
	uv_async_send(arg); /* the one libuv call allowed off the loop thread */
}

static void close_all(struct app *a)
{
	if (a->closed)
		return;
	a->closed = true;
	md_http_server_close(a->http);
	/* Join the engine before closing the async handle: the engine thread calls
	 * uv_async_send until it exits, and sending on a closing handle is a race. Its last
	 * events stay queued; main frees them after the loop. */
	md_engine_stop(a->eng);
	uv_close((uv_handle_t *)&a->wake, NULL);
	uv_close((uv_handle_t *)&a->sigterm, NULL);
	uv_close((uv_handle_t *)&a->sigint, NULL);
	uv_close((uv_handle_t *)&a->sighup, NULL);
	uv_close((uv_handle_t *)&a->drain_timer, NULL);
	uv_close((uv_handle_t *)&a->watchdog, NULL);
}

static void on_drain_tick(uv_timer_t *t)
{
	struct app *a = t->data;
	double waited = md_http_now() - a->drain_start;
	/* Exit once no generation is left and every response has been written out (closing a
	 * connection with a queued write would cut the end of its stream). */
	if (md_api_n_active(a->api) == 0 && md_http_n_unflushed(a->http) == 0) {
		md_log(MD_LOG_INFO, "drained after %.1fs, exiting", waited);
		close_all(a);
		return;
	}
	if (!a->cancelled && waited >= a->cfg.drain_timeout) {
		md_log(MD_LOG_WARN, "grace period over: cancelling %zu request(s)",
		       md_api_n_active(a->api));
		md_api_cancel_all(a->api);
		a->cancelled = true;
	} else if (a->cancelled && waited >= a->cfg.drain_timeout + 5) {
		md_log(MD_LOG_WARN, "requests did not end after cancellation; closing connections");
		close_all(a);
	}
}

static void start_drain(struct app *a, const char *why)
{
	if (a->draining) {
		md_log(MD_LOG_WARN, "second %s: exiting now", why);
		md_api_cancel_all(a->api);
		close_all(a);
		return;
	}
	a->draining = true;
	a->drain_start = md_http_now();
	md_log(MD_LOG_INFO, "%s: draining %zu request(s), grace %.0fs", why,
	       md_api_n_active(a->api), a->cfg.drain_timeout);
	char st[96];
	snprintf(st, sizeof(st), "STOPPING=1\nSTATUS=draining %zu request(s)",
		 md_api_n_active(a->api));
	md_notify(st);
	md_api_set_draining(a->api);
	md_http_stop_accepting(a->http);
	uv_timer_start(&a->drain_timer, on_drain_tick, 0, 100);
}

/* SIGHUP: re-read the config file's reloadable options and apply them. Logging goes to stderr
 * only (journald or the service manager own the file), so there is no log file to reopen. */
static void reload(struct app *a)
{
	char err[1024];
	if (md_config_reload(&a->cfg, err, sizeof(err))) {
		md_log(MD_LOG_ERROR, "SIGHUP: %s; keeping the old configuration", err);
		return;
	}
	md_log_setup((enum md_log_level)md_log_level_parse(a->cfg.log_level),
		     strcmp(a->cfg.log_format, "json") == 0);
	md_log(MD_LOG_INFO, "SIGHUP: configuration reloaded (log-level %s, log-format %s, %zu API "
	       "key(s))", a->cfg.log_level, a->cfg.log_format, a->cfg.n_api_keys);
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct app *a = h->data;
	if (signum == SIGHUP) {
		reload(a);
		return;
	}
	start_drain(a, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void on_watchdog(uv_timer_t *t)
{
	md_notify("WATCHDOG=1");
}

static void on_state(void *arg, enum md_engine_state st)
{
	struct app *a = arg;
	if (st == MD_ENGINE_READY) {
		md_log(MD_LOG_INFO, "model '%s' ready (context %u, vocab %u)",
		       md_engine_model_name(a->eng), md_engine_n_ctx(a->eng), md_engine_n_vocab(a->eng));
		md_notify("READY=1\nSTATUS=serving");
	} else if (st == MD_ENGINE_FAILED) {
		md_log(MD_LOG_ERROR, "%s", md_engine_error(a->eng));
		char msg[600];
		snprintf(msg, sizeof(msg), "STATUS=failed: %.500s", md_engine_error(a->eng));
		for (char *p = msg; *p; p++)
			if (*p == '\n')
				*p = ' ';
		md_notify(msg);
		/* EX_CONFIG: the model (or a setting it needs) is unusable, and would be again on a
		 * restart; moed.service does not restart on it (RestartPreventExitStatus=). */
		a->exit_code = 78;
		close_all(a);
	}
}

/* Load progress for the service manager (systemctl status shows it). Runs on the engine
 * thread: md_notify is one datagram on a socket of its own, safe from any thread. */
static void on_load_status(void *arg, const char *status)
{
	char msg[4300];
	snprintf(msg, sizeof(msg), "STATUS=%s", status);
	for (char *p = msg; *p; p++)
		if (*p == '\n')
			*p = ' '; /* one line: a newline would start another KEY=VALUE */
	md_notify(msg);
}

/* Listen where the service manager says (socket activation), else bind host:port. Returns 0
 * or 1 (the exit code) after saying why. */
static int start_listening(struct app *a)
{
	int n_fds = 0, port = 0, rc;
	int fd = md_notify_listen_fd(&n_fds);
	if (fd < 0) {
		md_log(MD_LOG_ERROR, "socket activation: descriptor 3 is not a listening stream "
		       "socket (ListenStream= in the .socket unit)");
		return 1;
	}
	if (fd > 0) {
		if (n_fds > 1)
			md_log(MD_LOG_WARN, "socket activation: %d sockets passed; serving the first",
			       n_fds);
		if ((rc = md_http_listen_fd(a->http, fd, &port))) {
			md_log(MD_LOG_ERROR, "socket activation: cannot listen on descriptor %d: %s",
			       fd, uv_strerror(rc));
			return 1;
		}
		md_log(MD_LOG_INFO, "listening on the socket passed by the service manager (port "
		       "%d; host and port settings unused) (model loading)", port);
		return 0;
	}
	rc = md_http_listen(a->http, a->cfg.host, (int)a->cfg.port, &port);
	if (rc) {
		md_log(MD_LOG_ERROR, "cannot listen on %s:%lld: %s", a->cfg.host,
		       (long long)a->cfg.port, uv_strerror(rc));
		return 1;
	}
	md_log(MD_LOG_INFO, "listening on http://%s:%d (model loading)", a->cfg.host, port);
	return 0;
}

/* Every connection is a descriptor: raise the soft limit to the hard one, and say so when
 * even that is short of max-connections (clients past it then wait in the listen backlog). */
static void check_fd_limit(const struct md_config *cfg)
{
	size_t have = md_http_raise_fd_limit();
	size_t want = (size_t)cfg->max_connections + 64; /* model, engine, listener, logs */
	if (have && have < want)
		md_log(MD_LOG_WARN, "open-file limit %zu is below max-connections %lld + 64: raise "
		       "LimitNOFILE (systemd) or ulimit -n", have, (long long)cfg->max_connections);
}

/* The model to serve when none is configured: $MOED_DEFAULT_MODEL, the one the build made,
 * or the installed one. */
static const char *default_model(void)
{
	const char *env = getenv("MOED_DEFAULT_MODEL");
	if (env && *env)
		return env;
#ifdef MOED_BUILD_MODEL
	if (access(MOED_BUILD_MODEL, R_OK) == 0)
		return MOED_BUILD_MODEL;
#endif
#ifdef MOED_INSTALLED_MODEL
	return MOED_INSTALLED_MODEL;
#else
	return "models/default.gguf";
#endif
}

int main(int argc, char **argv)
{
	static struct app app;
	struct app *a = &app;
	int rc = md_config_parse(&a->cfg, argc, argv);
	if (rc == 1)
		return 0;
	if (rc < 0)
		return 2;
	if (!a->cfg.model[0]) {
		free(a->cfg.model);
		a->cfg.model = strdup(default_model());
		/* The default model ships with a dense draft beside it (default-draft.gguf): the
		 * draft model for speculative decoding unless one is configured. */
		char draft[4096];
		const char *dot = strrchr(a->cfg.model, '.');
		int stem = dot ? (int)(dot - a->cfg.model) : (int)strlen(a->cfg.model);
		snprintf(draft, sizeof(draft), "%.*s-draft.gguf", stem, a->cfg.model);
		if (access(draft, R_OK) == 0 && !a->cfg.draft_model[0]) {
			md_log(MD_LOG_INFO, "default model '%s', draft model beside it: '%s'",
			       a->cfg.model, draft);
			free(a->cfg.draft_model);
			a->cfg.draft_model = strdup(draft);
		}
	}
	if (md_config_validate(&a->cfg))
		return 2;
	if (a->cfg.check_only) {
		printf("moed: configuration OK (model '%s', %s:%lld, %zu API key(s))\n", a->cfg.model,
		       a->cfg.host, (long long)a->cfg.port, a->cfg.n_api_keys);
		md_config_release(&a->cfg);
		return 0;
	}
	md_log_setup((enum md_log_level)md_log_level_parse(a->cfg.log_level),
		     strcmp(a->cfg.log_format, "json") == 0);
	signal(SIGPIPE, SIG_IGN);
	/* A write past RLIMIT_FSIZE fails with EFBIG (reported where it happens: the warm-restart
	 * state file) instead of killing the process. */
	signal(SIGXFSZ, SIG_IGN);

	a->loop = uv_default_loop();
	uv_async_init(a->loop, &a->wake, on_wake);
	a->wake.data = a;
	struct md_engine_config ec = {
		.model_path = a->cfg.model,
		.chat_template = a->cfg.chat_template[0] ? a->cfg.chat_template : NULL,
		.n_threads = (int)a->cfg.threads,
		.n_ctx = (uint32_t)a->cfg.ctx_size,
		.kv_blocks = (uint32_t)a->cfg.kv_blocks,
		.kv_mem_mb = (uint32_t)a->cfg.kv_memory_mb,
		.max_seqs = (uint32_t)a->cfg.max_seqs,
		.step_tokens = (uint32_t)a->cfg.step_tokens,
		.max_queue = (uint32_t)a->cfg.max_queue,
		.progress = true,
		.no_prefix_cache = !a->cfg.prefix_cache,
		.kv_f32 = strcmp(a->cfg.kv_cache_type, "f32") == 0,
		.status_cb = on_load_status,
		.trace_routing = a->cfg.trace_routing,
		.expert_batching = a->cfg.expert_batching,
		.expert_cache_mb = a->cfg.expert_cache_mb,
		.device_expert_mb = a->cfg.device_expert_mb,
		.expert_device = a->cfg.expert_device,
		.device = a->cfg.device,
		.expert_policy = a->cfg.expert_policy,
		.no_expert_prefetch = !a->cfg.expert_prefetch,
		.no_expert_fill = !a->cfg.expert_fill,
		.state_dir = a->cfg.state_dir[0] ? a->cfg.state_dir : NULL,
		.spec = (enum md_spec_drafter)md_spec_drafter_parse(a->cfg.spec),
		.spec_k = (uint32_t)a->cfg.spec_k,
		.draft_model_path = a->cfg.draft_model && a->cfg.draft_model[0] ? a->cfg.draft_model
										 : NULL,
		.spec_self_experts = (uint32_t)a->cfg.spec_self_experts,
		.spec_self_skip = a->cfg.spec_self_skip && a->cfg.spec_self_skip[0]
				  ? a->cfg.spec_self_skip : NULL,
	};
	struct md_http_limits lim = {
		.max_connections = (size_t)a->cfg.max_connections,
		.max_body_bytes = (size_t)a->cfg.max_body_bytes,
		.max_header_bytes = (size_t)a->cfg.max_header_bytes,
		.header_timeout = a->cfg.header_timeout,
		.idle_timeout = a->cfg.idle_timeout,
		.max_backlog = (size_t)a->cfg.sse_backlog_bytes,
		.retry_after = (unsigned)a->cfg.retry_after,
	};
	check_fd_limit(&a->cfg);
	if ((rc = md_engine_new(&a->eng, &ec, engine_wake, &a->wake)) ||
	    (rc = md_api_new(&a->api, a->eng, &a->cfg, a->loop)) ||
	    (rc = md_http_server_new(&a->http, a->loop, &lim, md_api_on_request, a->api))) {
		fprintf(stderr, "moed: cannot initialise: %s\n", strerror(-rc));
		return 1;
	}
	md_api_set_http(a->api, a->http);
	md_api_set_state_cb(a->api, on_state, a);
	if (start_listening(a))
		return 1;

	uv_signal_init(a->loop, &a->sigterm);
	uv_signal_init(a->loop, &a->sigint);
	uv_signal_init(a->loop, &a->sighup);
	a->sigterm.data = a->sigint.data = a->sighup.data = a;
	uv_signal_start(&a->sigterm, on_signal, SIGTERM);
	uv_signal_start(&a->sigint, on_signal, SIGINT);
	uv_signal_start(&a->sighup, on_signal, SIGHUP);
	uv_timer_init(a->loop, &a->drain_timer);
	uv_timer_init(a->loop, &a->watchdog);
	a->drain_timer.data = a->watchdog.data = a;
	uint64_t wd = md_notify_watchdog_usec();
	if (wd)
		uv_timer_start(&a->watchdog, on_watchdog, 0, wd / 2000 ? wd / 2000 : 1);

	/* From here on the libuv handles, the api and its generations belong to this thread. */
	md_owner_claim(&md_loop_thread, "loop");
	if ((rc = md_engine_start(a->eng))) {
		md_log(MD_LOG_ERROR, "cannot start the engine thread: %s", strerror(-rc));
		return 1;
	}
	uv_run(a->loop, UV_RUN_DEFAULT);

	/* tear down in reverse */
	md_engine_stop(a->eng);
	md_engine_events_free(md_engine_poll(a->eng));
	md_http_server_free(a->http);
	md_api_free(a->api);
	md_engine_free(a->eng);
	uv_loop_close(a->loop);
	md_config_release(&a->cfg);
	return a->exit_code;
}
