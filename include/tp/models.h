/*
 * tp/models.h - the Llama family (Llama, Mistral, Qwen2) from Hugging Face
 * configs and checkpoints: the config, the model as a module tree whose
 * names are the Hugging Face state-dict names, its forward and causal-LM
 * loss, the standard tensor-parallel plan, and model directories loaded and
 * saved as `save_pretrained` writes them. docs/models.md is the guide.
 *
 * The model computes what transformers 5.x's LlamaForCausalLM,
 * MistralForCausalLM and Qwen2ForCausalLM compute (pre-norm decoder layers:
 * RMSNorm, attention with rotary embeddings and grouped kv heads, RMSNorm,
 * SwiGLU MLP; a final RMSNorm and the lm_head).
 */
#ifndef TP_MODELS_H
#define TP_MODELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/dp.h"
#include "tp/mesh.h"
#include "tp/nn.h"
#include "tp/ops.h"
#include "tp/status.h"
#include "tp/styles.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tp_llm_arch { TP_LLM_LLAMA = 0, TP_LLM_MISTRAL, TP_LLM_QWEN2 } tp_llm_arch;

#define TP_LLM_MAX_EOS 8

/*
 * A model's config.json. Both forms found on the hub are read: transformers
 * 4.x (`torch_dtype`, top-level `rope_theta` and `rope_scaling`, which may be
 * null) and 5.x (`dtype`, `rope_parameters`, `layer_types`).
 */
typedef struct tp_llm_config {
    tp_llm_arch arch;
    int64_t vocab_size;
    int64_t hidden_size;
    int64_t intermediate_size;
    int64_t num_hidden_layers;
    int64_t num_attention_heads;
    int64_t num_key_value_heads;     /* default: num_attention_heads */
    int64_t head_dim;                /* default: hidden_size / num_attention_heads */
    int64_t max_position_embeddings; /* default: the architecture's */
    double rms_norm_eps;             /* default 1e-6 */
    tp_rope_config rope;             /* type, theta and scaling; head_dim filled in */
    bool tie_word_embeddings;        /* lm_head.weight is model.embed_tokens.weight */
    bool attention_bias;             /* q/k/v/o biases (Llama's attention_bias) */
    bool qkv_bias;                   /* q/k/v biases, none on o (Qwen2) */
    bool mlp_bias;                   /* gate/up/down biases (Llama's mlp_bias) */
    int64_t sliding_window;          /* Mistral's window (0: none): sequences
                                        longer than it are refused */
    tp_dtype dtype;                  /* the checkpoint's dtype; TP_F32 when absent */
    int64_t bos_token_id;            /* -1: none */
    int n_eos;                       /* eos_token_id: an id or a list */
    int64_t eos_token_id[TP_LLM_MAX_EOS];
    int64_t pad_token_id;            /* -1: none */
} tp_llm_config;

/*
 * Parses config.json text into *out. Accepted: architectures
 * LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (or, without
 * `architectures`, model_type llama, mistral, qwen2); hidden_act "silu";
 * rope types default, linear, dynamic and llama3. Keys that do not change the
 * result are ignored (initializer_range, use_cache, pretraining_tp, Qwen2's
 * sliding_window while use_sliding_window is false, ...). Refused with
 * TP_ERR_NOT_SUPPORTED naming the key and its value: another architecture or
 * activation, another rope type or a partial_rotary_factor other than 1,
 * Qwen2's use_sliding_window true (or sliding_attention in layer_types),
 * attention_dropout other than 0. A missing required key (vocab_size,
 * hidden_size, intermediate_size, num_hidden_layers, num_attention_heads), a
 * value of the wrong JSON type, a size that is not positive, heads that the
 * kv heads do not divide, an odd head_dim, or malformed JSON are
 * TP_ERR_INVALID_ARG naming the key (JSON errors with line and column).
 */
TP_API tp_status tp_llm_config_parse(const char *json_text, tp_llm_config *out);
/* tp_llm_config_parse of PATH/config.json when path is a directory, else of
 * the file at path. A file that cannot be read is TP_ERR_BACKEND naming it. */
TP_API tp_status tp_llm_config_load(const char *path, tp_llm_config *out);
/* The config as config.json text in the transformers 5.x form (what
 * save_pretrained writes), which transformers' from_pretrained reads back to
 * the same model. *json is malloc'ed (free()). */
