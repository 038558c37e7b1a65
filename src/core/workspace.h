/* A workspace owned by an object (a layer): one buffer that grows to the largest request and
 * is reused by every call, so that a forward pass does not allocate its scratch memory each
 * time. A call reserves its total once (bie_ws_reserve), then takes aligned pieces of it
 * (bie_ws_take); the pieces are valid until the next reserve. Not thread-safe: one object is
 * used by one thread at a time. */
#ifndef BIE_WORKSPACE_H
#define BIE_WORKSPACE_H

#include <stddef.h>

#include "internal.h"

typedef struct bie_workspace {
    unsigned char *data;
    size_t cap, used;
} bie_workspace;

/* Bytes a piece of `bytes` occupies (64-byte aligned). */
static inline size_t bie_ws_piece(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* Room for `bytes` (the sum of bie_ws_piece of each piece to take), grown when short; earlier
 * pieces become invalid. Errors: out of memory (the workspace is unchanged). */
bie_status bie_ws_reserve(bie_workspace *ws, size_t bytes, const char *who);
/* The next piece of `bytes`, from the reserved room (NULL when the reservation is exceeded). */
void *bie_ws_take(bie_workspace *ws, size_t bytes);
void bie_ws_free(bie_workspace *ws);

#endif
