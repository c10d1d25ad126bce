/* The engine thread: model ownership, request queue, continuous-batching scheduler, events. */
#ifndef MD_ENGINE_H
#define MD_ENGINE_H

/*
 * DESIGN
 * The engine runs on one thread of its own that loads the model, then loops: take new
 * requests and cancellations from the submit queue, pick a micro-batch (decode tokens of
 * running sequences first, then prefill chunks) under a per-step token budget, run the
 * forward pass, sample, and post token events to the event queue. The loop thread (libuv)
 * is the only other party: it submits requests and cancellations (md_engine_submit,
 * md_engine_cancel) and drains events (md_engine_poll) when the wake callback fires.
 * Requests are referred to by id in both directions; ids the receiver no longer knows are
 * dropped silently.
 *
 * The tokenizer and chat-template helpers below read immutable state published when the
 * model finished loading (md_engine_state() == MD_ENGINE_READY); they may be called from any
 * thread after that point.
 *
 * Layers, lowest first; each calls only the ones before it:
 *   common/          log, assert (thread owners)
 *   engine/kern/     cpu dispatch, kernels, matmul, thread pool (knows weight types only)
 *   engine/quant, gguf, model     weight types, the file, the architecture binding
 *   engine/kv_cache, router, expert source, forward     one batched forward pass
 *   engine/forward_dev, dev_place  the same pass on a device (backend_fwd.h ops), where
 *   engine/tokenizer, chat_template, text               the text side of a model
 *   engine/sampler, sched         per-sequence sampling; which tokens run in a step
 *   engine/engine    (this file)  the thread, the queues, loading, the step loop
 *   server/          HTTP, OpenAI API; it sees only this header
 * cuda/ implements engine/backend.h and is linked in, never called by name.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/grammar.h"
#include "engine/sampler.h"
#include "engine/spec.h"

struct md_engine; /* opaque */

/* Called on the engine thread when the event queue goes from empty to non-empty, and on
 * state changes. Must be cheap and thread-safe (uv_async_send). */
typedef void (*md_engine_wake_cb)(void *arg);

struct md_engine_config {
	const char *model_path;     /* borrowed: read during md_engine_start's thread only */
	const char *chat_template;  /* borrowed, may be NULL: built-in template name override */
	int n_threads;              /* forward-pass threads; 0 = number of cores */
	uint32_t n_ctx;             /* max tokens per sequence; 0 = model's training context */
	uint32_t kv_blocks;         /* KV pool size in blocks; 0 = derive from kv_mem_mb */
	uint32_t kv_mem_mb;         /* KV budget when kv_blocks == 0 */
	uint32_t max_seqs;          /* sequences running at once */
	uint32_t step_tokens;       /* token budget of one forward step */
	uint32_t max_queue;         /* waiting requests before submit answers -EAGAIN */
	bool progress;              /* print load progress on stderr */
	bool no_prefix_cache;       /* compute every prompt in full (default: reuse cached blocks) */
	bool kv_f32;                /* latent attention's cache rows in float, not half */
	/* Load progress as one line ("loading weights 40%"), called on the engine thread while
	 * loading (for the service manager's STATUS=); NULL for none. Must be thread-safe. */
	void (*status_cb)(void *arg, const char *status);
	void *status_arg;           /* borrowed: passed to status_cb */
	const char *trace_routing;  /* borrowed, may be NULL: write a routing trace to this file
				     * (engine/route_trace.h) */
	int expert_batching;        /* expert-aware batching (sched.h) when decoders exceed a step:
				     * 1 on, 0 off, -1 where experts go through the store (then it
				     * also prefers sequences whose experts are resident) */
	/* Expert store (engine/experts.h, engine/mem_plan.h); zeroes give the defaults. */
	double expert_cache_mb;     /* host budget for experts: 0 auto (the store only when the
				     * file exceeds 80% of the memory limit), -1 never, > 0 MiB */
	int64_t device_expert_mb;   /* device tier budget (0: none) */
	const char *expert_policy;  /* borrowed (copied at start), NULL: "pred" */
	const char *expert_device;  /* borrowed (copied), NULL: "auto"; the device tier's device
				     * (engine/expert_tiers.h: auto, none, cuda, sim[:COPY:COMPUTE]) */
	bool no_expert_prefetch;    /* no pre-gating prefetch */
	bool no_expert_fill;        /* leave the expert cache empty at start */
	const char *device;         /* borrowed (copied), NULL: "auto": where the forward pass
				     * runs (engine/dev_place.h: auto, cpu, cuda, sim[:MIB]) */
	const char *state_dir;      /* borrowed (copied), NULL: no warm restart state */
	/* Speculative decoding (engine/spec.h). */
	enum md_spec_drafter spec;  /* requests' default: MD_SPEC_OFF (also for DEFAULT), NGRAM
				       or DRAFT (needs draft_model_path; else NGRAM's fallback:
				       off) */
	uint32_t spec_k;            /* default and largest drafted tokens per step; 0 = 16 */
	bool spec_fixed;            /* draft max k every step (no controller): for tests */
	const char *draft_model_path; /* borrowed, may be NULL: a GGUF with the model's
					 vocabulary; loading fails when it cannot be used */
	/* Self-speculation (engine/self_draft.h, drafter MD_SPEC_SELF): draft passes route this
	 * many experts per token (0: 1) and skip these layers (a comma list, borrowed (copied),
	 * NULL: none). Available on MoE models, or on any model with layers skipped. */
	uint32_t spec_self_experts;
	const char *spec_self_skip;
};

