/* Configuration: one declarative option table, INI file (inih) and command-line flags. */
#include "server/config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/log.h"
#include "engine/engine.h"

#ifndef MOED_VERSION
#define MOED_VERSION "0.0.0"
#endif

enum opt_type { OPT_INT, OPT_DOUBLE, OPT_STRING, OPT_BOOL /* int64_t 0 or 1 */ };

typedef int (*opt_validator)(const char *value, char *err, size_t errlen);

/* One option: the INI key (in its section) is also the long flag --key. */
struct opt {
	const char *section;
	const char *name;
	char short_flag;       /* 0 = none */
	enum opt_type type;
	size_t offset;         /* of the field in struct md_config */
	const char *def;       /* default as text */
	double min, max;       /* for numbers */
	opt_validator validate; /* may be NULL */
	bool reloadable;       /* re-read on SIGHUP */
	const char *help;
};

static int v_log_level(const char *v, char *err, size_t errlen)
{
	if (md_log_level_parse(v) >= 0)
		return 0;
	snprintf(err, errlen, "must be one of error, warn, info, debug");
	return -EINVAL;
}

static int v_log_format(const char *v, char *err, size_t errlen)
{
	if (strcmp(v, "text") == 0 || strcmp(v, "json") == 0)
		return 0;
	snprintf(err, errlen, "must be text or json");
	return -EINVAL;
}

static int v_kv_type(const char *v, char *err, size_t errlen)
{
	if (strcmp(v, "auto") == 0 || strcmp(v, "f32") == 0)
		return 0;
	snprintf(err, errlen, "must be auto or f32");
	return -EINVAL;
}

static int v_spec(const char *v, char *err, size_t errlen)
{
	if (strcmp(v, "off") == 0 || strcmp(v, "ngram") == 0 || strcmp(v, "draft") == 0 ||
	    strcmp(v, "self") == 0)
		return 0;
	snprintf(err, errlen, "must be off, ngram, draft or self");
	return -EINVAL;
}

static int v_dev(const char *v, char *err, size_t errlen)
{
	return md_engine_check_device(v, err, errlen);
}

static int v_xdev(const char *v, char *err, size_t errlen)
{
	return md_engine_check_expert_device(v, err, errlen);
}

static int v_host(const char *v, char *err, size_t errlen)
{
	unsigned char addr[sizeof(struct in6_addr)];
	if (inet_pton(AF_INET, v, addr) == 1 || inet_pton(AF_INET6, v, addr) == 1 ||
	    strcmp(v, "localhost") == 0)
		return 0;
	snprintf(err, errlen, "must be an IPv4 or IPv6 address (or localhost)");
	return -EINVAL;
}

#define OFF(f) offsetof(struct md_config, f)
#define BIG 1e15

