/* Stop strings: the matcher that holds back text which could still begin a stop string. */
#ifndef MD_STOP_H
#define MD_STOP_H

/*
 * DESIGN
 * One matcher per choice sits between the detokenizer and the emitter of the output chain
 * (server/gen.c). Text goes in as the detokenizer completes it (md_stop_push); the caller then
 * asks what may leave (md_stop_ready) and consumes that much from the front of the pending
 * text (md_stop_consume). A stop string may span any number of pushes, so the matcher keeps
 * back the longest tail of the pending text that is a proper prefix of some stop string;
 * once the text can no longer become a stop string it is released. When a stop string
 * occurs, the text before its earliest occurrence is released and the rest (the stop string
 * and anything after it) is never shown. At the end of the generation (final) whatever is
 * held back is released.
 *
 * Stop strings are valid UTF-8 (they come from a validated JSON body) and so is the pushed
 * text (the detokenizer emits only complete characters); a stop string never begins with a
 * continuation byte, so every release ends on a character boundary.
 *
 * Loop thread only, like the generation it belongs to; no locking.
 */

#include <stdbool.h>
#include <stddef.h>

struct md_stop {
	char *const *_stops; /* borrowed: (_n_stops) non-empty NUL-terminated strings, valid
			      * until md_stop_release */
	size_t _n_stops;
	char *_pend;         /* owned: (_cap) pending text, NUL-terminated, not yet released */
	size_t _len, _cap;
};

/* stops: n non-empty strings, borrowed for the matcher's lifetime (n may be 0: then every
 * byte is released as soon as it is pushed). */
void md_stop_init(struct md_stop *s, char *const *stops, size_t n);
void md_stop_release(struct md_stop *s);

/* Append n bytes of text. Returns 0 or -ENOMEM (the text is then dropped, the pending text
 * unchanged). */
int md_stop_push(struct md_stop *s, const char *text, size_t n);

/* How many bytes at the front of the pending text may be released now. *hit is set when a
 * stop string occurs: the count is then the offset of its earliest occurrence and the choice
 * is over. Otherwise the count is everything but the held-back tail, or everything when
 * final is true (the generation ended). Does not change the matcher. */
size_t md_stop_ready(const struct md_stop *s, bool final, bool *hit);

/* The pending text (NUL-terminated; "" when empty) and its length. */
const char *md_stop_text(const struct md_stop *s);
size_t md_stop_pending(const struct md_stop *s);

/* Drop the first n pending bytes (n <= md_stop_pending). */
void md_stop_consume(struct md_stop *s, size_t n);
/* Drop all pending text (after a stop string: the rest is never shown). */
void md_stop_clear(struct md_stop *s);

#endif