TP_API tp_status tp_llm_config_to_json(const tp_llm_config *cfg, char **json);
/* "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM". */
TP_API const char *tp_llm_arch_name(tp_llm_arch arch);

/* ---- the model ----------------------------------------------------------------- */

/*
 * Builds the model as a module tree on the calling thread's default device
 * (tp_nn_set_default_device), parameters f32 and zero until loaded
 * (tp_llm_load) or initialized (tp_module_init); tp_module_to_dtype casts.
 * The names are the Hugging Face state-dict names:
 *
 *   <arch> (root)                       forward(input_ids; position_ids, attention_mask)
 *     model                LlamaModel
 *       embed_tokens       Embedding(vocab_size, hidden_size)
 *       layers.N           LlamaDecoderLayer
 *         input_layernorm            RMSNorm(hidden_size, rms_norm_eps)
 *         self_attn                  LlamaAttention: forward(x; cos, sin, attention_mask)
 *           q_proj, k_proj, v_proj, o_proj   Linear
 *         post_attention_layernorm   RMSNorm
 *         mlp                        LlamaMLP
 *           gate_proj, up_proj, down_proj    Linear
 *       norm               RMSNorm
 *     lm_head              Linear(hidden_size, vocab_size, no bias); with
 *                          tie_word_embeddings its weight is embed_tokens'
 *
 * cfg is copied. TP_ERR_INVALID_ARG names a field that cannot be built.
 */
TP_API tp_status tp_llm_create(const tp_llm_config *cfg, tp_module **out);
/* The config a model was built from (borrowed), or NULL when `model` is not
 * a root tp_llm_create made. */
TP_API const tp_llm_config *tp_llm_config_of(const tp_module *model);

/*
 * The logits [B, S, vocab_size] of input_ids [B, S] (a plain i64 tensor on
 * the model's device, the same on every rank; ids outside [0, vocab_size)
 * are TP_ERR_INVALID_ARG naming the position). position_ids (plain i64
 * [B, S]) may be NULL: 0..S-1 on every row, as transformers' forward.
 * attention_mask (plain i64/i32 [B, S], 1 = token, 0 = padding, as
 * transformers') may be NULL; padded keys are never attended, and the logits
 * at padded positions carry no meaning. The logits are a plain tensor, or
 * under the standard plan with loss parallelism a DTensor sharded on the
 * vocab dim (tp_llm_loss takes either). Collective under a plan: every rank
 * of the mesh calls it with the same inputs. Differentiable in the
 * parameters.
 */
TP_API tp_status tp_llm_forward(tp_module *model, tp_tensor *input_ids, tp_tensor *position_ids,
                                tp_tensor *attention_mask, tp_tensor **logits);

/*
 * Hugging Face's causal-LM loss with labels = input_ids: the mean cross
 * entropy of logits[b, s] against input_ids[b, s + 1] over the B * (S - 1)
 * predicted positions (the shift happens inside; the last position of each
 * row predicts nothing). logits: what tp_llm_forward returned; input_ids:
 * the plain i64 CPU tensor given to it (S >= 2). With logits sharded on the
 * vocab dim the loss is vocab-parallel: 3 all_reduces forward, none
 * backward. A 0-d tensor, differentiable.
 */
TP_API tp_status tp_llm_loss(tp_tensor *logits, tp_tensor *input_ids, tp_tensor **loss);

/* ---- the standard plan ---------------------------------------------------------- */

typedef struct tp_llm_plan_options {
    /* Sequence parallelism: the norms and residual stream sharded on the
     * sequence dim (SequenceParallel), self_attn and mlp gathering their
     * input (PrepareModuleInput S(1) -> R), o_proj and down_proj
     * reduce-scattering onto it, embed_tokens reduce-scattering its output. */
    bool sequence_parallel;
    /* Default (TP_FLAG_DEFAULT) on: lm_head's output stays a DTensor sharded
     * on the vocab dim for the vocab-parallel loss. TP_FLAG_FALSE: lm_head
     * gathers the logits into a plain [B, S, vocab] tensor. */
    tp_flag loss_parallel;
} tp_llm_plan_options;

