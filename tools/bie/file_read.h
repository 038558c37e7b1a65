/* Opening input files without trusting them: only regular files are read (a FIFO or a
 * device such as /dev/zero would block or never end, a directory has no contents), and the
 * check happens on the open descriptor, before any read, without blocking (O_NONBLOCK). */
#ifndef BIE_TOOL_FILE_READ_H
#define BIE_TOOL_FILE_READ_H

#include <stddef.h>
#include <stdint.h>

/* Open `path` read-only if it is a regular file: *fd is the descriptor (the caller closes
 * it), *size the file's length. Errors (-1, tool_error): cannot open, "is a directory",
 * "not a regular file" (FIFO, socket, device). */
int tool_open_regular(const char *path, int *fd, int64_t *size);

/* Read a whole regular file of at most max_bytes into *bytes (malloc'ed, *size bytes).
 * Errors: those of tool_open_regular, larger than max_bytes, read errors, a file that
 * shrinks while read. */
int tool_read_regular(const char *path, int64_t max_bytes, uint8_t **bytes, size_t *size);

#endif