enum md_engine_state {
	MD_ENGINE_LOADING = 0,
	MD_ENGINE_READY = 1,
	MD_ENGINE_FAILED = 2,
	MD_ENGINE_STOPPED = 3,
};

enum md_finish {
	MD_FINISH_NONE = 0,
	MD_FINISH_STOP,      /* end-of-generation token, or the grammar is complete */
	MD_FINISH_LENGTH,    /* max_tokens or the context limit */
	MD_FINISH_CANCELLED, /* md_engine_cancel or shutdown */
	MD_FINISH_ERROR,     /* engine error; see err */
};

/* One generation request. Ownership passes to the engine on a successful submit. */
struct md_engine_req {
	uint64_t id;                 /* caller-chosen, unique among live requests */
	int32_t *prompt;             /* owned: (n_prompt) token ids, n_prompt >= 1 */
	uint32_t n_prompt;
	uint32_t max_tokens;         /* >= 1; the engine also stops at its context limit */
	bool ignore_eos;
	struct md_sampling sampling; /* owns its logit_bias array */
	struct md_grammar *grammar;  /* owned reference, or NULL: constrained decoding; the
					engine masks every sampled token with it (grammar.h) */
	struct md_gmatch *_gm;       /* owned: the grammar's matcher, made by the engine thread */
	struct md_spec_opts spec;    /* speculation for this request (zero: the engine's) */
	struct md_engine_req *_next; /* queue link */
	struct md_engine_event *_done; /* owned: the DONE event, allocated by md_engine_submit so
					  that a request always gets one */
};

/* Free a request the engine handed back or never took (its prompt, sampling and event). */
void md_engine_req_free(struct md_engine_req *r);

#define MD_ENGINE_MAX_TOP MD_SAMPLER_MAX_TOP

enum md_event_kind {
	MD_EV_TOKEN,  /* one generated token (with its logprobs when asked) */
	MD_EV_DONE,   /* the request left the engine; finish and counts are set */
	MD_EV_STATE,  /* the engine changed state (loaded, failed); req_id is 0 */
};

struct md_engine_event {
	enum md_event_kind kind;
	uint64_t req_id;
	int32_t token;
	float logprob;               /* log-probability of token under the model */
	uint8_t n_top;               /* entries in top[] (0 unless top_logprobs asked) */
	struct { int32_t id; float logprob; } top[MD_ENGINE_MAX_TOP];
	enum md_finish finish;       /* MD_EV_DONE */
	int err;                     /* MD_EV_DONE with MD_FINISH_ERROR: negative code */
	uint32_t n_prompt, n_gen;    /* MD_EV_DONE: tokens processed / generated */
	uint32_t n_cached;           /* MD_EV_DONE: prompt tokens taken from the prefix cache */
	uint32_t n_drafted, n_accepted; /* speculation so far (MD_EV_TOKEN and MD_EV_DONE):
					   drafted tokens verified, and accepted */
	uint32_t n_verify;           /* steps that verified drafts, so far */
	struct md_engine_event *next; /* owned: rest of a polled list */
};