static const struct opt options[] = {
	{ "server", "host", 0, OPT_STRING, OFF(host), "127.0.0.1", 0, 0, v_host, false,
	  "address to listen on (IPv4 or IPv6 literal, or localhost)" },
	{ "server", "port", 'p', OPT_INT, OFF(port), "8080", 0, 65535, NULL, false,
	  "TCP port (0 = any free port, printed at start)" },
	{ "server", "served-model-name", 0, OPT_STRING, OFF(served_model_name), "", 0, 0, NULL, false,
	  "model id in the API (empty: the model's general.name or file name)" },
	{ "server", "max-connections", 0, OPT_INT, OFF(max_connections), "4096", 1, 1 << 20, NULL,
	  false, "open client connections; at the cap the longest idle one is closed, else 503" },
	{ "server", "max-body-bytes", 0, OPT_INT, OFF(max_body_bytes), "4194304", 1024, 1 << 30, NULL,
	  false, "largest request body (413 above)" },
	{ "server", "max-header-bytes", 0, OPT_INT, OFF(max_header_bytes), "16384", 1024, 1 << 20,
	  NULL, false, "largest request head, request line plus headers (431 above)" },
	{ "server", "header-timeout", 0, OPT_DOUBLE, OFF(header_timeout), "10", 0.05, 3600, NULL,
	  false, "seconds to receive a whole request once it starts, or a new connection's first" },
	{ "server", "idle-timeout", 0, OPT_DOUBLE, OFF(idle_timeout), "60", 0.05, 86400, NULL, false,
	  "seconds a keep-alive connection may sit idle" },
	{ "server", "drain-timeout", 0, OPT_DOUBLE, OFF(drain_timeout), "30", 0, 3600, NULL, false,
	  "grace period on SIGTERM/SIGINT before in-flight requests are cancelled" },
	{ "server", "heartbeat-interval", 0, OPT_DOUBLE, OFF(heartbeat_interval), "5", 0.05, 3600,
	  NULL, false, "seconds of silence after which a stream gets an SSE comment" },
	{ "server", "sse-backlog-bytes", 0, OPT_INT, OFF(sse_backlog_bytes), "4194304", 4096, 1 << 30,
	  NULL, false, "unsent bytes allowed per client before a slow stream is cancelled" },
	{ "server", "retry-after", 0, OPT_INT, OFF(retry_after), "1", 0, 3600, NULL, false,
	  "Retry-After seconds sent with 429 and 503" },
	{ "security", "api-key", 0, OPT_STRING, OFF(api_key), "", 0, 0, NULL, true,
	  "required bearer token (empty: none; /health is always open); re-read on SIGHUP" },
	{ "security", "api-key-file", 0, OPT_STRING, OFF(api_key_file), "", 0, 0, NULL, true,
	  "file with one accepted key per line (# comments); re-read on SIGHUP" },
	{ "engine", "model", 'm', OPT_STRING, OFF(model), "", 0, 0, NULL, false,
	  "GGUF model file (empty: the default model shipped with moed)" },
	{ "engine", "chat-template", 0, OPT_STRING, OFF(chat_template), "", 0, 0, NULL, false,
	  "built-in chat template name overriding the model's (chatml, qwen3, mistral, ...)" },
	{ "engine", "threads", 't', OPT_INT, OFF(threads), "0", 0, 1024, NULL, false,
	  "compute threads (0 = one per core)" },
	{ "engine", "ctx-size", 0, OPT_INT, OFF(ctx_size), "4096", 0, 1 << 24, NULL, false,
	  "max tokens per sequence, prompt plus output (0 = the model's training context)" },
	{ "engine", "kv-blocks", 0, OPT_INT, OFF(kv_blocks), "0", 0, 1 << 24, NULL, false,
	  "KV cache blocks of 16 tokens (0 = derive from kv-memory-mb)" },
	{ "engine", "kv-memory-mb", 0, OPT_INT, OFF(kv_memory_mb), "512", 1, 1 << 24, NULL, false,
	  "KV cache budget in MiB when kv-blocks is 0" },
	{ "engine", "max-seqs", 0, OPT_INT, OFF(max_seqs), "64", 1, 4096, NULL, false,
	  "sequences decoding at once (continuous batching width)" },
	{ "engine", "step-tokens", 0, OPT_INT, OFF(step_tokens), "512", 16, 1 << 16, NULL, false,
	  "token budget of one engine step (decode tokens plus prefill chunks)" },
	{ "engine", "max-queue", 0, OPT_INT, OFF(max_queue), "256", 1, 1 << 20, NULL, false,
	  "requests waiting for admission before new ones get 429" },
	{ "engine", "prefix-cache", 0, OPT_BOOL, OFF(prefix_cache), "true", 0, 1, NULL, false,
	  "reuse the KV of a prompt's cached leading blocks (true or false)" },
	{ "engine", "kv-cache-type", 0, OPT_STRING, OFF(kv_cache_type), "auto", 0, 0, v_kv_type,
	  false, "KV cache element type: auto (float K/V rows; latent attention's compressed rows "
	  "in half, as llama.cpp's f16 cache) or f32 (float everywhere)" },
	{ "engine", "device", 0, OPT_STRING, OFF(device), "auto", 0, 0, v_dev, false,
	  "where the forward pass runs: auto (a CUDA GPU when one is found and the model runs "
	  "there, else the CPU), cpu, cuda (a GPU is required), or sim[:MIB] (host memory "
	  "simulating a device, for tests)" },
	{ "engine", "expert-cache-mb", 0, OPT_DOUBLE, OFF(expert_cache_mb), "0", -1, 1 << 30, NULL,
	  false, "host RAM for routed experts read from the file (0 = auto: only when the file "
	  "exceeds 110% of the memory limit; -1 = never, keep the mapping)" },
	{ "engine", "device-expert-mb", 0, OPT_INT, OFF(device_expert_mb), "0", 0, 1 << 30, NULL,
	  false, "device memory for the hottest experts (a tier above host RAM; 0 = none)" },
	{ "engine", "expert-device", 0, OPT_STRING, OFF(expert_device), "auto", 0, 0, v_xdev,
	  false, "device of the device tier: auto (CUDA when present), cuda, none, or "
	  "sim[:COPY_MBPS[:COMPUTE_MBPS]] (host memory simulating one, for tests)" },
	{ "engine", "expert-policy", 0, OPT_STRING, OFF(expert_policy), "pred", 0, 0, NULL, false,
	  "eviction policy of the expert cache: pred, lfu or lru (bench/README.md)" },
	{ "engine", "expert-prefetch", 0, OPT_INT, OFF(expert_prefetch), "0", 0, 1, NULL, false,
	  "1 = read the next layer's predicted experts ahead (pre-gating); 0 = off (default: on "
	  "a disk-bound store wrong guesses cost more reads than the early start saves)" },
	{ "engine", "expert-fill", 0, OPT_INT, OFF(expert_fill), "1", 0, 1, NULL, false,
	  "1 = fill the empty expert cache at start (after the warm start's hot set), reads that "
	  "give way to requests' own; 0 = experts come in only when used" },
	{ "engine", "state-dir", 0, OPT_STRING, OFF(state_dir), "", 0, 0, NULL, false,
	  "directory for state kept across restarts (the hot experts); empty = none" },
	{ "engine", "max-tokens-cap", 0, OPT_INT, OFF(max_tokens_cap), "4096", 1, 1 << 24, NULL,
	  false, "largest max_tokens a request may ask for (400 above)" },
	{ "engine", "trace-routing", 0, OPT_STRING, OFF(trace_routing), "", 0, 0, NULL, false,
	  "write every MoE layer's expert choices to this file (empty: off; bench/README.md)" },
	{ "engine", "expert-batching", 0, OPT_INT, OFF(expert_batching), "-1", -1, 1, NULL, false,
	  "1: when more sequences decode than a step holds, batch those that share experts "
	  "(age-bounded; bench/README.md); 0: off; -1: on where experts go through the store" },
	{ "speculative", "spec", 0, OPT_STRING, OFF(spec), "ngram", 0, 0, v_spec, false,
	  "speculative decoding by default: off, ngram (prompt lookup), draft (draft-model) or "
	  "self (the model with fewer experts); requests choose with \"speculative\"" },
	{ "speculative", "spec-k", 0, OPT_INT, OFF(spec_k), "32", 1, 32, NULL, false,
	  "most drafted tokens per sequence and step (the controller picks 0..spec-k)" },
	{ "speculative", "draft-model", 0, OPT_STRING, OFF(draft_model), "", 0, 0, NULL, false,
	  "draft GGUF with the model's vocabulary (empty: the draft beside the default model "
	  "when serving it)" },
	{ "speculative", "spec-self-experts", 0, OPT_INT, OFF(spec_self_experts), "1", 1, 64, NULL,
	  false, "experts per token in self-speculation's draft passes (at most the model's)" },
	{ "speculative", "spec-self-skip", 0, OPT_STRING, OFF(spec_self_skip), "", 0, 0, NULL,
	  false, "layers self-speculation's draft passes skip, a comma list (empty: none)" },
	{ "log", "log-level", 0, OPT_STRING, OFF(log_level), "info", 0, 0, v_log_level, true,
	  "error, warn, info or debug; re-read from the config file on SIGHUP" },
	{ "log", "log-format", 0, OPT_STRING, OFF(log_format), "text", 0, 0, v_log_format, true,
	  "text, or json for one JSON object per line; re-read on SIGHUP" },
};

