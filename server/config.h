/* Configuration: one declarative option table, INI file (inih) and command-line flags. */
#ifndef MD_CONFIG_H
#define MD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct md_config {
	/* [server] */
	char *host;                 /* owned */
	int64_t port;
	char *served_model_name;    /* owned; "" = the model's name */
	int64_t max_connections;
	int64_t max_body_bytes;
	int64_t max_header_bytes;
	double header_timeout;      /* seconds */
	double idle_timeout;
	double drain_timeout;
	double heartbeat_interval;
	int64_t sse_backlog_bytes;
	int64_t retry_after;        /* seconds, sent with 429/503 */
	/* [security] */
	char *api_key;              /* owned; "" = none */
	char *api_key_file;         /* owned; "" = none */
	/* [engine] */
	char *model;                /* owned; "" = the default model */
	char *chat_template;        /* owned; "" = from the model */
	int64_t threads;
	int64_t ctx_size;
	int64_t kv_blocks;
	int64_t kv_memory_mb;
	int64_t max_seqs;
	int64_t step_tokens;
	int64_t max_queue;
	int64_t max_tokens_cap;
	int64_t prefix_cache;       /* 0 or 1 */
	char *kv_cache_type;        /* owned: "auto" or "f32" */
	char *trace_routing;        /* owned; "" = no routing trace */
	int64_t expert_batching;    /* 1 on, 0 off */
	double expert_cache_mb;     /* 0 auto, -1 never, > 0 MiB */
	int64_t device_expert_mb;
	char *device;               /* owned: auto, cpu, cuda, sim[:MIB] */
	char *expert_device;        /* owned: auto, none, cuda, sim[:COPY_MBPS[:COMPUTE_MBPS]] */
	char *expert_policy;        /* owned */
	int64_t expert_prefetch;    /* 0 or 1 */
	int64_t expert_fill;        /* 0 or 1 */
	char *state_dir;            /* owned; "" = none */
	/* [speculative] */
	char *spec;                 /* owned: off, ngram, draft or self: requests' default drafter */
	int64_t spec_k;             /* largest drafted tokens per step */
	char *draft_model;          /* owned; "" = the draft beside the default model, if any */
	int64_t spec_self_experts;  /* experts per token in self-speculation's draft passes */
	char *spec_self_skip;       /* owned; layers those passes skip, "" = none */
	/* [log] */
	char *log_level;            /* owned */
	char *log_format;           /* owned */

	/* Not options: derived or command-only. */
	char *config_path;          /* owned; NULL = none */
	bool check_only;            /* --check-config */
	char **api_keys;            /* owned (n_api_keys): from api_key and api_key_file */
	size_t n_api_keys;
	uint64_t _from_flag[2];     /* bit i: option i of the table was given as a flag */
};

/* Fill defaults, read the INI file named by --config/-c (if any), then apply flags (flags
 * win). Returns 0; 1 when the process should exit 0 at once (--help, --version); or a
 * negative code after printing one line per error ("file:line: ..." for the file) to
 * stderr. */
int md_config_parse(struct md_config *c, int argc, char **argv);
/* Cross-field checks and loading of the API keys. Returns 0 or negative after printing. */
int md_config_validate(struct md_config *c);
/* SIGHUP: re-read the config file and apply its reloadable options (api-key, api-key-file,
 * log-level, log-format; absent keys go back to their defaults) except those given as flags,
 * which still win; then reload the API keys. All or nothing: when the file or the key file
 * cannot be read or holds an error, c is unchanged and err gets one line. Applying log-level
 * and log-format is the caller's (md_log_setup). Returns 0 or a negative code. Loop thread
 * (c is read there). */
int md_config_reload(struct md_config *c, char *err, size_t errlen);
void md_config_release(struct md_config *c);
void md_config_usage(const char *argv0);

#endif
