/* Tokenizer built from GGUF metadata: byte-level BPE (gpt2) and SentencePiece BPE (llama). */
#ifndef MD_TOKENIZER_H
#define MD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct md_gguf;
struct md_tokenizer; /* opaque; immutable after load, so any number of threads may use it */

/* GGUF token types (tokenizer.ggml.token_type). */
enum md_token_type {
	MD_TOKEN_UNDEFINED = 0,
	MD_TOKEN_NORMAL = 1,
	MD_TOKEN_UNKNOWN = 2,
	MD_TOKEN_CONTROL = 3,
	MD_TOKEN_USER_DEFINED = 4,
	MD_TOKEN_UNUSED = 5,
	MD_TOKEN_BYTE = 6,
};

/* Build a tokenizer from g's tokenizer.* keys. Everything needed is copied, so g may be closed
 * afterwards. Supported: tokenizer.ggml.model "gpt2" with tokenizer.ggml.pre "default"/"gpt2",
 * "qwen2" (with NFC), "llama-bpe"/"llama3", "deepseek-v3"; and model "llama" (SentencePiece
 * BPE with scores and <0xNN> byte fallback). Returns 0, or -EINVAL / -ENOTSUP / -ENOMEM with one
 * line in err; *out is then NULL. */
int md_tokenizer_load(struct md_tokenizer **out, const struct md_gguf *g, char *err,
		      size_t errlen);
void md_tokenizer_free(struct md_tokenizer *t);

uint32_t md_tokenizer_n_vocab(const struct md_tokenizer *t);
int32_t md_tokenizer_bos(const struct md_tokenizer *t); /* -1 if none */
int32_t md_tokenizer_eos(const struct md_tokenizer *t); /* -1 if none */
/* True for ids that end generation: eos, eot, eom and control tokens such as <|im_end|>,
 * <|eot_id|>, <|endoftext|>, <｜end▁of▁sentence｜>. */
bool md_tokenizer_is_eog(const struct md_tokenizer *t, int32_t id);
bool md_tokenizer_add_bos(const struct md_tokenizer *t);
/* Token type of id (MD_TOKEN_UNDEFINED for an id out of range). */
enum md_token_type md_tokenizer_type(const struct md_tokenizer *t, int32_t id);

/* Encode UTF-8 text (len bytes; NUL bytes are ordinary characters).
 *
 * add_bos: prepend BOS (and append EOS) when the model's metadata asks for it.
 * parse_special: match control tokens (<|im_start|>, <s>, <|begin_of_text|> ...) in the text.
 *   User-defined added tokens (Qwen3's <think>, DeepSeek's <｜User｜>: "special": false in
 *   tokenizer.json) are matched whatever parse_special says, as Hugging Face tokenizers and
 *   llama.cpp do; without it, text that spells a control token is tokenized as plain text.
 * Invalid UTF-8: every maximal ill-formed subpart (Unicode 15 §3.9, the WHATWG/Python
 *   "replace" rule) becomes U+FFFD before tokenizing, so ids always decode to valid UTF-8 and
 *   match what a client that decoded the bytes itself would get.
 *
 * Returns the number of ids (>= 0) written into a malloc'd *ids (caller frees; NULL when 0
 * ids), or -ENOMEM / -EINVAL (*ids is then NULL). Thread-safe. */
int md_tokenizer_encode(const struct md_tokenizer *t, const char *text, size_t len, bool add_bos,
			bool parse_special, int32_t **ids);

/* Raw bytes of one token: byte-level decoded (gpt2), "▁" -> ' ' and <0xNN> -> byte (llama);
 * control and user-defined tokens give their text. Writes at most cap bytes (not
 * NUL-terminated) and returns the full length, which may exceed cap; -EINVAL for a bad id. */
int md_tokenizer_piece(const struct md_tokenizer *t, int32_t id, char *buf, size_t cap);
/* Token text as stored in the vocab (for /tokenize "pieces" and logprobs); NULL for a bad id.
 * Borrowed: valid until md_tokenizer_free; not NUL-terminated in general. */
const char *md_tokenizer_token_text(const struct md_tokenizer *t, int32_t id, size_t *len);
/* Find a token id by exact vocab text, -1 if none. */
int32_t md_tokenizer_find(const struct md_tokenizer *t, const char *text, size_t len);

/* Decode a whole id sequence into malloc'd NUL-terminated text (*out, length *out_len), with the
 * same rules as the streaming detokenizer below (leading-space rule, U+FFFD for bytes that do
 * not form UTF-8). skip_special drops control tokens. Returns 0 or -ENOMEM / -EINVAL. */
int md_tokenizer_decode(const struct md_tokenizer *t, const int32_t *ids, size_t n,
			bool skip_special, char **out, size_t *out_len);

/* Streaming detokenizer: one per sequence, emits only complete UTF-8.
 *
 * A token's bytes may end inside a character (byte-level BPE, <0xNN> byte fallback); those
 * bytes wait in the state until the character completes, so no character is ever split across
 * two pushes. Bytes that can never form a character become U+FFFD (byte-level BPE: one per
 * maximal ill-formed subpart, as Hugging Face's ByteLevel decoder; SentencePiece: one per byte,
 * as its ByteFallback decoder), at once when known, or at flush. A control token arriving while
 * bytes wait first turns them into U+FFFD: a character cannot continue across a control token.
 * (md_tokenizer_decode, which sees the whole sequence, goes further for SentencePiece, as Hugging
 * Face does: a run of byte tokens that is not UTF-8 as a whole is U+FFFD byte for byte, the
 * valid characters in it too; a stream cannot wait for the end of every run.)
 *
 * SentencePiece leading-space rule: for a "llama" tokenizer that adds a space prefix, the first
 * text of the sequence loses one leading space (what the encoder added), as Hugging Face's
 * decoder does (its Strip decoder on the whole text). A control token rendered before it (BOS,
 * unless skipped) is text: "<s> Hello" keeps its space, as in Hugging Face's decode, and so does
 * the text after any added token (encode then decode does not give back "<s>Hello"). A caller
 * that streams a continuation of earlier text (raw completion after a prompt) clears
 * lstrip_first after md_detok_init to keep the space. */
struct md_detok {
	const struct md_tokenizer *tok; /* borrowed: must outlive the detok */
	bool skip_special;  /* drop control tokens (default false: they render as their text) */
	bool lstrip_first;  /* strip one leading space from the first text (see above) */
	bool _seen_text;    /* some text was written (an added token's text too) */
	uint8_t _n_pend;
	unsigned char _pend[4]; /* bytes of an incomplete character */
};

void md_detok_init(struct md_detok *d, const struct md_tokenizer *t);
/* Append one token; writes the newly completed text (maybe 0 bytes) to out, which must hold
 * at least 64 + the token's piece length bytes (MD_DETOK_MIN_CAP covers every token up to 192
 * bytes). Returns bytes written, or -EINVAL (bad id) / -ENOSPC (cap too small; state
 * unchanged). */
#define MD_DETOK_MIN_CAP 256
int md_detok_push(struct md_detok *d, int32_t id, char *out, size_t cap);
/* At the end: waiting bytes become U+FFFD. Returns bytes written (cap >= 16 suffices). */
int md_detok_flush(struct md_detok *d, char *out, size_t cap);

#endif