/*
 * The standard tensor-parallel plan, as an editable list of plan entries
 * (FQN patterns and styles, owned by the plan): 
 *
 *   model.embed_tokens                    Rowwise(input R; SP: output S(1))
 *   model.layers.*.self_attn.[qkv]_proj   Colwise
 *   model.layers.*.self_attn.o_proj       Rowwise (SP: output S(1))
 *   model.layers.*.mlp.gate_proj, up_proj Colwise
 *   model.layers.*.mlp.down_proj          Rowwise (SP: output S(1))
 *   lm_head                               Colwise(output S(-1), a DTensor: loss parallel)
 *   with SP: model.layers.*.input_layernorm, post_attention_layernorm and
 *   model.norm SequenceParallel; model.layers.*.self_attn and mlp
 *   PrepareModuleInput(S(1) -> R); lm_head takes S(1).
 *
 * Copy the entries into an array of your own to edit them (the styles stay
 * the plan's: free the plan after parallelizing). opts NULL: defaults.
 */
typedef struct tp_llm_plan tp_llm_plan;
TP_API tp_status tp_llm_plan_create(const tp_llm_plan_options *opts, tp_llm_plan **out);
TP_API int tp_llm_plan_size(const tp_llm_plan *plan);
TP_API const tp_plan_entry *tp_llm_plan_entries(const tp_llm_plan *plan);
TP_API void tp_llm_plan_free(tp_llm_plan *plan);

/*
 * Collective over the 1-D mesh (a tp slice): tp_parallelize_module with the
 * plan (n == 0: the standard plan with default options). num_attention_heads
 * must be a multiple of the mesh size. The kv heads split likewise when the
 * mesh size divides them; when it is a multiple of them instead, each rank
 * keeps the kv head its query heads read (as vLLM does): k_proj and v_proj
 * are left out of the plan and their parameters made Replicate (from
 * opts->src_data_rank), each rank computing its head from rows of them; the
 * gradient of those weights is Partial (each rank's share), reduced by the
 * optimizer step. Other counts are TP_ERR_INVALID_ARG naming them, before
 * any communication. In that replicated case the plan's patterns are
 * resolved against the model (opts->unmatched is not filled; an entry that
 * matches no module is an error unless allow_unmatched). Tied embeddings
 * stay tied (both weights Shard(0) on the vocab dim).
 */
TP_API tp_status tp_llm_parallelize(tp_module *model, tp_mesh *mesh, int n,
                                    const tp_plan_entry *plan, const tp_parallelize_options *opts);

/*
 * Collective over mesh: fully sharded data parallel for the model
 * (tp/dp.h, tp_fully_shard), as torchtitan applies it to Llama: each
 * decoder block a unit, model.embed_tokens and lm_head units of their own
 * (one unit, the root, when the embeddings are tied), then the root (the
 * final norm and what else is left). mesh is the (dp, tp) mesh whose tp
 * slice the model was parallelized on (or a 1-D dp mesh for a model
 * without TP; "dp_replicate" for HSDP). Parallelize first, shard second,
 * create the optimizer third. Errors as tp_fully_shard's, naming the unit.
 */
TP_API tp_status tp_llm_fully_shard(tp_module *model, tp_mesh *mesh, const tp_fsdp_options *opts);

/* ---- model directories ---------------------------------------------------------- */

/*
 * Loads a Hugging Face model directory's weights (model.safetensors, or the
 * shards model.safetensors.index.json lists) into the model, parallelized or
 * not: tp_safetensors_load, strict and streamed (each rank reads only its
 * shard, straight into the parameters or through one tensor's scratch when
 * the dtype converts: its peak is its shard plus one tensor), values
 * converted to the parameters' dtype. Every name, shape and dtype is checked
 * before any tensor data is read. Tensors the model does not have are
 * refused by name, except the rotary inv_freq buffers of older checkpoints
 * and a tied model's lm_head.weight, which are skipped. The config is the
 * caller's (tp_llm_config_load of the same directory). Collective as
 * tp_safetensors_load.
 */
TP_API tp_status tp_llm_load(tp_module *model, const char *dir);

/*
 * Saves the model as a directory transformers' from_pretrained loads:
 * config.json (5.x form, dtype of the parameters), generation_config.json
 * (bos, eos, pad) and the weights (tp_safetensors_save_sharded, prefix
 * "model", max_shard_bytes 0: one file). The directory is created if
 * missing. Collective: mesh rank 0 writes; two all_reduces agree on the
 * outcome (one after the configs, one after the weights).
 */
