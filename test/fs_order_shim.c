/* fs_order_shim.c - logs the file-system calls a process makes on the files
   under one folder, in the order they return, for test/run_ckpt_order.sh
   (what reaches the disk, and when, in a checkpoint save).

   Preloaded (LD_PRELOAD) into every rank, it wraps open/openat/creat,
   write/pwrite, fsync/fdatasync, close, rename/renameat/renameat2 and
   unlink/unlinkat. A call on a path under FS_ORDER_DIR (or on a descriptor
   opened on one) that succeeds appends one line to the file FS_ORDER_LOG:

     <pid> <call> <path> [<new path>]

   one write(2) per line on an O_APPEND descriptor, so the lines of all ranks
   interleave whole, and a line is in the log before the call's caller goes
   on: the log's order is an order the calls happened in. Consecutive writes
   to one descriptor log one "write" line. A shim rather than `strace -f`:
   strace needs ptrace, which containers and CI runners often forbid (and
   Yama may restrict), its output format is not an interface, and fd-to-path
   bookkeeping across threads is then the parser's job.

     cc -shared -fPIC -O2 test/fs_order_shim.c -o build/fs_order_shim.so -ldl
     FS_ORDER_DIR=/tmp/x FS_ORDER_LOG=/tmp/x.log LD_PRELOAD=$PWD/build/fs_order_shim.so mpirun ... */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

enum { MAX_FDS = 4096 };
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char *fd_path[MAX_FDS]; /* descriptors open on a watched path */
static int fd_wrote[MAX_FDS];  /* a "write" line logged since the last other call on it */

static const char *watched_dir(void) {
    const char *d = getenv("FS_ORDER_DIR");
    return d && *d ? d : NULL;
}

/* The absolute form of `path` (relative to dirfd or the working folder),
   without resolving links; NULL when it is not under FS_ORDER_DIR. */
static char *watched(int dirfd, const char *path) {
    const char *dir = watched_dir();
    if (!dir || !path) return NULL;
    char full[PATH_MAX * 2];
    if (path[0] == '/') {
        snprintf(full, sizeof full, "%s", path);
    } else {
        char base[PATH_MAX];
        if (dirfd == AT_FDCWD || dirfd < 0) {
            if (!getcwd(base, sizeof base)) return NULL;
        } else if (dirfd < MAX_FDS && fd_path[dirfd]) {
            snprintf(base, sizeof base, "%s", fd_path[dirfd]);
        } else { /* a folder libc opened for itself (opendir, then dirfd) */
            char link[64];
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t k = readlink(link, base, sizeof base - 1);
            if (k <= 0) return NULL;
            base[k] = 0;
        }
        snprintf(full, sizeof full, "%s/%s", base, path);
    }
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    if (strncmp(full, dir, n) || (full[n] && full[n] != '/')) return NULL;
    return strdup(full);
}

static void log_line(const char *call, const char *a, const char *b) {
    static int log_fd = -1;
    const char *path = getenv("FS_ORDER_LOG");
    if (!path) return;
    if (log_fd < 0) log_fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) return;
    char line[PATH_MAX * 5];
    int n = snprintf(line, sizeof line, "%ld %s %s%s%s\n", (long)getpid(), call, a, b ? " " : "", b ? b : "");
    if (n > 0) (void)syscall(SYS_write, log_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

#define REAL(ret, name, ...)                                      \
    static ret (*real)(__VA_ARGS__);                              \
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, name)

/* fd is open on path (NULL: on a path not watched); takes path. An entry
   left by a close libc made for itself (fclose) goes here. */
static void opened(int fd, char *path) {
    if (fd < 0 || fd >= MAX_FDS) { free(path); return; }
    pthread_mutex_lock(&mu);
    free(fd_path[fd]);
    fd_path[fd] = path;
    fd_wrote[fd] = 0;
    if (path) log_line("open", path, NULL);
    pthread_mutex_unlock(&mu);
}

/* A call on descriptor fd succeeded: its line, unless fd is not watched
   (or call is "write" and fd's last line was one). */
static void on_fd(int fd, const char *call) {
    if (fd < 0 || fd >= MAX_FDS) return;
    pthread_mutex_lock(&mu);
    if (fd_path[fd]) {
        int write = !strcmp(call, "write");
        if (!write || !fd_wrote[fd]) log_line(call, fd_path[fd], NULL);
        fd_wrote[fd] = write;
        if (!strcmp(call, "close")) {
            free(fd_path[fd]);
            fd_path[fd] = NULL;
        }
    }
    pthread_mutex_unlock(&mu);
}