struct md_engine_stats {
	uint32_t waiting, running;
	uint32_t kv_blocks_used, kv_blocks_total;
	uint64_t steps, preemptions;
	uint64_t prompt_tokens, gen_tokens; /* processed in forward passes, each once */
	uint64_t recomputed_tokens;         /* computed again after a preemption */
	uint64_t prefix_queries, prefix_hits, prefix_hit_tokens; /* see md_sched_stats */
	uint32_t prefix_blocks;             /* KV blocks registered in the prefix cache */
	uint64_t prefix_evictions;          /* registered blocks reused for other content */
	uint64_t moe_layer_steps;           /* MoE layers computed (steps x MoE layers) */
	uint64_t moe_distinct_experts;      /* distinct experts they computed, summed */
	uint64_t expert_selections;         /* steps whose decoders were chosen by experts */
	uint64_t prefill_selections;        /* steps whose prompt chunks were ordered by experts */
	/* Expert store, host tier (all 0 on the mmap path; counters since start). */
	bool experts_store;                 /* experts go through the store */
	uint64_t experts_hits, experts_misses, experts_bytes_read, experts_read_errors;
	uint64_t experts_evictions;
	double experts_stall_s;             /* time the forward pass waited for expert reads */
	uint64_t experts_prefetch_issued, experts_prefetch_used, experts_prefetch_wasted_bytes;
	uint64_t experts_prefetch_cancelled;
	uint64_t experts_predicted_used, experts_predicted_total; /* prefetch accuracy */
	uint64_t experts_steps, experts_step_distinct; /* distinct experts per step: their ratio */
	uint32_t experts_slots, experts_resident;
	uint64_t experts_cache_bytes;
	/* the store's device tier (experts_device; engine/experts.h has what each counts) */
	bool experts_device;
	uint64_t dev_hits, dev_misses, dev_compute_dev, dev_compute_host;
	uint64_t dev_uploads, dev_bytes_uploaded, dev_evictions;
	double dev_stall_s;
	uint64_t dev_prefetch_issued, dev_prefetch_used, dev_prefetch_wasted_bytes;
	uint32_t dev_resident;
	uint64_t dev_mem_bytes;
	/* the forward pass on a device (engine/dev_place.h; all 0 on the CPU) */
	bool dev_forward;
	char dev_name[128];
	uint64_t dev_mem_total;             /* the device's memory */
	uint64_t dev_mem_weights, dev_mem_kv, dev_mem_act; /* what the forward pass holds there */
	uint64_t dev_layers_routed_dev, dev_layers_routed_host; /* MoE layer passes routed where */
	uint64_t dev_graph_captures, dev_graph_launches;   /* passes captured / run as graphs */
	uint64_t spec_drafted, spec_accepted; /* drafted tokens verified, and accepted */
	uint64_t spec_verify_steps;         /* sequence-steps that verified drafts */
	uint64_t spec_emitted;              /* tokens those sequence-steps emitted */
	uint64_t spec_seq_steps;            /* decode sequence-steps of sequences with a drafter */
	uint64_t spec_proposal_steps;       /* of those, the ones its drafter proposed in (the
					       n-gram lookup found a match; a model drafter
					       always, while the sequence has room) */
	uint64_t spec_proposed;             /* tokens those proposals offered (a model drafter:
					       its room, up to the most a request may draft) */
	uint64_t spec_verify_layers;        /* MoE layer passes of steps that verified drafts */
	uint64_t spec_verify_distinct;      /* distinct experts over those layer passes */
	uint64_t spec_self_predicted;       /* experts self-speculation's drafts predicted and
					       prefetched (per layer, summed over steps) */
	uint64_t spec_self_predicted_used;  /* of those, experts the verifying step then used */
	uint64_t spec_self_used;            /* experts those verifying steps used */
};

