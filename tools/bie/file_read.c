#include "file_read.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"

int tool_open_regular(const char *path, int *fd, int64_t *size) {
    /* O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting. */
    int d = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (d < 0) return tool_fail("cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(d, &st) != 0) {
        int e = errno;
        close(d);
        return tool_fail("cannot read %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(d);
        if (S_ISDIR(st.st_mode)) return tool_fail("%s: is a directory, not a file", path);
        return tool_fail("%s: not a regular file (%s)", path,
                         S_ISFIFO(st.st_mode)   ? "a FIFO"
                         : S_ISCHR(st.st_mode)  ? "a character device"
                         : S_ISBLK(st.st_mode)  ? "a block device"
                         : S_ISSOCK(st.st_mode) ? "a socket"
                                                : "unknown type");
    }
    /* Regular files never block; reads go back to the ordinary blocking mode. */
    int flags = fcntl(d, F_GETFL);
    if (flags >= 0) (void)fcntl(d, F_SETFL, flags & ~O_NONBLOCK);
    *fd = d;
    *size = (int64_t)st.st_size;
    return 0;
}

int tool_read_regular(const char *path, int64_t max_bytes, uint8_t **bytes, size_t *size) {
    int fd;
    int64_t len;
    TOOL_TRY(tool_open_regular(path, &fd, &len));
    if (len > max_bytes || (uint64_t)len >= (uint64_t)SIZE_MAX / 2) {
        close(fd);
        return tool_fail("%s: file too large (%lld bytes, at most %lld)", path, (long long)len,
                         (long long)max_bytes);
    }
    uint8_t *buf = malloc(len ? (size_t)len : 1);
    if (!buf) {
        close(fd);
        return tool_fail("%s: out of memory (%lld bytes)", path, (long long)len);
    }
    size_t done = 0;
    int status = 0;
    while (status == 0 && done < (size_t)len) {
        size_t chunk = (size_t)len - done;
        ssize_t n = read(fd, buf + done, chunk < (1u << 30) ? chunk : (1u << 30));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0)
            status = tool_fail("cannot read %s: %s", path, strerror(errno));
        else if (n == 0)
            status =
                tool_fail("cannot read %s: short read (the file shrank to %zu bytes)", path, done);
        else
            done += (size_t)n;
    }
    close(fd);
    if (status != 0) {
        free(buf);
        return -1;
    }
    *bytes = buf;
    *size = (size_t)len;
    return 0;
}
