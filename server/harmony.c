/* The output side of gpt-oss's harmony format (see harmony.h).
 *
 * DESIGN. A two-state scanner over text: a header is collected whole (it is short) until
 * <|message|>; a body streams out as it comes, holding back only a tail that could be the
 * start of a marker ending it, so reasoning and content reach the client token by token.
 * Rejected: parsing on token ids. The server's output chain is text (stop strings, tool calls
 * and logprob offsets all work on it), the markers are single control tokens whose text is
 * unique, and a text parser also reads a harmony stream that was spelled out byte by byte. */
#include "server/harmony.h"

#include <string.h>

static const char *const body_end[] = { "<|end|>", "<|return|>", "<|call|>", "<|start|>",
					"<|channel|>" };
#define N_BODY_END (sizeof(body_end) / sizeof(body_end[0]))
#define MSG "<|message|>"
#define CHANNEL "<|channel|>"

void md_harmony_init(struct md_harmony *h, md_harmony_emit_cb emit, void *arg)
{
	memset(h, 0, sizeof(*h));
	h->emit = emit;
	h->arg = arg;
	h->_state = HM_HEADER;
}

static void out(struct md_harmony *h, int dest, const char *s, size_t n)
{
	if (n && dest >= 0)
		h->emit(h->arg, (enum md_harmony_ev)dest, s, n);
}

static const char *find(const char *s, size_t n, const char *pat, size_t m)
{
	for (size_t i = 0; i + m <= n; i++)
		if (memcmp(s + i, pat, m) == 0)
			return s + i;
	return NULL;
}

/* Where a header of n bytes sends its body: analysis -> reasoning, addressed to a tool
 * (" to=") -> dropped, anything else -> content. */
static int header_dest(const char *hd, size_t n)
{
	if (find(hd, n, " to=", 4) || (n >= 3 && memcmp(hd, "to=", 3) == 0))
		return -1;
	const char *c = find(hd, n, CHANNEL, sizeof(CHANNEL) - 1);
	if (c) {
		const char *name = c + sizeof(CHANNEL) - 1, *end = hd + n;
		size_t k = 0;
		while (name + k < end && name[k] != ' ' && name[k] != '<')
			k++;
		if (k == 8 && memcmp(name, "analysis", 8) == 0)
			return MD_HARMONY_REASONING;
	}
	return MD_HARMONY_CONTENT;
}

/* The longest suffix of s (n bytes) that is a proper prefix of a body end marker. */
static size_t held_tail(const char *s, size_t n)
{
	size_t best = 0;
	for (size_t k = 0; k < N_BODY_END; k++) {
		size_t m = strlen(body_end[k]);
		for (size_t len = m - 1 < n ? m - 1 : n; len > best; len--)
			if (memcmp(s + n - len, body_end[k], len) == 0) {
				best = len;
				break;
			}
	}
	return best;
}

void md_harmony_push(struct md_harmony *h, const char *s, size_t n)
{
	while (n > 0) {
		size_t room = sizeof(h->_buf) - h->_n, take = n < room ? n : room;
		memcpy(h->_buf + h->_n, s, take);
		h->_n += take;
		s += take;
		n -= take;
		char rest[sizeof(h->_buf)];
		size_t n_rest = 0;
		if (h->_state == HM_HEADER) {
			const char *m = find(h->_buf, h->_n, MSG, sizeof(MSG) - 1);
			if (!m) {
				if (h->_n > MD_HARMONY_MAX_HEADER) { /* not harmony: content */
					out(h, MD_HARMONY_CONTENT, h->_buf, h->_n);
					h->_n = 0;
					h->_state = HM_BODY;
					h->_dest = MD_HARMONY_CONTENT;
				}
				continue;
			}
			h->_dest = header_dest(h->_buf, (size_t)(m - h->_buf));
			m += sizeof(MSG) - 1;
			n_rest = h->_n - (size_t)(m - h->_buf);
			memcpy(rest, m, n_rest);
			h->_n = 0;
			h->_state = HM_BODY;
		} else {
			const char *first = NULL;
			size_t which = 0;
			for (size_t k = 0; k < N_BODY_END; k++) {
				const char *p = find(h->_buf, h->_n, body_end[k], strlen(body_end[k]));
				if (p && (!first || p < first)) {
					first = p;
					which = k;
				}
			}
			if (!first) {
				size_t hold = held_tail(h->_buf, h->_n);
				out(h, h->_dest, h->_buf, h->_n - hold);
				memmove(h->_buf, h->_buf + h->_n - hold, hold);
				h->_n = hold;
				continue;
			}
			out(h, h->_dest, h->_buf, (size_t)(first - h->_buf));
			/* <|channel|> without <|end|><|start|> first: it begins the next header. */
			const char *after = first + (strcmp(body_end[which], CHANNEL) == 0
						     ? 0 : strlen(body_end[which]));
			n_rest = h->_n - (size_t)(after - h->_buf);
			memcpy(rest, after, n_rest);
			h->_n = 0;
			h->_state = HM_HEADER;
		}
		/* The state changed: what followed the marker is parsed in the new state. */
		md_harmony_push(h, rest, n_rest);
	}
}

void md_harmony_finish(struct md_harmony *h)
{
	if (h->_state == HM_BODY)
		out(h, h->_dest, h->_buf, h->_n);
	else if (!find(h->_buf, h->_n, CHANNEL, sizeof(CHANNEL) - 1) &&
		 !find(h->_buf, h->_n, "<|start|>", 9)) /* plain text, not a cut-off header */
		out(h, MD_HARMONY_CONTENT, h->_buf, h->_n);
	h->_n = 0;
	h->_state = HM_HEADER;
}
