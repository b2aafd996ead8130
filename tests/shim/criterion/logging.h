/* Criterion 2.4's logging macros (criterion/logging.h) for the in-process
 * shim; see criterion.h. Messages go to stderr with Criterion's prefixes:
 * "[----] " (info), "[WARN] ", "[ERR ] ". Unlike Criterion, info messages are
 * printed without --verbose. */
/* first, so that criterion.h sees this header whole whichever is included first */
#include "criterion.h"

#ifndef CRITERION_SHIM_LOGGING_H_
#define CRITERION_SHIM_LOGGING_H_

enum criterion_logging_level {
    CRITERION_INFO = 1,
    CRITERION_IMPORTANT,

    CRITERION_LOG_LEVEL_QUIET = 1 << 30,
};

enum criterion_severity {
    CR_LOG_INFO,
    CR_LOG_WARNING,
    CR_LOG_ERROR,
};

CRS_WEAK_ void cr_log(enum criterion_severity severity, const char *msg, ...) CRS_PRINTF_(2, 3);

#define cr_log_info(...) cr_log(CR_LOG_INFO, __VA_ARGS__)
#define cr_log_warn(...) cr_log(CR_LOG_WARNING, __VA_ARGS__)
#define cr_log_error(...) cr_log(CR_LOG_ERROR, __VA_ARGS__)

#endif /* !CRITERION_SHIM_LOGGING_H_ */
