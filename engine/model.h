/* Architecture binding: hyper-parameters and tensor views of a GGUF model. */
#ifndef MD_MODEL_H
#define MD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/gguf.h"
#include "engine/kern/matmul.h"
#include "engine/kv_cache.h"
#include "engine/quant.h"

enum md_arch {
	MD_ARCH_QWEN3MOE,
	MD_ARCH_QWEN2MOE,
	MD_ARCH_LLAMA, /* dense Llama, or Mixtral when the file has experts */
	MD_ARCH_OLMOE,
	MD_ARCH_QWEN2,
	MD_ARCH_QWEN3,
	MD_ARCH_GPT_OSS,   /* OpenAI gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE) */
	MD_ARCH_DEEPSEEK2, /* DeepSeek-V2/V3/R1, Kimi-K2, Moonlight: latent attention */
	MD_ARCH_GLM4MOE,   /* GLM-4.5/4.6, GLM-4.5-Air */
};

/* How router logits become expert scores (llama.cpp's expert_gating_func: 1 softmax,
 * 2 sigmoid). */
enum md_gating { MD_GATING_SOFTMAX, MD_GATING_SIGMOID };

enum md_rope_type { MD_ROPE_NORM, MD_ROPE_NEOX };

/* The gated activation of the FFN (experts and dense alike). */
enum md_ffn_act {
	MD_ACT_SWIGLU,     /* silu(gate) * up */
	/* gpt-oss (ggml_swiglu_oai, alpha 1.702, limit 7): g = min(gate, 7),
	 * u = clamp(up, -7, 7), g * sigmoid(1.702 g) * (u + 1) */
	MD_ACT_SWIGLU_OAI,
};

enum md_qk_norm {
	MD_QK_NORM_NONE,
	MD_QK_NORM_HEAD, /* RMSNorm per head over head_dim (Qwen3) */
	MD_QK_NORM_FULL, /* RMSNorm over the whole projection before the head split (OLMoE) */
};

/* A weight matrix or vector. Rows are ne[1] (times ne[2] for 3-D expert tensors, expert e's
 * matrix starts at data + e * nb2). Usually a view into the map; a 1-D tensor stored as
 * f16/bf16 is converted to f32 at load, and per-expert tensors of older Mixtral files are
 * merged into one 3-D tensor (a view when the file spaces them evenly, else a copy), both in
 * buffers the model owns. Vectors (1-D: norms, biases, gates) are always f32. */
struct md_tensor {
	const char *name;   /* borrowed: the tensor's name (not NUL-terminated: use name_len); for
	                     * a merged expert tensor the merged name (blk.N.ffn_gate_exps.weight) */
	size_t name_len;
	enum md_dtype type;
	int64_t ne[4];      /* ne[0] innermost; unused dims are 1 */
	size_t nb1;         /* bytes per row of ne[0] elements */
	size_t nb2;         /* bytes from one matrix to the next (>= ne[1] * nb1; larger only for
	                     * a view of per-expert tensors that lie evenly spaced in the file) */
	const void *data;   /* borrowed: the map or a model-owned buffer, valid while loaded */
};