#define N_OPTIONS (sizeof(options) / sizeof(options[0]))
_Static_assert(N_OPTIONS <= 64 * sizeof(((struct md_config *)0)->_from_flag) / sizeof(uint64_t),
	       "md_config._from_flag has one bit per option");

static const struct opt *find_opt(const char *name)
{
	for (size_t i = 0; i < N_OPTIONS; i++)
		if (strcmp(options[i].name, name) == 0)
			return &options[i];
	return NULL;
}

static const struct opt *find_short(char c)
{
	for (size_t i = 0; i < N_OPTIONS; i++)
		if (options[i].short_flag == c)
			return &options[i];
	return NULL;
}

/* Store value into the option's field after checking it. */
static int set_opt(struct md_config *c, const struct opt *o, const char *value, char *err,
		   size_t errlen)
{
	char *p = (char *)c + o->offset;
	char *end;
	switch (o->type) {
	case OPT_INT: {
		errno = 0;
		long long v = strtoll(value, &end, 10);
		if (errno || end == value || *end) {
			snprintf(err, errlen, "'%s' needs an integer, got '%s'", o->name, value);
			return -EINVAL;
		}
		if ((double)v < o->min || (double)v > o->max) {
			snprintf(err, errlen, "'%s' must be in [%.0f, %.0f], got %lld", o->name, o->min,
				 o->max, v);
			return -ERANGE;
		}
		*(int64_t *)p = v;
		break;
	}
	case OPT_DOUBLE: {
		errno = 0;
		double v = strtod(value, &end);
		if (errno || end == value || *end || !isfinite(v)) {
			snprintf(err, errlen, "'%s' needs a number, got '%s'", o->name, value);
			return -EINVAL;
		}
		if (v < o->min || v > o->max) {
			snprintf(err, errlen, "'%s' must be in [%g, %g], got %g", o->name, o->min, o->max, v);
			return -ERANGE;
		}
		*(double *)p = v;
		break;
	}
	case OPT_BOOL: {
		static const char *const yes[] = { "true", "on", "yes", "1" };
		static const char *const no[] = { "false", "off", "no", "0" };
		int v = -1;
		for (size_t i = 0; i < 4; i++) {
			if (strcasecmp(value, yes[i]) == 0)
				v = 1;
			if (strcasecmp(value, no[i]) == 0)
				v = 0;
		}
		if (v < 0) {
			snprintf(err, errlen, "'%s' needs true or false, got '%s'", o->name, value);
			return -EINVAL;
		}
		*(int64_t *)p = v;
		break;
	}
	case OPT_STRING: {
		char verr[200];
		if (o->validate && o->validate(value, verr, sizeof(verr))) {
			snprintf(err, errlen, "'%s' %s, got '%s'", o->name, verr, value);
			return -EINVAL;
		}
		char *dup = strdup(value);
		if (!dup) {
			snprintf(err, errlen, "out of memory");
			return -ENOMEM;
		}
		free(*(char **)p);
		*(char **)p = dup;
		break;
	}
	}
	return 0;
}

