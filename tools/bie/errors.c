#include "errors.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_message[1024];

int tool_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_message, sizeof last_message, fmt, ap);
    va_end(ap);
    return -1;
}

int tool_fail_status(bie_status status, const char *what) {
    /* The library's message names the failing function and the reason; the call text is
     * kept short (up to the first '(') so the message reads as one sentence. */
    int name_len = 0;
    while (what[name_len] && what[name_len] != '(') name_len++;
    return tool_fail("%.*s: %s (%s)", name_len, what, bie_last_error(), bie_status_name(status));
}

const char *tool_error(void) { return last_message; }
