/*
 * A Hugging Face Llama / Mistral / Qwen2 directory, sharded over tensor-parallel
 * ranks with the standard plan, run and trained for a few steps.
 *
 *   tp-example-llm MODEL_DIR [TP]
 *
 * Each of TP rank threads (default 2) builds the model from config.json,
 * parallelizes it (q/k/v and gate/up colwise, o and down rowwise, lm_head
 * colwise with the loss vocab-parallel), loads only its shard of the
 * weights, prints the next-token prediction of a fixed batch, takes three
 * AdamW steps on the causal-LM loss, printing each loss, then continues
 * each sequence by 8 tokens through a KV cache (greedy). The same in a
 * command: tp-llm logits, train and generate (tools/tp_llm.c).
 */
#include <stdio.h>
#include <stdlib.h>

#include <tp.h>

#define B 2
#define S 8

static const char *model_dir;

#define CHECK(expr)                                                             \
    do {                                                                        \
        st = (expr);                                                            \
        if (st != TP_OK) {                                                      \
            fprintf(stderr, "rank %d: %s: %s\n", rank, #expr, tp_last_error()); \
            goto out;                                                           \
        }                                                                       \
    } while (0)

/* The id with the largest logit at position (b, S - 1). */
static int64_t argmax_last(const tp_tensor *logits, int64_t b, int64_t vocab)
{
    const float *row = (const float *)tp_tensor_data(logits) + (b * S + S - 1) * vocab;
    int64_t best = 0;
    for (int64_t v = 1; v < vocab; v++)
        if (row[v] > row[best])
            best = v;
    return best;
}

static tp_status rank_main(tp_comm *world, void *arg)
{
    (void)arg;
    const int rank = tp_comm_rank(world);
    tp_status st;
    tp_llm_config cfg;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    tp_adam *adam = NULL;
    tp_tensor *ids = NULL, *logits = NULL, *full = NULL, *loss = NULL, *tokens = NULL;

    /* the model, its tp mesh and the standard plan */
    CHECK(tp_llm_config_load(model_dir, &cfg));
    CHECK(tp_llm_create(&cfg, &model));
    const int64_t tp = tp_comm_size(world);
    CHECK(tp_mesh_create(world, 1, &tp, (const char *[]){"tp"}, &mesh));
    /* n = 0: the standard plan; each rank's values come from the file */
    const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    CHECK(tp_llm_parallelize(model, mesh, 0, NULL, &po));
    CHECK(tp_llm_load(model, model_dir)); /* each rank reads only its shard */

    /* a fixed batch of token ids, the same on every rank */
    int64_t data[B * S];
    for (int i = 0; i < B * S; i++)
        data[i] = (7 * i + 3) % cfg.vocab_size;
    CHECK(tp_tensor_from_data(TP_I64, 2, (const int64_t[]){B, S}, data, &ids));

    /* logits: a DTensor sharded on the vocab dim; gathered here to print */
    tp_no_grad_begin();
    st = tp_llm_forward(model, ids, NULL, NULL, &logits);
    if (st == TP_OK)
        st = tp_dtensor_full_tensor(logits, &full);
    tp_no_grad_end();
    CHECK(st);
    if (rank == 0)
        for (int64_t b = 0; b < B; b++)
            printf("sequence %lld: next token %lld\n", (long long)b,
                   (long long)argmax_last(full, b, cfg.vocab_size));
    tp_tensor_release(logits);
    logits = NULL;

    /* three AdamW steps on the causal-LM loss */
    const tp_adam_options ao = {.lr = 1e-3, .weight_decay = 0.01, .decoupled = true};
    CHECK(tp_adam_create_with(model, &ao, &adam));
    for (int step = 0; step < 3; step++) {
        tp_module_zero_grad(model);
        CHECK(tp_llm_forward(model, ids, NULL, NULL, &logits));
        CHECK(tp_llm_loss(logits, ids, &loss)); /* 3 all_reduces, vocab-parallel */
        if (rank == 0)
            printf("step %d: loss %.6f\n", step, (double)*(const float *)tp_tensor_data(
                                                     tp_dtensor_local(loss)));
        CHECK(tp_backward(loss, NULL));
        CHECK(tp_adam_step(adam));
        tp_tensor_release(loss);
        tp_tensor_release(logits);
        loss = logits = NULL;
    }

    /* 8 new tokens after each sequence: the prompt's forward fills a KV
     * cache of this rank's kv heads, then one token per step; every rank
     * gets the same tokens */
    const tp_llm_generate_options go = {.max_new_tokens = 8, .n_eos = -1};
    CHECK(tp_llm_generate(model, ids, NULL, &go, &tokens, NULL));
    for (int64_t b = 0; rank == 0 && b < B; b++) {
        printf("sequence %lld continues:", (long long)b);
        for (int64_t t = 0; t < tp_tensor_size(tokens, 1); t++)
            printf(" %lld", (long long)((const int64_t *)tp_tensor_data(tokens))[b * 8 + t]);
        printf("\n");
    }
out:
    tp_tensor_release(tokens);
    tp_tensor_release(loss);
    tp_tensor_release(logits);
    tp_tensor_release(full);
    tp_tensor_release(ids);
    tp_adam_free(adam);
    tp_module_free(model);
    tp_mesh_free(mesh);
    return st;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s MODEL_DIR [TP]\n", argv[0]);
        return 2;
    }
    model_dir = argv[1];
    int tp = argc == 3 ? atoi(argv[2]) : 2;
    if (tp < 1) {
        fprintf(stderr, "TP must be a count >= 1\n");
        return 2;
    }
    tp_status st = tp_run_local(tp, rank_main, NULL);
    if (st != TP_OK)
        fprintf(stderr, "%s\n", tp_last_error());
    return st == TP_OK ? 0 : 1;
}
