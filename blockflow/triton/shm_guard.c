/* What Triton's shared-memory API may open, and the mode of what tritonserver creates there.
 *
 * Built into one library with argv_key.c and preloaded into tritonserver alone (the library
 * takes itself out of the environment of the block processes the server starts).
 *
 * 1. A client names a system shared-memory region and Triton opens it: shm_open(name, O_RDWR)
 *    in its shared-memory manager, without O_CREAT. Triton would open any name its user can,
 *    the server's own regions too: the Python backend's stub IPC (shm-region-prefix-name
 *    blockflow<pid>_...) and TensorMQ's host pools (blockflow-tmq-...). Writing a response
 *    into the first crashes the server; reading it leaks other clients' tensors. So here an
 *    open without O_CREAT of a name that starts with one of OWN_PREFIXES fails with EACCES, and
 *    Triton answers the registration with an error: BlockFlow's names, and the Python backend's
 *    default prefix (triton_python_backend_shm_region_..., another Triton's stubs on this host).
 *    tritonserver itself only creates such names (the Python backend creates each stub's region
 *    with O_CREAT | O_EXCL and the stub opens it); the TensorMQ pools are the stubs' own.
 * 2. Triton registers a second region of a key it already holds with the descriptor it kept
 *    from the first registration, which it closed right after mapping it (shared_memory_manager.cc,
 *    "FIXME: Consider invalid file descriptors after close"): by then the kernel may have given that
 *    number to another file of the server's (a stub's region, a socket), which Triton would map for
 *    the client, then close. So a descriptor shm_open gives Triton for a client's region is moved to
 *    a number from the top half of the descriptor limit, taken in turn (the soft limit is raised to
 *    the hard one first): the kernel gives out the lowest free number, so the server's own files
 *    never get these numbers, and a stale one names nothing: the second registration fails (EBADF).
 * 3. The Python backend (Boost.Interprocess) creates its regions and then fchmod()s them to
 *    0644, which no umask narrows: any local user could read the requests passing through. So
 *    in tritonserver a shared-memory object is created 0600 at most, and an fchmod of a
 *    /dev/shm file loses its group and other bits.
 *
 * blockflow.triton.access spells OWN_PREFIXES again (a test checks that they agree).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const OWN_PREFIXES[] = {"blockflow", "triton_"};
#define SHM_DIR "/dev/shm/"

typedef int (*shm_open_fn)(const char *, int, mode_t);
typedef int (*fchmod_fn)(int, mode_t);

static int owned_by_a_server(const char *name) {
    while (*name == '/') name++; /* glibc drops every leading slash too */
    for (size_t i = 0; i < sizeof OWN_PREFIXES / sizeof OWN_PREFIXES[0]; i++)
        if (strncmp(name, OWN_PREFIXES[i], strlen(OWN_PREFIXES[i])) == 0) return 1;
    return 0;
}

static int on_dev_shm(int fd) {
    char link[64], path[sizeof SHM_DIR + 256];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return 0;
    path[n] = '\0';
    return strncmp(path, SHM_DIR, sizeof SHM_DIR - 1) == 0;
}

static int high_base, high_end;  /* the descriptor numbers clients' regions get: [high_base, high_end) */
static atomic_uint high_next;

__attribute__((constructor)) static void reserve_high_descriptors(void) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
    if (r.rlim_cur < r.rlim_max) {
        r.rlim_cur = r.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &r) != 0 && getrlimit(RLIMIT_NOFILE, &r) != 0) return;
    }
    rlim_t limit = r.rlim_cur;
    if (limit == RLIM_INFINITY || limit > (1 << 20)) limit = 1 << 20; /* the kernel's default nr_open */
    high_end = (int)limit;
    high_base = high_end / 2;
}

/* fd moved to the next number of the high range (or left where it is, when the range is too small or full). */
static int away_from_reuse(int fd) {
    if (high_end - high_base < 64) return fd;
    int at = high_base + (int)(atomic_fetch_add(&high_next, 1) % (unsigned)(high_end - high_base));
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, at);
    if (moved < 0) return fd;
    close(fd);
    return moved;
}

int shm_open(const char *name, int oflag, mode_t mode) {
    shm_open_fn real = (shm_open_fn)dlsym(RTLD_NEXT, "shm_open");
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (name != NULL && !(oflag & O_CREAT) && owned_by_a_server(name)) {
        errno = EACCES;
        return -1;
    }
    int fd = real(name, oflag, mode & (S_IRUSR | S_IWUSR));
    return fd >= 0 && !(oflag & O_CREAT) ? away_from_reuse(fd) : fd;
}

int fchmod(int fd, mode_t mode) {
    fchmod_fn real = (fchmod_fn)dlsym(RTLD_NEXT, "fchmod");
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if ((mode & (S_IRWXG | S_IRWXO)) != 0 && on_dev_shm(fd)) mode &= ~(mode_t)(S_IRWXG | S_IRWXO);
    return real(fd, mode);
}