TP_API tp_status tp_llm_save(tp_module *model, const char *dir, size_t max_shard_bytes);

/* ---- generation: the KV cache, decoding and sampling ----------------------------------- */

/*
 * A KV cache: per decoder layer, the rotated keys and the values of every
 * position seen, for the kv heads this rank computes, as
 * [max_batch, local kv heads, max_len, head_dim] tensors on the model's
 * device in its dtype (embed_tokens' weight's), and the attention mask of
 * those positions. Allocated once (tp_memory_stats and the meta device count
 * it as any tensor); tp_llm_forward_cached appends to it.
 */
typedef struct tp_llm_cache tp_llm_cache;

/*
 * A cache for `model` as it is now: create it after tp_llm_parallelize and
 * tp_module_to_dtype / tp_module_to_device (a model changed afterwards is
 * refused by tp_llm_forward_cached). max_batch sequences of up to max_len
 * positions (prompt and new tokens, padding included), both positive.
 * Local: no communication. TP_ERR_INVALID_ARG names a bad argument;
 * TP_ERR_NO_MEMORY (or the device's error) when the tensors do not fit.
 */
TP_API tp_status tp_llm_cache_create(tp_module *model, int64_t max_batch, int64_t max_len,
                                     tp_llm_cache **out);
TP_API void tp_llm_cache_free(tp_llm_cache *cache);
/* Empties the cache: the next tp_llm_forward_cached starts new sequences. */
TP_API void tp_llm_cache_reset(tp_llm_cache *cache);
/* Positions filled (0 after create and reset), and the batch in use. */
TP_API int64_t tp_llm_cache_length(const tp_llm_cache *cache);
TP_API int64_t tp_llm_cache_batch(const tp_llm_cache *cache);
/* Bytes of the cache's tensors on this rank. */
TP_API size_t tp_llm_cache_nbytes(const tp_llm_cache *cache);

/*
 * The forward of input_ids [B, S] (plain i64 on the CPU, the same on every
 * rank) after the cache's positions: the model attends over the cached
 * keys and values and the new ones, which it appends (S positions). The
 * first call after create or reset (the prefill) sets the batch B
 * (<= max_batch); later calls (S = 1 to decode one token) must keep it.
 * attention_mask: NULL (every new token real) or plain i64/i32 [B, S] on
 * the CPU of 0s (padding: never attended) and 1s, for the new positions
 * only; the cache keeps the earlier ones. Position ids follow the mask as
 * transformers' generate makes them: a sequence's real tokens are numbered
 * 0, 1, 2, ... however much padding precedes them.
 *
 * logits_to_keep: the logits of the last logits_to_keep positions (0: all
 * S), gathered: a plain [B, logits_to_keep, vocab_size] tensor on the
 * model's device on every rank (under the standard plan: one all_gather of
 * the vocab shards). No gradient is recorded. Collective under a plan: one
 * all_reduce for the embedding and two per layer (o_proj, down_proj), plus
 * the all_gather; a plan with sequence parallelism is refused (decoding
 * runs one token at a time).
 *
 * Errors (TP_ERR_INVALID_ARG naming them, the cache unchanged): a cache of
 * another model, or made before the model's dtype, device or plan changed;
 * B past max_batch or unlike the prefill's; S + length past max_len
 * ("... exceeds the cache's max_len"); ids outside [0, vocab_size); a mask
 * of another shape or with values other than 0 and 1.
 */
TP_API tp_status tp_llm_forward_cached(tp_module *model, tp_llm_cache *cache,
                                       tp_tensor *input_ids, tp_tensor *attention_mask,
                                       int64_t logits_to_keep, tp_tensor **logits);

/*
 * How the next token is chosen from a row of logits, in transformers'
 * order: greedy (do_sample false: the first largest logit), or sampling from
 * softmax(logits / temperature) restricted to the top_k largest (0: all)
 * and then to the smallest set of the most likely tokens whose probability
 * reaches top_p (1: all). seed and the step number pick the random numbers
 * (Philox, one per row and step): the same seed gives the same tokens on
 * every rank, backend and tp degree for the same logits.
 * Zero-initialized: greedy. temperature 0 reads as 1 and top_p 0 as 1.
 */