/* Create an engine (does not start the thread). Returns 0 or -ENOMEM / -EINVAL. */
/* Whether spec is a valid md_engine_config.device; 0, or -EINVAL with what is accepted in
 * err. Any thread. */
int md_engine_check_device(const char *spec, char *err, size_t errlen);
/* Whether spec names a device for the expert store's device tier (md_engine_config
 * expert_device); 0, or -EINVAL with what is accepted in err. Any thread. */
int md_engine_check_expert_device(const char *spec, char *err, size_t errlen);

int md_engine_new(struct md_engine **out, const struct md_engine_config *cfg,
		  md_engine_wake_cb wake, void *wake_arg);
/* Start the thread: it loads the model (state LOADING -> READY or FAILED) then serves.
 * The config strings are copied. Returns 0 or a negative errno. */
int md_engine_start(struct md_engine *e);
/* Ask the thread to stop: every queued and running request ends with MD_FINISH_CANCELLED;
 * then join it. Safe to call once, from the thread that created the engine. */
void md_engine_stop(struct md_engine *e);
void md_engine_free(struct md_engine *e);

enum md_engine_state md_engine_state(const struct md_engine *e);
/* One line describing why loading failed (empty otherwise). */
const char *md_engine_error(const struct md_engine *e);

/* Queue a request. On success the engine owns r (and its arrays). max_tokens beyond what the
 * context leaves is clamped to it. Returns 0, -EAGAIN when the queue is full, -ESHUTDOWN when
 * the engine is not serving, -EINVAL for a malformed request (prompt empty or longer than the
 * context), -ENOMEM; on failure r stays the caller's, unchanged. Every accepted request ends
 * with exactly one MD_EV_DONE. */
int md_engine_submit(struct md_engine *e, struct md_engine_req *r);
/* Cancel by id (unknown ids are ignored); the engine frees its KV at the next step and posts
 * MD_EV_DONE with MD_FINISH_CANCELLED. Returns 0 or -ENOMEM. */
int md_engine_cancel(struct md_engine *e, uint64_t id);
/* Detach all pending events (oldest first); the caller frees them with
 * md_engine_events_free. */
struct md_engine_event *md_engine_poll(struct md_engine *e);
void md_engine_events_free(struct md_engine_event *ev);
void md_engine_get_stats(struct md_engine *e, struct md_engine_stats *s);

/* ---- Model facts and text helpers: valid once READY, callable from any thread. ---- */

const char *md_engine_model_name(const struct md_engine *e); /* general.name or file stem */
const char *md_engine_model_path(const struct md_engine *e);
uint32_t md_engine_n_ctx(const struct md_engine *e);
uint32_t md_engine_n_vocab(const struct md_engine *e);
/* The vocabulary as grammars see it (grammar.h), for md_gmatch outside the engine. */
const struct md_gvocab *md_engine_gvocab(const struct md_engine *e);
/* Whether a draft model is loaded (requests may ask for MD_SPEC_DRAFT). */
bool md_engine_has_draft(const struct md_engine *e);
/* Whether self-speculation is available (requests may ask for MD_SPEC_SELF). */
bool md_engine_has_self(const struct md_engine *e);

/* Encode text (add_bos: prepend BOS where the model wants it; parse_special: match special
 * tokens). Returns the count (>= 0) with a malloc'd array in *ids, or a negative code. */
int md_engine_tokenize(const struct md_engine *e, const char *text, size_t len, bool add_bos,
		       bool parse_special, int32_t **ids);
/* Raw bytes of one token (may be partial UTF-8). Returns bytes written or negative. */
int md_engine_token_piece(const struct md_engine *e, int32_t id, char *buf, size_t cap);
/* Token text as stored in the vocabulary, or NULL for an invalid id. */
const char *md_engine_token_text(const struct md_engine *e, int32_t id, size_t *len);
bool md_engine_token_is_eog(const struct md_engine *e, int32_t id);

