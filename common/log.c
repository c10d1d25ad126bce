/* Process logging: one line per call on stderr, text or JSON, safe from any thread. */
#include "common/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Atomic: SIGHUP changes them on the loop thread while other threads log. */
static _Atomic int g_level = MD_LOG_INFO;
static atomic_bool g_json;

static const char *const level_names[] = { "error", "warn", "info", "debug" };

void md_log_setup(enum md_log_level level, bool json)
{
	atomic_store_explicit(&g_level, (int)level, memory_order_relaxed);
	atomic_store_explicit(&g_json, json, memory_order_relaxed);
}

int md_log_level_parse(const char *s)
{
	for (int i = 0; i < 4; i++)
		if (strcmp(s, level_names[i]) == 0)
			return i;
	return -1;
}

bool md_log_enabled(enum md_log_level level)
{
	return (int)level <= atomic_load_explicit(&g_level, memory_order_relaxed);
}

static size_t stamp(char *buf, size_t cap)
{
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
	n += (size_t)snprintf(buf + n, cap - n, ".%03ldZ", ts.tv_nsec / 1000000);
	return n;
}

/* Append s to buf as the inside of a JSON string. */
static size_t json_escape(char *buf, size_t pos, size_t cap, const char *s)
{
	for (; *s && pos + 7 < cap; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\') {
			buf[pos++] = '\\';
			buf[pos++] = (char)c;
		} else if (c < 0x20) {
			pos += (size_t)snprintf(buf + pos, cap - pos, "\\u%04x", c);
		} else {
			buf[pos++] = (char)c;
		}
	}
	return pos;
}

static void emit(char *line, size_t n)
{
	/* One write per line keeps lines from different threads whole. */
	ssize_t w = write(STDERR_FILENO, line, n);
	(void)w;
}

void md_log(enum md_log_level level, const char *fmt, ...)
{
	if (!md_log_enabled(level))
		return;
	char msg[2048], line[4096];
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (m < 0)
		return;
	char ts[40];
	stamp(ts, sizeof(ts));
	size_t n;
	if (atomic_load_explicit(&g_json, memory_order_relaxed)) {
		n = (size_t)snprintf(line, sizeof(line), "{\"ts\":\"%s\",\"level\":\"%s\",\"msg\":\"", ts,
				     level_names[level]);
		n = json_escape(line, n, sizeof(line) - 4, msg);
		memcpy(line + n, "\"}\n", 3);
		n += 3;
	} else {
		n = (size_t)snprintf(line, sizeof(line) - 1, "%s %s %s", ts, level_names[level], msg);
		if (n > sizeof(line) - 2)
			n = sizeof(line) - 2;
		line[n++] = '\n';
	}
	emit(line, n);
}

void md_log_access(const char *method, const char *path, int status, unsigned long req_id,
		   unsigned tokens_in, unsigned tokens_out, double ttft_s, double dur_s)
{
	if (!md_log_enabled(MD_LOG_INFO))
		return;
	char line[2048], ts[40];
	stamp(ts, sizeof(ts));
	size_t n;
	if (atomic_load_explicit(&g_json, memory_order_relaxed)) {
		n = (size_t)snprintf(line, sizeof(line), "{\"ts\":\"%s\",\"level\":\"info\",\"req\":%lu,"
				     "\"method\":\"", ts, req_id);
		n = json_escape(line, n, 600, method);
		n += (size_t)snprintf(line + n, sizeof(line) - n, "\",\"path\":\"");
		n = json_escape(line, n, 1200, path);
		n += (size_t)snprintf(line + n, sizeof(line) - n,
				      "\",\"status\":%d,\"tokens_in\":%u,\"tokens_out\":%u,"
				      "\"ttft_ms\":%.1f,\"duration_ms\":%.1f}\n",
				      status, tokens_in, tokens_out, ttft_s * 1e3, dur_s * 1e3);
	} else {
		n = (size_t)snprintf(line, sizeof(line),
				     "%s info req=%lu %s %.512s %d in=%u out=%u ttft=%.1fms dur=%.1fms\n",
				     ts, req_id, method, path, status, tokens_in, tokens_out,
				     ttft_s * 1e3, dur_s * 1e3);
	}
	if (n >= sizeof(line))
		n = sizeof(line) - 1;
	emit(line, n);
}