typedef struct tp_llm_sampling {
    bool do_sample;
    double temperature; /* > 0 (0: 1) */
    int64_t top_k;      /* >= 0 (0: off) */
    double top_p;       /* in (0, 1] (0: 1) */
    uint64_t seed;
} tp_llm_sampling;

/*
 * Chooses one token per row of logits ([B, V] or [B, 1, V], plain, f32,
 * bf16 or f16, on any device) into ids[0..B-1]; step numbers the draw
 * (generation passes the index of the new token). Local. Bad options
 * (a negative or NaN temperature, top_k < 0, top_p outside [0, 1]) are
 * TP_ERR_INVALID_ARG naming them.
 */
TP_API tp_status tp_llm_sample(tp_tensor *logits, const tp_llm_sampling *sampling,
                               uint64_t step, int64_t *ids);

/* A model directory's generation_config.json, over config.json's tokens. */
typedef struct tp_llm_generation_config {
    int n_eos;
    int64_t eos_token_id[TP_LLM_MAX_EOS];
    int64_t pad_token_id;   /* -1: none */
    int64_t bos_token_id;   /* -1: none */
    tp_llm_sampling sampling; /* do_sample, temperature, top_k (transformers' default 50), top_p */
    int64_t max_new_tokens; /* -1: not given */
} tp_llm_generation_config;

/*
 * Fills *out from cfg's tokens and transformers' defaults (greedy,
 * temperature 1, top_k 50, top_p 1), then from dir/generation_config.json
 * when the file exists (a missing file is not an error: older models lack
 * it). Keys of the wrong type are TP_ERR_INVALID_ARG naming the file and
 * the key.
 */
TP_API tp_status tp_llm_generation_config_load(const char *dir, const tp_llm_config *cfg,
                                               tp_llm_generation_config *out);

typedef struct tp_llm_generate_options {
    int64_t max_new_tokens;       /* > 0 */
    tp_llm_sampling sampling;     /* zero: greedy */
    /* the ids that end a sequence: n_eos of eos_token_ids; n_eos 0: the
     * config's eos_token_id (none: the sequences run to max_new_tokens) */
    int n_eos;
    const int64_t *eos_token_ids;
    /* what follows a sequence's end while others go on: >= 0 that id, -1 the
     * config's pad_token_id, else its first eos id, else 0 (transformers') */
    int64_t pad_token_id;
    /* optional: a cache to use (reset first; max_batch >= B and max_len >=
     * S + max_new_tokens); NULL: one is made for the call and freed */
    tp_llm_cache *cache;
} tp_llm_generate_options;

typedef struct tp_llm_generate_stats {
    double prefill_s;       /* the prompt's forward and the first token: time to first token */
    double decode_s;        /* the decode steps, together */
    int64_t decode_steps;   /* the forwards of one token per sequence */
    double step_p50_s;      /* a decode step's median and 99th percentile */
    double step_p99_s;
    size_t cache_bytes;     /* tp_llm_cache_nbytes of the cache used */
} tp_llm_generate_stats;

/*
 * Generates up to max_new_tokens tokens after each prompt of input_ids
 * [B, S] (plain i64 on the CPU; prompts of different lengths are
 * left-padded, attention_mask [B, S] marking the padding with 0s, as
 * transformers' generate takes them): a prefill of the prompts, then one
 * decode step per new token, each choosing with tp_llm_sample. A sequence
 * ends at an eos id (kept in its output); generation stops when every
 * sequence has ended or after max_new_tokens. *tokens: plain i64 CPU
 * [B, T] (T <= max_new_tokens) of the new tokens, the pad id after a
 * sequence's end: transformers' generate(...)[:, S:]. Every rank gets the
 * same tokens (they are chosen from logits gathered to every rank with the
 * same random numbers). stats may be NULL. Collective under a plan, as
 * tp_llm_forward_cached; errors as it and tp_llm_sample, plus
 * max_new_tokens < 1, a prompt with no real token or padded on the right,
 * and a given cache too small.
 */
TP_API tp_status tp_llm_generate(tp_module *model, tp_tensor *input_ids,
                                 tp_tensor *attention_mask, const tp_llm_generate_options *opts,
                                 tp_tensor **tokens, tp_llm_generate_stats *stats);

#ifdef __cplusplus
}
#endif

#endif /* TP_MODELS_H */