/* inih keeps parsing after an error and reports the first bad line only, without telling
 * the handler which line it is on: keep the first handler error and its key, and check on
 * return that the reported line is that key's (else the first error was a syntax error). */
struct ini_ctx {
	struct md_config *c;
	char err[512];
	char key[64];
};

static int on_ini_key(void *user, const char *section, const char *name, const char *value)
{
	struct ini_ctx *ctx = user;
	char err[512];
	const struct opt *o = find_opt(name);
	if (!o) {
		snprintf(err, sizeof(err), "unknown key '%s'", name);
	} else if (strcmp(section, o->section) != 0) {
		snprintf(err, sizeof(err), "key '%s' belongs in section [%s], not [%s]", name,
			 o->section, section);
	} else if (set_opt(ctx->c, o, value, err, sizeof(err)) == 0) {
		return 1;
	}
	if (!ctx->key[0]) {
		snprintf(ctx->err, sizeof(ctx->err), "%s", err);
		snprintf(ctx->key, sizeof(ctx->key), "%s", name);
	}
	return 0;
}

/* Whether line `line` (1-based) of path holds the key `key` (as "key = ..." or "key: ..."). */
static bool line_has_key(const char *path, int line, const char *key)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return false;
	char buf[4096];
	bool found = false;
	for (int i = 1; fgets(buf, sizeof(buf), f); i++) {
		if (i < line)
			continue;
		char *s = buf;
		while (*s == ' ' || *s == '\t')
			s++;
		size_t kl = strlen(key);
		if (strncmp(s, key, kl) == 0) {
			s += kl;
			while (*s == ' ' || *s == '\t')
				s++;
			found = *s == '=' || *s == ':';
		}
		break;
	}
	fclose(f);
	return found;
}

