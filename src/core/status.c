#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[512];

bie_status bie_fail(bie_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *bie_last_error(void) { return last_error; }

const char *bie_status_name(bie_status status) {
    switch (status) {
    case BIE_OK: return "BIE_OK";
    case BIE_ERR_NULL_POINTER: return "BIE_ERR_NULL_POINTER";
    case BIE_ERR_INVALID_ARGUMENT: return "BIE_ERR_INVALID_ARGUMENT";
    case BIE_ERR_SHAPE: return "BIE_ERR_SHAPE";
    case BIE_ERR_DTYPE: return "BIE_ERR_DTYPE";
    case BIE_ERR_DEVICE: return "BIE_ERR_DEVICE";
    case BIE_ERR_UNSUPPORTED: return "BIE_ERR_UNSUPPORTED";
    case BIE_ERR_STATE: return "BIE_ERR_STATE";
    case BIE_ERR_OUT_OF_MEMORY: return "BIE_ERR_OUT_OF_MEMORY";
    case BIE_ERR_OVERFLOW: return "BIE_ERR_OVERFLOW";
    case BIE_ERR_NOT_FINITE: return "BIE_ERR_NOT_FINITE";
    case BIE_ERR_IO: return "BIE_ERR_IO";
    case BIE_ERR_CUDA: return "BIE_ERR_CUDA";
    case BIE_ERR_INTERNAL: return "BIE_ERR_INTERNAL";
    }
    return "BIE_ERR_UNKNOWN";
}

const char *bie_version_string(void) { return "0.1.0"; }