/* Render a chat with the model's template (generation prompt appended) and tokenize it,
 * adding BOS only where the model wants one and the template did not write it. Returns the
 * token count with a malloc'd array in *ids, -EINVAL when the template rejects the messages
 * (roles that do not alternate, ...), or another negative code. */
struct md_engine_tool_call {
	const char *name;      /* borrowed */
	const char *arguments; /* borrowed: JSON text as the client sent it */
	const char *arguments_obj; /* borrowed, may be NULL: chat_template.h md_chat_tool_call */
	const char *id;        /* borrowed, may be NULL: the call's id */
};
struct md_engine_msg {
	const char *role;      /* system, user, assistant or tool */
	const char *content;
	const struct md_engine_tool_call *tool_calls; /* borrowed (n_tool_calls): assistant */
	size_t n_tool_calls;
	bool content_null;     /* the client sent null content (content is ""), which some
				* templates render differently (DeepSeek-V3's tool calls) */
	const char *tool_call_id; /* borrowed, may be NULL: a tool message's call id */
};
int md_engine_chat_tokenize(const struct md_engine *e, const struct md_engine_msg *msgs,
			    size_t n, int32_t **ids);
/* The same with the request's tools, each in the form md_engine_tool_text() names
 * (n_tools may be 0). -ENOTSUP when the model's chat template has no tool format and the
 * request has tools, tool calls or tool messages. */
int md_engine_chat_tokenize_tools(const struct md_engine *e, const struct md_engine_msg *msgs,
				  size_t n, const char *const *tools, size_t n_tools, int32_t **ids);
/* The same with the request's reasoning effort (NULL: the template's default), which the
 * templates that have a place for it render (gpt-oss: "Reasoning: high"). */
int md_engine_chat_tokenize_effort(const struct md_engine *e, const struct md_engine_msg *msgs,
				   size_t n, const char *const *tools, size_t n_tools,
				   const char *reasoning_effort, int32_t **ids);
/* How the model writes tool calls (its chat template's family): 0 none (tools are refused),
 * 1 Hermes <tool_call> JSON (Qwen3, chatml), 2 DeepSeek-V3's tool tokens, 3 Mistral
 * [TOOL_CALLS], 4 Llama 3.1 JSON (chat_template.h enum md_tool_format). */
int md_engine_tool_format(const struct md_engine *e);
/* Whether the chat template writes OpenAI's harmony channels (gpt-oss): the output then
 * carries its analysis channel as reasoning and its final channel as content. */
bool md_engine_chat_harmony(const struct md_engine *e);
/* The form the chat template wants each tool text in (chat_template.h enum
 * md_chat_tool_text): 0 `tool | tojson`, 1 `tool | tojson(indent=4)`, 2 Mistral's. */
int md_engine_tool_text(const struct md_engine *e);

/* Decode a whole id sequence as Hugging Face's decode does (special tokens as their text;
 * engine/tokenizer.h md_tokenizer_decode): a malloc'd NUL-terminated *out of *len bytes.
 * Returns 0, -EINVAL (a bad id) or -ENOMEM. */
int md_engine_detokenize(const struct md_engine *e, const int32_t *ids, size_t n, char **out,
			 size_t *len);

/* Incremental detokenizer that yields only complete UTF-8 (one per choice). */
struct md_engine_detok; /* opaque */
/* continuation: the text continues earlier text (raw completions), so a SentencePiece
 * leading space is kept; false for fresh text (chat replies, /detokenize). */
struct md_engine_detok *md_engine_detok_new(const struct md_engine *e, bool continuation);
void md_engine_detok_free(struct md_engine_detok *d);
/* Append one token; writes newly completed text to out (cap >= 256). Returns bytes. */
int md_engine_detok_push(struct md_engine_detok *d, int32_t id, char *out, size_t cap);
/* Flush leftovers at the end (incomplete bytes become U+FFFD). Returns bytes. */
int md_engine_detok_flush(struct md_engine_detok *d, char *out, size_t cap);

#endif