/* Apply the INI file at path to c. Returns 0; -ENOENT when it cannot be opened ("cannot open
 * config 'path': why" in err); or -EINVAL with "path:line: what" in err. */
static int read_file(struct md_config *c, const char *path, char *err, size_t errlen)
{
	struct ini_ctx ctx = { .c = c };
	int line = ini_parse(path, on_ini_key, &ctx);
	if (line == -1) {
		snprintf(err, errlen, "cannot open config '%s': %s", path, strerror(errno));
		return -ENOENT;
	}
	if (line != 0) {
		bool ours = ctx.key[0] && line_has_key(path, line, ctx.key);
		snprintf(err, errlen, "%s:%d: %s", path, line,
			 ours ? ctx.err : "syntax error (expected [section] or key = value)");
		return -EINVAL;
	}
	return 0;
}

void md_config_usage(const char *argv0)
{
	printf("usage: %s [-c FILE] [--check-config] [--KEY VALUE]...\n\n", argv0);
	printf("  -c, --config FILE   read options from an INI file (flags win over it)\n");
	printf("      --check-config  validate the configuration and exit\n");
	printf("  -h, --help          this text\n      --version       print the version\n\n");
	const char *sec = "";
	for (size_t i = 0; i < N_OPTIONS; i++) {
		const struct opt *o = &options[i];
		if (strcmp(sec, o->section) != 0) {
			sec = o->section;
			printf("[%s]\n", sec);
		}
		char flag[64];
		if (o->short_flag)
			snprintf(flag, sizeof(flag), "-%c, --%s", o->short_flag, o->name);
		else
			snprintf(flag, sizeof(flag), "    --%s", o->name);
		printf("  %-28s %s (default: \"%s\")\n", flag, o->help, o->def);
	}
}

static int set_defaults(struct md_config *c)
{
	char err[256];
	for (size_t i = 0; i < N_OPTIONS; i++)
		if (set_opt(c, &options[i], options[i].def, err, sizeof(err))) {
			fprintf(stderr, "moed: bad built-in default: %s\n", err);
			return -EINVAL;
		}
	return 0;
}

