/* Constrained decoding: a GBNF-like grammar over bytes, and the set of tokens it allows next. */
#ifndef MD_GRAMMAR_H
#define MD_GRAMMAR_H

/*
 * DESIGN
 *
 * Three objects, by lifetime:
 *
 *   struct md_grammar  the compiled grammar: rules of alternatives of elements, where an
 *                      element is a byte set or a reference to a rule. Text is compiled to
 *                      bytes up front (a character class over code points becomes the UTF-8
 *                      byte sequences of its ranges), so the matcher never decodes UTF-8 and
 *                      a token's bytes are walked as they are, even when a token ends inside a
 *                      character. Immutable and reference-counted (atomically): the n choices
 *                      of a request share one, made on the loop thread, used on the engine's.
 *   struct md_gvocab   the vocabulary as a byte trie, stored flat in preorder (each node: its
 *                      byte, depth, the tokens ending there, the index past its subtree), plus
 *                      which tokens end generation. Built once per model; immutable.
 *   struct md_gmatch   one sequence's position in the grammar. A position is a set of
 *                      parse stacks (the grammar is a pushdown automaton and may be ambiguous);
 *                      stacks are hash-consed nodes (element, parent), so a set of stacks is a
 *                      sorted list of node ids and is itself interned as a state id. The
 *                      matcher caches, per state, the transition on each byte and the token
 *                      mask, so a state seen before costs one table lookup, however many
 *                      tokens the vocabulary has.
 *
 * The mask of a new state walks the trie once: a node's state is its parent's state advanced
 * by the node's byte; a dead state skips the whole subtree; every token ending at a live node
 * is allowed. Rejected: checking each token separately (n_vocab walks from the root instead
 * of one shared walk) and precomputing masks for every grammar position up front (the
 * positions of a recursive grammar are unbounded; the ones a sequence visits are few).
 *
 * End of generation: a state is accepting when one of its stacks is empty (the root rule is
 * complete); only then are the vocabulary's end-of-generation tokens allowed. Control tokens
 * are never allowed otherwise. A state in which the grammar is complete and no byte can follow
 * allows nothing but the end tokens, so generation stops there.
 *
 * Left recursion (a rule that can reach itself without consuming a byte) is refused at
 * compile time; the matcher's expansion relies on it. A state holds at most
 * MD_GRAMMAR_MAX_STACKS stacks and a matcher at most MD_GRAMMAR_MAX_STATES states: past them
 * the matcher reports -E2BIG rather than growing without bound.
 *
 * Speculative decoding: md_gmatch_state / md_gmatch_set_state save and restore a position
 * (an int), so rejected drafted tokens roll back for free.
 *
 * Threads: md_grammar and md_gvocab may be read from any thread; a md_gmatch belongs to one.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct md_tokenizer;

#define MD_GRAMMAR_MAX_STACKS 4096
#define MD_GRAMMAR_MAX_STATES 50000
#define MD_GRAMMAR_MAX_REPEAT 10000 /* largest bound in x{m,n} */

/*
 * Grammar text, GBNF-like:
 *
 *   root   ::= "{" ws pair ("," ws pair)* "}"     # rules; "root" is where matching starts
 *   pair   ::= string ":" ws value
 *   ws     ::= [ \t\n]*
 *
 * Elements: "literal" (escapes \n \r \t \\ \" \' \[ \] \xHH \uHHHH \UHHHHHHHH), [class] and
 * [^class] over code points (ranges a-z, the same escapes), . (any character), rule names
 * ([A-Za-z0-9_-]+), ( groups ), postfix * + ? {m} {m,} {m,n}; | separates alternatives;
 * # starts a comment. Newlines are ordinary whitespace: a rule ends where the next
 * "name ::=" begins. Text is UTF-8.
 */
struct md_grammar; /* opaque, immutable, reference-counted */

/* Compile text (len bytes). Returns 0 with *out holding one reference, or -EINVAL with a
 * one-line message in err ("line L col C: ..."), or -ENOMEM / -E2BIG (too large). */
int md_grammar_parse(const char *text, size_t len, struct md_grammar **out, char *err,
		     size_t errlen);
