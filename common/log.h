/* Process logging: one line per call on stderr, text or JSON, safe from any thread. */
#ifndef MD_LOG_H
#define MD_LOG_H

#include <stdbool.h>

enum md_log_level { MD_LOG_ERROR = 0, MD_LOG_WARN = 1, MD_LOG_INFO = 2, MD_LOG_DEBUG = 3 };

/* Set level and format (json: one JSON object per line). Safe while other threads log (the
 * SIGHUP reload calls it again); a line being written keeps the format it started with. */
void md_log_setup(enum md_log_level level, bool json);
/* Parse "error", "warn", "info", "debug"; returns -1 when unknown. */
int md_log_level_parse(const char *s);
bool md_log_enabled(enum md_log_level level);
/* Format and write one line with a single write(2). */
void md_log(enum md_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The per-request access line: method, path, status, tokens in/out, TTFT and duration. */
void md_log_access(const char *method, const char *path, int status, unsigned long req_id,
		   unsigned tokens_in, unsigned tokens_out, double ttft_s, double dur_s);

#endif