int md_config_parse(struct md_config *c, int argc, char **argv)
{
	memset(c, 0, sizeof(*c));
	if (set_defaults(c))
		return -EINVAL;

	/* First pass: --config, --help, --version, --check-config. */
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
			md_config_usage(argv[0]);
			return 1;
		}
		if (strcmp(a, "--version") == 0) {
			printf("moed %s\n", MOED_VERSION);
			return 1;
		}
		if (strcmp(a, "--check-config") == 0) {
			c->check_only = true;
		} else if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) {
			if (i + 1 >= argc) {
				fprintf(stderr, "moed: %s needs a file name\n", a);
				return -EINVAL;
			}
			free(c->config_path);
			c->config_path = strdup(argv[++i]);
		} else if (strncmp(a, "--config=", 9) == 0) {
			free(c->config_path);
			c->config_path = strdup(a + 9);
		}
	}
	if (c->config_path) {
		char err[1024];
		int rc = read_file(c, c->config_path, err, sizeof(err));
		if (rc == -ENOENT)
			fprintf(stderr, "moed: %s\n", err);
		else if (rc)
			fprintf(stderr, "%s\n", err);
		if (rc)
			return rc;
	}

	/* Second pass: every option flag, in order; the last one wins. */
	int bad = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--check-config") == 0)
			continue;
		if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) {
			i++;
			continue;
		}
		if (strncmp(a, "--config=", 9) == 0)
			continue;
		const struct opt *o = NULL;
		const char *value = NULL;
		char name[64];
		if (a[0] == '-' && a[1] == '-') {
			const char *eq = strchr(a + 2, '=');
			size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
			if (len < sizeof(name)) {
				memcpy(name, a + 2, len);
				name[len] = 0;
				o = find_opt(name);
			}
			if (eq)
				value = eq + 1;
		} else if (a[0] == '-' && a[1] && !a[2]) {
			o = find_short(a[1]);
		}
		if (!o) {
			fprintf(stderr, "moed: unknown option '%s' (see --help)\n", a);
			bad = 1;
			continue;
		}
		if (!value) {
			if (i + 1 >= argc) {
				fprintf(stderr, "moed: option '%s' needs a value\n", a);
				bad = 1;
				continue;
			}
			value = argv[++i];
		}
		char err[512];
		if (set_opt(c, o, value, err, sizeof(err))) {
			fprintf(stderr, "moed: %s\n", err);
			bad = 1;
		}
		c->_from_flag[(o - options) / 64] |= 1ull << ((o - options) % 64);
	}
	return bad ? -EINVAL : 0;
}

static void free_keys(char **keys, size_t n)
{
	for (size_t i = 0; i < n; i++)
		free(keys[i]);
	free(keys);
}

static int push_key(char ***keys, size_t *n, const char *k, size_t len)
{
	char **nk = realloc(*keys, sizeof(char *) * (*n + 1));
	if (!nk)
		return -ENOMEM;
	*keys = nk;
	nk[*n] = strndup(k, len);
	if (!nk[*n])
		return -ENOMEM;
	(*n)++;
	return 0;
}

/* Collect keys from api-key and api-key-file into a fresh array. Returns 0, or a negative code
 * with one line in err. */
static int load_keys(const struct md_config *c, char ***out, size_t *n_out, char *err,
		     size_t errlen)
{
	char **keys = NULL;
	size_t n = 0;
	int rc = 0;
	if (c->api_key[0] && (rc = push_key(&keys, &n, c->api_key, strlen(c->api_key))))
		goto fail;
	if (c->api_key_file[0]) {
		FILE *f = fopen(c->api_key_file, "r");
		if (!f) {
			rc = -errno;
			snprintf(err, errlen, "cannot open api-key-file '%s': %s", c->api_key_file,
				 strerror(errno));
			goto fail;
		}
		char line[1024];
		while (fgets(line, sizeof(line), f)) {
			char *s = line;
			while (*s == ' ' || *s == '\t')
				s++;
			size_t len = strcspn(s, "\r\n");
			while (len && (s[len - 1] == ' ' || s[len - 1] == '\t'))
				len--;
			if (len == 0 || s[0] == '#')
				continue;
			if ((rc = push_key(&keys, &n, s, len))) {
				fclose(f);
				goto fail;
			}
		}
		fclose(f);
		if (n == 0 && !c->api_key[0]) {
			snprintf(err, errlen, "api-key-file '%s' holds no key", c->api_key_file);
			rc = -EINVAL;
			goto fail;
		}
	}
	*out = keys;
	*n_out = n;
	return 0;
fail:
	free_keys(keys, n);
	return rc;
}

