/* Error reporting inside the `bie` command: a failing function records a message for the
 * calling thread and returns -1; the caller that reports to the user prints it. Library
 * errors (bie_status) are turned into messages with tool_fail_status. */
#ifndef BIE_TOOL_ERRORS_H
#define BIE_TOOL_ERRORS_H

#include "bie.h"

#if defined(__GNUC__)
#define TOOL_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define TOOL_PRINTF(f, a)
#endif

/* Record a message (printf format) as the calling thread's last error; returns -1. */
int tool_fail(const char *fmt, ...) TOOL_PRINTF(1, 2);
/* Record "<what>: <library message>" for a failed library call; returns -1. */
int tool_fail_status(bie_status status, const char *what);
/* The last recorded message ("" if none). */
const char *tool_error(void);

/* Evaluate a library call; on failure record its message and return -1 from the caller. */
#define TOOL_TRY_BIE(call)                                                        \
    do {                                                                          \
        bie_status tool_status_ = (call);                                         \
        if (tool_status_ != BIE_OK) return tool_fail_status(tool_status_, #call); \
    } while (0)

/* Propagate a -1 from a tool function. */
#define TOOL_TRY(call)              \
    do {                            \
        if ((call) != 0) return -1; \
    } while (0)

#endif
