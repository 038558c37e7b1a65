/* Internal helpers shared by every part of the library: error reporting, checked sizes,
 * aligned allocation. Not installed. */
#ifndef BIE_INTERNAL_H
#define BIE_INTERNAL_H

#include <stdint.h>
#include <stdlib.h>

#include "bie.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define BIE_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define BIE_PRINTF(f, a)
#endif

/* Record `msg` as the calling thread's last error and return `status`. */
bie_status bie_fail(bie_status status, const char *fmt, ...) BIE_PRINTF(2, 3);

/* Return early with the status of a failing call. */
#define BIE_TRY(call)                                          \
    do {                                                       \
        bie_status bie_try_status_ = (call);                   \
        if (bie_try_status_ != BIE_OK) return bie_try_status_; \
    } while (0)

#define BIE_CHECK_NULL(p)                                                                         \
    do {                                                                                          \
        if ((p) == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: '%s' is NULL", __func__, #p); \
    } while (0)

/* a * b into *out; false on overflow or negative operands. */
static inline int bie_mul_ok(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0) return 0;
    return !__builtin_mul_overflow(a, b, out);
}

/* 64-byte aligned allocation; size 0 allocates 64 bytes. Free with bie_free_aligned. */
void *bie_alloc_aligned(size_t bytes);
void bie_free_aligned(void *p);

/* Number of threads for a parallel region. */
int bie_threads(void);
/* Give the calling thread's OpenMP default (which OpenBLAS follows) the requested count. */
void bie_blas_threads(void);

#ifdef __cplusplus
}
#endif
#endif