struct md_grammar *md_grammar_ref(struct md_grammar *g);
/* Drop one reference; the last frees the grammar. NULL is ignored. */
void md_grammar_unref(struct md_grammar *g);
/* Sizes, for logs and tests. */
uint32_t md_grammar_n_rules(const struct md_grammar *g);
uint32_t md_grammar_n_elements(const struct md_grammar *g);

/* The vocabulary as the matcher sees it. */
struct md_gvocab; /* opaque, immutable */

/* From a tokenizer: every normal, byte and user-defined token with its raw bytes; control and
 * unused tokens are never allowed, except the end-of-generation ones at accepting states.
 * Returns 0 or -ENOMEM. */
int md_gvocab_new(struct md_gvocab **out, const struct md_tokenizer *t);
/* From explicit pieces (tests, benchmarks): token i has bytes pieces[i] (lens[i] bytes; 0 =
 * never allowed) and ends generation when eog[i]. Returns 0 or -ENOMEM. */
int md_gvocab_new_pieces(struct md_gvocab **out, const char *const *pieces, const size_t *lens,
			 const bool *eog, uint32_t n_vocab);
void md_gvocab_free(struct md_gvocab *v);
uint32_t md_gvocab_n_vocab(const struct md_gvocab *v);

/* One sequence's matcher. */
struct md_gmatch; /* opaque */

/* A matcher at the start of g (takes its own reference) over v (borrowed: must outlive the
 * matcher). Returns 0, -ENOMEM, or -E2BIG. */
int md_gmatch_new(struct md_gmatch **out, struct md_grammar *g, const struct md_gvocab *v);
void md_gmatch_free(struct md_gmatch *m);

/*
 * The tokens allowed next, as the sampler's bitmap (sampler.h md_sampler_ctx.allowed:
 * ceil(n_vocab / 32) words, bit t % 32 of word t / 32). *bits is borrowed: valid until the
 * next call on m. Returns 0, -ENOMEM or -E2BIG (the grammar outgrew its bounds); the mask may
 * be all zero when the state is dead (only after md_gmatch_accept was bypassed).
 */
int md_gmatch_mask(struct md_gmatch *m, const uint32_t **bits);
/*
 * md_gmatch_mask for a sequence that may generate at most budget more tokens (this one
 * included): tokens after which the grammar could no longer be completed within the rest of
 * the budget are removed, so a constrained output closes (its strings, arrays, objects)
 * instead of being cut off at max_tokens. The completion estimate counts bytes, so it is
 * exact for vocabularies where every byte is a token (byte-level BPE, SentencePiece with
 * byte fallback). Costs nothing extra while the budget is loose (each state records how far
 * its tokens can push the completion), one more trie walk per token near the end. When no
 * token fits by that estimate (a budget short from the start) the mask keeps the tokens that
 * bring the end nearest, which usually still closes in time, since tokens hold several bytes.
 * Same returns.
 */
int md_gmatch_mask_budget(struct md_gmatch *m, uint32_t budget, const uint32_t **bits);
/* Fewest bytes that complete the grammar from the current state (0 when it may end). */
uint32_t md_gmatch_min_left(const struct md_gmatch *m);
/* Advance by one token. Returns 0, -EINVAL when the grammar does not allow it (state
 * unchanged), -ENOMEM or -E2BIG. An end-of-generation token is accepted only at an accepting
 * state and leaves the state as it is. */
int md_gmatch_accept(struct md_gmatch *m, int32_t token);
/* Advance by raw bytes (forced text). Same returns as md_gmatch_accept. */
int md_gmatch_accept_bytes(struct md_gmatch *m, const char *s, size_t n);
/* The grammar may end here (end-of-generation tokens are allowed). */
bool md_gmatch_can_end(const struct md_gmatch *m);
/* The grammar must end here: accepting, and no byte can follow. */
bool md_gmatch_is_final(struct md_gmatch *m);
/* The current position (a state id) and a jump back to one this matcher returned before. */
int32_t md_gmatch_state(const struct md_gmatch *m);
void md_gmatch_set_state(struct md_gmatch *m, int32_t state);
/* States interned so far (cache size; tests and benchmarks). */
uint32_t md_gmatch_n_states(const struct md_gmatch *m);

#endif