int md_config_validate(struct md_config *c)
{
	int bad = 0;
	if (c->model[0]) {
		FILE *f = fopen(c->model, "rb");
		if (!f) {
			fprintf(stderr, "moed: cannot open model '%s': %s\n", c->model, strerror(errno));
			bad = 1;
		} else {
			fclose(f);
		}
	}
	char **keys = NULL;
	size_t n = 0;
	char err[512] = "out of memory";
	if (load_keys(c, &keys, &n, err, sizeof(err))) {
		fprintf(stderr, "moed: %s\n", err);
		bad = 1;
	} else {
		free_keys(c->api_keys, c->n_api_keys);
		c->api_keys = keys;
		c->n_api_keys = n;
	}
	return bad ? -EINVAL : 0;
}

/* Swap option o's field between a and b. */
static void swap_opt(struct md_config *a, struct md_config *b, const struct opt *o)
{
	char *pa = (char *)a + o->offset, *pb = (char *)b + o->offset;
	char tmp[sizeof(int64_t) > sizeof(double) ? sizeof(int64_t) : sizeof(double)];
	size_t sz = o->type == OPT_STRING ? sizeof(char *)
		  : o->type == OPT_DOUBLE ? sizeof(double) : sizeof(int64_t);
	_Static_assert(sizeof(char *) <= sizeof(tmp), "field sizes");
	memcpy(tmp, pa, sz);
	memcpy(pa, pb, sz);
	memcpy(pb, tmp, sz);
}

/* Copy option o's value from src into dst. Returns 0 or -ENOMEM. */
static int copy_opt(struct md_config *dst, const struct md_config *src, const struct opt *o)
{
	char *pd = (char *)dst + o->offset;
	const char *ps = (const char *)src + o->offset;
	if (o->type != OPT_STRING) {
		memcpy(pd, ps, o->type == OPT_DOUBLE ? sizeof(double) : sizeof(int64_t));
		return 0;
	}
	char *dup = strdup(*(char *const *)ps);
	if (!dup)
		return -ENOMEM;
	free(*(char **)pd);
	*(char **)pd = dup;
	return 0;
}

int md_config_reload(struct md_config *c, char *err, size_t errlen)
{
	struct md_config t;
	memset(&t, 0, sizeof(t));
	snprintf(err, errlen, "out of memory");
	int rc = set_defaults(&t);
	if (rc)
		goto release;
	if (c->config_path && (rc = read_file(&t, c->config_path, err, errlen)))
		goto release;
	/* flags still win: their values stay */
	for (size_t i = 0; i < N_OPTIONS; i++)
		if (options[i].reloadable && (c->_from_flag[i / 64] & (1ull << (i % 64))) &&
		    (rc = copy_opt(&t, c, &options[i])))
			goto release;
	if ((rc = load_keys(&t, &t.api_keys, &t.n_api_keys, err, errlen)))
		goto release;
	/* commit: c takes the new values, t the old ones to free */
	for (size_t i = 0; i < N_OPTIONS; i++)
		if (options[i].reloadable)
			swap_opt(&t, c, &options[i]);
	char **keys = c->api_keys;
	size_t n = c->n_api_keys;
	c->api_keys = t.api_keys;
	c->n_api_keys = t.n_api_keys;
	t.api_keys = keys;
	t.n_api_keys = n;
	err[0] = 0;
release:
	md_config_release(&t);
	return rc;
}

void md_config_release(struct md_config *c)
{
	for (size_t i = 0; i < N_OPTIONS; i++)
		if (options[i].type == OPT_STRING) {
			char **p = (char **)((char *)c + options[i].offset);
			free(*p);
			*p = NULL;
		}
	free(c->config_path);
	free_keys(c->api_keys, c->n_api_keys);
	c->api_keys = NULL;
	c->n_api_keys = 0;
	c->config_path = NULL;
}