static mode_t mode_of(int flags, va_list ap) {
#ifdef O_TMPFILE
    if ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) return (mode_t)va_arg(ap, int);
#else
    if (flags & O_CREAT) return (mode_t)va_arg(ap, int);
#endif
    return 0;
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    REAL(int, "openat", int, const char *, int, ...);
    int fd = real(dirfd, path, flags, mode);
    if (fd >= 0) {
        pthread_mutex_lock(&mu);
        char *w = watched(dirfd, path);
        pthread_mutex_unlock(&mu);
        opened(fd, w);
    }
    return fd;
}
int open(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    return openat(AT_FDCWD, path, flags, mode);
}
int open64(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    return openat(AT_FDCWD, path, flags, mode);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_of(flags, ap);
    va_end(ap);
    return openat(dirfd, path, flags, mode);
}
int __open_2(const char *path, int flags) { return openat(AT_FDCWD, path, flags, 0); }
int __open64_2(const char *path, int flags) { return openat(AT_FDCWD, path, flags, 0); }
int creat(const char *path, mode_t mode) { return openat(AT_FDCWD, path, O_WRONLY | O_CREAT | O_TRUNC, mode); }

ssize_t write(int fd, const void *p, size_t n) {
    REAL(ssize_t, "write", int, const void *, size_t);
    ssize_t k = real(fd, p, n);
    if (k >= 0) on_fd(fd, "write");
    return k;
}
ssize_t pwrite(int fd, const void *p, size_t n, off_t off) {
    REAL(ssize_t, "pwrite", int, const void *, size_t, off_t);
    ssize_t k = real(fd, p, n, off);
    if (k >= 0) on_fd(fd, "write");
    return k;
}
ssize_t pwrite64(int fd, const void *p, size_t n, off_t off) {
    REAL(ssize_t, "pwrite64", int, const void *, size_t, off_t);
    ssize_t k = real(fd, p, n, off);
    if (k >= 0) on_fd(fd, "write");
    return k;
}
int fsync(int fd) {
    REAL(int, "fsync", int);
    int r = real(fd);
    if (r == 0) on_fd(fd, "fsync");
    return r;
}
int fdatasync(int fd) {
    REAL(int, "fdatasync", int);
    int r = real(fd);
    if (r == 0) on_fd(fd, "fsync");
    return r;
}
int close(int fd) {
    REAL(int, "close", int);
    on_fd(fd, "close"); /* before: once closed, another thread's open may reuse the number */
    return real(fd);
}

static void renamed(int olddir, const char *from, int newdir, const char *to) {
    pthread_mutex_lock(&mu);
    char *a = watched(olddir, from), *b = watched(newdir, to);
    if (a || b) log_line("rename", a ? a : from, b ? b : to);
    pthread_mutex_unlock(&mu);
    free(a);
    free(b);
}
int renameat2(int olddir, const char *from, int newdir, const char *to, unsigned int flags) {
    REAL(int, "renameat2", int, const char *, int, const char *, unsigned int);
    int r = real(olddir, from, newdir, to, flags);
    if (r == 0) renamed(olddir, from, newdir, to);
    return r;
}
int renameat(int olddir, const char *from, int newdir, const char *to) {
    REAL(int, "renameat", int, const char *, int, const char *);
    int r = real(olddir, from, newdir, to);
    if (r == 0) renamed(olddir, from, newdir, to);
    return r;
}
int rename(const char *from, const char *to) {
    REAL(int, "rename", const char *, const char *);
    int r = real(from, to);
    if (r == 0) renamed(AT_FDCWD, from, AT_FDCWD, to);
    return r;
}

static void unlinked(int dirfd, const char *path) {
    pthread_mutex_lock(&mu);
    char *w = watched(dirfd, path);
    if (w) log_line("unlink", w, NULL);
    pthread_mutex_unlock(&mu);
    free(w);
}
int unlinkat(int dirfd, const char *path, int flags) {
    REAL(int, "unlinkat", int, const char *, int);
    int r = real(dirfd, path, flags);
    if (r == 0) unlinked(dirfd, path);
    return r;
}
int unlink(const char *path) {
    REAL(int, "unlink", const char *);
    int r = real(path);
    if (r == 0) unlinked(AT_FDCWD, path);
    return r;
}
