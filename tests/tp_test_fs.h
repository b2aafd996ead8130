/* File-system helpers of the tests that write directories (checkpoints). */
#ifndef TP_TEST_FS_H
#define TP_TEST_FS_H

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Removes a directory tree (checkpoint directories in a test directory). */
static inline void tp_test_rm_tree(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char sub[1024];
        int n = snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        if (n < 0 || (size_t)n >= sizeof sub)
            continue; /* a path the tests never make */
        struct stat sb;
        if (lstat(sub, &sb) == 0 && S_ISDIR(sb.st_mode))
            tp_test_rm_tree(sub);
        else
            unlink(sub);
    }
    if (d)
        closedir(d);
    rmdir(path);
}

#endif /* TP_TEST_FS_H */
