/* The Llama-family loading fuzz target (fuzz_llm.c), as libFuzzer calls it
 * and as the replay driver (replay.c) calls it without libFuzzer. */
#ifndef TP_FUZZ_LLM_H
#define TP_FUZZ_LLM_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Writes the seed corpus into out/{config,header,index}/ (directories that
 * must exist): the valid header and index of each small model, and seeds
 * from the Hugging Face fixtures under fixtures (tests/fixtures/hf).
 * Returns 0 on success. */
int tp_fuzz_llm_write_seeds(const char *out, const char *fixtures);

/* Removes the scratch directory (also registered with atexit). */
void tp_fuzz_llm_cleanup(void);

#endif /* TP_FUZZ_LLM_H */
