/*
 * Runs a fuzz target without libFuzzer: every file named on the command line,
 * and every file of every directory named (sorted by name; names starting
 * with '.' and README files are skipped), is passed to LLVMFuzzerTestOneInput
 * once. A crash, a sanitizer report or a broken contract aborts; otherwise it
 * prints how many inputs ran and exits 0. The meson test fuzz_llm_replay runs
 * the committed corpus and reproducers this way (docs/fuzzing.md).
 *
 *   fuzz_llm_replay FILE_OR_DIR...
 *   fuzz_llm_replay --seeds OUT FIXTURES   (writes OUT/{config,header,index}/)
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_llm.h"

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, n = 0;
    unsigned char *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fprintf(stderr, "replay: out of memory reading %s\n", path);
            fclose(f);
            return -1;
        }
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        unsigned char *bigger = realloc(buf, cap * 2);
        if (!bigger)
            free(buf);
        buf = bigger;
        cap *= 2;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        return -1;
    }
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

static int skip_name(const struct dirent *d)
{
    return d->d_name[0] != '.' && strncmp(d->d_name, "README", 6) != 0;
}

/* The number of inputs run, or -1. */
static long run_path(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode))
        return run_file(path) == 0 ? 1 : -1;
    struct dirent **names = NULL;
    int k = scandir(path, &names, skip_name, alphasort);
    if (k < 0) {
        fprintf(stderr, "replay: cannot list %s: %s\n", path, strerror(errno));
        return -1;
    }
    long count = 0;
    for (int i = 0; i < k; i++) {
        char full[4096];
        snprintf(full, sizeof full, "%s/%s", path, names[i]->d_name);
        struct stat fb;
        if (count >= 0 && stat(full, &fb) == 0 && S_ISREG(fb.st_mode))
            count = run_file(full) == 0 ? count + 1 : -1;
        free(names[i]);
    }
    free(names);
    return count;
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "--seeds")) {
        if (LLVMFuzzerInitialize(&argc, &argv) != 0)
            return 1;
        int rc = tp_fuzz_llm_write_seeds(argv[2], argv[3]);
        tp_fuzz_llm_cleanup();
        return rc == 0 ? 0 : 1;
    }
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE_OR_DIR... | --seeds OUT FIXTURES\n", argv[0]);
        return 2;
    }
    if (LLVMFuzzerInitialize(&argc, &argv) != 0)
        return 1;
    long total = 0;
    for (int i = 1; i < argc; i++) {
        long n = run_path(argv[i]);
        if (n < 0) {
            tp_fuzz_llm_cleanup();
            return 1;
        }
        printf("replay: %s: %ld inputs\n", argv[i], n);
        total += n;
    }
    tp_fuzz_llm_cleanup();
    printf("replay: %ld inputs, no failure\n", total);
    return 0;
}