struct md_layer {
	struct md_tensor *attn_norm; /* (n_embd) */
	struct md_tensor *wq, *wk, *wv; /* (n_embd -> n_head*head_dim / n_head_kv*head_dim) */
	struct md_tensor *bq, *bk, *bv; /* optional biases */
	struct md_tensor *wo;        /* (n_head*head_dim -> n_embd) */
	struct md_tensor *bo;        /* optional: output projection bias (n_embd) */
	struct md_tensor *attn_sinks; /* optional: (n_head) per-head sink logit joining the
				       * softmax (gpt-oss) */
	struct md_tensor *q_norm, *k_norm; /* optional: (head_dim) or (full projection) */
	struct md_tensor *ffn_norm;  /* (n_embd) */
	/* dense FFN */
	struct md_tensor *ffn_gate, *ffn_up, *ffn_down;
	/* MoE */
	struct md_tensor *gate_inp;  /* router: (n_embd -> n_expert) */
	struct md_tensor *gate_exps, *up_exps; /* (n_embd -> n_ff_exp) x n_expert */
	struct md_tensor *down_exps; /* (n_ff_exp -> n_embd) x n_expert */
	/* optional biases, f32 (gpt-oss): router (n_expert); per expert, expert e's row e */
	struct md_tensor *gate_inp_b;
	struct md_tensor *gate_exps_b, *up_exps_b; /* (n_ff_exp, n_expert) */
	struct md_tensor *down_exps_b;             /* (n_embd, n_expert) */
	struct md_tensor *exp_probs_b; /* optional (n_expert): bias added to the scores for the
					* selection only (DeepSeek-V3, GLM-4.5) */
	/* shared expert (Qwen2-MoE, DeepSeek, GLM-4.5) */
	struct md_tensor *gate_inp_shexp; /* optional (n_embd) -> scalar gate, sigmoid (Qwen2-MoE) */
	struct md_tensor *gate_shexp, *up_shexp, *down_shexp;
	/* multi-head latent attention (deepseek2; engine/attn_mla.h). R = n_rot, C =
	 * kv_lora_rank, Dn = head_dim_nope, Dv = head_dim_v, H = n_head. */
	struct md_tensor *wq_a;      /* (n_embd -> q_lora_rank), with q_lora_rank only */
	struct md_tensor *q_a_norm;  /* (q_lora_rank) */
	struct md_tensor *wq_b;      /* (q_lora_rank -> H * (Dn + R)); without q_lora_rank wq
				      * is (n_embd -> H * (Dn + R)) */
	struct md_tensor *wkv_a_mqa; /* (n_embd -> C + R): the latent, then the rope key */
	struct md_tensor *kv_a_norm; /* (C) */
	struct md_tensor *wk_b;      /* (Dn -> C) x H: absorbs a head's nope query into the latent */
	struct md_tensor *wv_b;      /* (C -> Dv) x H: a head's latent output to its value */
};

struct md_hparams {
	enum md_arch arch;
	char arch_name[32];
	uint32_t n_vocab, n_ctx_train, n_embd, n_layer;
	uint32_t n_head, n_head_kv, head_dim; /* head_dim = key_length */
	uint32_t n_ff;                        /* dense FFN width (0 for pure MoE) */
	uint32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
	float rms_eps;
	float rope_freq_base;
	float rope_freq_base_swa;             /* sliding-window layers' base (default: the same) */
	uint32_t n_rot;                       /* rotary dims (<= head_dim) */
	enum md_rope_type rope_type;
	/* Rope frequency scaling, read once as llama.cpp reads it (read_rope_scaling in model.c)
	 * and computed by engine/rope.c: none or YaRN (linear only unscaled). */
	float rope_freq_scale;                /* 1 / rope.scaling.factor (1: none) */
	float yarn_ext_factor;                /* 1 with rope.scaling.type yarn, else 0 (no ramp) */
	/* llama.cpp's cparams.yarn_attn_factor: the magnitude handed to the rope, which GGML's
	 * rope_yarn multiplies by 1 + 0.1 ln(factor) again wherever yarn_ext_factor != 0. It is
	 * rope.scaling.attn_factor times, with YaRN, get_mscale terms that cancel that factor
	 * (all but gpt-oss's kind of file) or keep it: see read_rope_scaling. */
	float yarn_attn_factor;
	float yarn_beta_fast, yarn_beta_slow; /* 32 and 1: llama.cpp reads no key for these archs */
	uint32_t n_ctx_orig_yarn;             /* rope.scaling.original_context_length */
	float rope_yarn_log_mul;              /* deepseek2: mscale_all_dim (the file's
					       * yarn_log_multiplier / 0.1); 0: none */
	/* Sliding-window attention (gpt-oss): layer il attends to the n_swa positions ending at
	 * the token's own when md_layer_is_swa; n_swa 0: every layer attends to all. */
	uint32_t n_swa;
	uint32_t swa_period;                  /* il % period < period - 1 is SWA (llama.cpp's
					       * set_swa_pattern, dense last) */
	enum md_ffn_act ffn_act;
	enum md_qk_norm qk_norm;
	bool norm_topk;                       /* renormalise top-k router weights */
	bool tied_output;                     /* output.weight absent: token_embd reused */
	float attn_scale;                     /* softmax scale of q.k: 1/sqrt(head_dim), or the
					       * MLA/YaRN one (deepseek2) */
	/* MoE extras (deepseek2, glm4moe): 0 / 1 / softmax where an arch has none */
	enum md_gating gating;
	float expert_weights_scale;           /* routed weights times this (0: 1) */
	uint32_t n_expert_groups, n_group_used; /* group-limited top-k (n_expert_groups > 1) */
	uint32_t n_expert_shared;             /* shared experts (their FFN is n_ff_shexp wide) */
	uint32_t n_layer_dense_lead;          /* leading layers with a dense FFN */
	uint32_t n_layer_nextn;               /* NextN/MTP layers after the n_layer run (their
					       * tensors are accepted and not used) */
	/* multi-head latent attention (deepseek2): kv_lora_rank > 0. head_dim is then the
	 * decompressed key width head_dim_nope + n_rot, n_head_kv 1. */
	uint32_t q_lora_rank;                 /* 0: a plain attn_q */
	uint32_t kv_lora_rank;
	uint32_t head_dim_nope, head_dim_v;
};

