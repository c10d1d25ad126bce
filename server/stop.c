/* Stop strings: the matcher that holds back text which could still begin a stop string. */
#include "server/stop.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"

void md_stop_init(struct md_stop *s, char *const *stops, size_t n)
{
	memset(s, 0, sizeof(*s));
	s->_stops = stops;
	s->_n_stops = n;
}

void md_stop_release(struct md_stop *s)
{
	free(s->_pend);
	memset(s, 0, sizeof(*s));
}

int md_stop_push(struct md_stop *s, const char *text, size_t n)
{
	if (n == 0)
		return 0;
	if (s->_len + n + 1 > s->_cap) {
		size_t nc = s->_cap ? s->_cap : 256;
		while (nc < s->_len + n + 1)
			nc *= 2;
		char *np = realloc(s->_pend, nc);
		if (!np)
			return -ENOMEM;
		s->_pend = np;
		s->_cap = nc;
	}
	memcpy(s->_pend + s->_len, text, n);
	s->_len += n;
	s->_pend[s->_len] = 0;
	return 0;
}

size_t md_stop_ready(const struct md_stop *s, bool final, bool *hit)
{
	*hit = false;
	/* the earliest occurrence of any stop string */
	size_t best = (size_t)-1;
	for (size_t i = 0; i < s->_n_stops && s->_len; i++) {
		const char *p = memmem(s->_pend, s->_len, s->_stops[i], strlen(s->_stops[i]));
		if (p && (size_t)(p - s->_pend) < best)
			best = (size_t)(p - s->_pend);
	}
	if (best != (size_t)-1) {
		*hit = true;
		return best;
	}
	if (final)
		return s->_len;
	/* hold back the longest tail that is a proper prefix of some stop string */
	size_t hold = 0;
	for (size_t i = 0; i < s->_n_stops; i++) {
		size_t sl = strlen(s->_stops[i]);
		MD_ASSERT(sl > 0);
		size_t maxh = sl - 1 < s->_len ? sl - 1 : s->_len;
		for (size_t h = maxh; h > hold; h--)
			if (memcmp(s->_pend + s->_len - h, s->_stops[i], h) == 0) {
				hold = h;
				break;
			}
	}
	return s->_len - hold;
}

const char *md_stop_text(const struct md_stop *s)
{
	return s->_pend ? s->_pend : "";
}

size_t md_stop_pending(const struct md_stop *s)
{
	return s->_len;
}

void md_stop_consume(struct md_stop *s, size_t n)
{
	MD_ASSERT(n <= s->_len);
	if (n == 0)
		return;
	memmove(s->_pend, s->_pend + n, s->_len - n);
	s->_len -= n;
	s->_pend[s->_len] = 0;
}

void md_stop_clear(struct md_stop *s)
{
	s->_len = 0;
	if (s->_pend)
		s->_pend[0] = 0;
}
