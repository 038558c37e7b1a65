/* The grow-and-reuse workspace (workspace.h). */
#include "workspace.h"

bie_status bie_ws_reserve(bie_workspace *ws, size_t bytes, const char *who) {
    if (bytes > ws->cap) {
        unsigned char *p = bie_alloc_aligned(bytes);
        if (p == NULL)
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace of %zu bytes", who, bytes);
        bie_free_aligned(ws->data);
        ws->data = p;
        ws->cap = bytes;
    }
    ws->used = 0;
    return BIE_OK;
}

void *bie_ws_take(bie_workspace *ws, size_t bytes) {
    const size_t piece = bie_ws_piece(bytes);
    if (piece > ws->cap - ws->used) return NULL;
    void *p = ws->data + ws->used;
    ws->used += piece;
    return p;
}

void bie_ws_free(bie_workspace *ws) {
    bie_free_aligned(ws->data);
    ws->data = NULL;
    ws->cap = ws->used = 0;
}