struct md_model_buf; /* private: one buffer of converted or merged tensor data */

struct md_model {
	struct md_gguf gguf;       /* owned: the mapping most tensors borrow from */
	struct md_hparams hp;
	struct md_tensor *tensors; /* owned: one per bound GGUF tensor */
	size_t n_tensors;
	struct md_tensor *tok_embd, *output_norm, *output;
	struct md_layer *layers;   /* owned (n_layer) */
	size_t owned_bytes;        /* bytes of tensor data held outside the map (_bufs) */
	struct md_model_buf *_bufs; /* owned: list of buffers behind converted/merged tensors */
	char path[4096];
};

/* Map and bind a GGUF model written the way llama.cpp's converter and quantizer write them:
 * shapes compared with trailing dimensions of 1 ignored ([n, 1] matches [n]), 1-D tensors
 * in f32, f16 or bf16, per-expert tensors (blk.N.ffn_gate.E.weight) merged, output.weight
 * optional where llama.cpp ties it, metadata defaults as llama.cpp's. Every tensor of the file
 * must be used: one moed does not understand (a bias or rope factor it would silently
 * skip) fails the load rather than change the output.
 * Returns 0, or a negative code (-EINVAL malformed, -ENOTSUP unsupported, -ENOMEM) with one
 * line in err naming the tensor or key and what was expected; *m then needs no release. */
int md_model_load(struct md_model *m, const char *path, char *err, size_t errlen);
void md_model_free(struct md_model *m);

/* View of a 2-D tensor, or of expert e's matrix in a 3-D expert tensor (borrows t's data). */
struct md_mat md_mat_of(const struct md_tensor *t, int64_t expert);

const char *md_arch_name(enum md_arch a);
/* Whether layer il uses sliding-window attention (always false when hp->n_swa is 0). */
bool md_layer_is_swa(const struct md_hparams *hp, uint32_t il);
bool md_model_is_moe(const struct md_model *m);

/* The model's KV cache rows per token and layer: float K (n_head_kv * head_dim) and V (the
 * same), or for latent attention one compressed half row (kv_lora_rank + n_rot) and no V.
 * For md_kv_init_rows. */
struct md_kv_rows md_model_kv_rows(const struct md_model *m);

#endif
