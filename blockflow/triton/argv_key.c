/* Puts BlockFlow's keys into tritonserver's arguments inside the process.
 *
 * Triton takes the keys of its restricted APIs only on its command line
 * (--http-restricted-api, --grpc-restricted-protocol), and a process's command line is
 * /proc/<pid>/cmdline, which every local user can read. BlockFlow passes placeholders
 * there instead and preloads this library (LD_PRELOAD): glibc runs its constructor before
 * tritonserver's main with the same argv array main gets, and the constructor points each
 * argument holding a placeholder at a copy on the heap with the key in its place. The
 * strings /proc shows are never touched, so they keep the placeholders.
 *
 * Two keys (blockflow.triton.access): the admin key (model repository, trace, logging) and
 * the shared-memory key (Triton's shared-memory API). Each comes from the file named by its
 * variable (its first line); without that variable, from 32 random bytes, a key nobody has.
 * A key that cannot be read ends the process (exit 78): Triton must never start with a
 * placeholder, a public string, as a key. The constructor then removes its variables and
 * this library from the environment, so the block processes tritonserver starts do not
 * load it.
 *
 * The same library holds shm_guard.c (what Triton's shared-memory API may open). Built once
 * per user by blockflow.triton.argv_key (cc -shared -fPIC argv_key.c shm_guard.c), or ahead of
 * time (the container image) with the same command and named by BLOCKFLOW_ARGV_KEY_LIB. Either
 * way ARGV_KEY_ID is the first 16 hex digits of the SHA-256 of the two sources (argv_key.c then
 * shm_guard.c), and BlockFlow preloads only a library that carries the ID of the sources it ships.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ADMIN_PLACEHOLDER "@BLOCKFLOW_ADMIN_KEY@"
#define ADMIN_KEY_FILE_VAR "BLOCKFLOW_ADMIN_KEY_FILE"
#define SHM_PLACEHOLDER "@BLOCKFLOW_SHM_KEY@"
#define SHM_KEY_FILE_VAR "BLOCKFLOW_SHM_KEY_FILE"
#define PRELOAD_VAR "BLOCKFLOW_ARGV_KEY_PRELOAD" /* the LD_PRELOAD to give back to children */
#define MAX_KEY 512
#ifndef ARGV_KEY_ID
#define ARGV_KEY_ID "unversioned"
#endif

/* Read back from the file by blockflow.triton.argv_key: a library built from another source
 * (an older BlockFlow's) may spell the placeholder or the variables otherwise. */
__attribute__((used)) static const char build_id[] = "blockflow-argv-key-id:" ARGV_KEY_ID;

struct secret {
    const char *placeholder, *file_var;
    char key[MAX_KEY + 1];
};

static struct secret secrets[] = {
    {ADMIN_PLACEHOLDER, ADMIN_KEY_FILE_VAR, ""},
    {SHM_PLACEHOLDER, SHM_KEY_FILE_VAR, ""},
};
#define N_SECRETS (sizeof secrets / sizeof secrets[0])

static void die(const char *why, const char *var) {
    fprintf(stderr, "blockflow argv-key: %s (%s); tritonserver does not start\n", why, var);
    _exit(78);
}

static int holds_a_placeholder(const char *s) {
    for (size_t i = 0; i < N_SECRETS; i++)
        if (strstr(s, secrets[i].placeholder) != NULL) return 1;
    return 0;
}

static void read_key(struct secret *s, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) die("cannot open the key file", s->file_var);
    ssize_t n = read(fd, s->key, MAX_KEY);
    close(fd);
    if (n < 0) die("cannot read the key file", s->file_var);
    s->key[n] = '\0';
    s->key[strcspn(s->key, "\r\n")] = '\0';
    if (s->key[0] == '\0') die("the key file is empty", s->file_var);
    if (holds_a_placeholder(s->key)) die("the key file holds a placeholder", s->file_var);
}

static void random_key(struct secret *s) {
    unsigned char raw[32];
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, raw, sizeof raw) != (ssize_t)sizeof raw) die("cannot read /dev/urandom", s->file_var);
    close(fd);
    for (size_t i = 0; i < sizeof raw; i++) snprintf(s->key + 2 * i, 3, "%02x", raw[i]);
}

/* arg with s's placeholder (at `at`) replaced by its key, on the heap. */
static char *with_key(struct secret *s, const char *arg, const char *at) {
    if (s->key[0] == '\0') {
        const char *path = getenv(s->file_var);
        if (path != NULL && path[0] != '\0') read_key(s, path); else random_key(s);
    }
    size_t plen = strlen(s->placeholder);
    size_t before = (size_t)(at - arg), klen = strlen(s->key), after = strlen(at + plen);
    char *out = malloc(before + klen + after + 1);
    if (out == NULL) die("out of memory", s->file_var);
    memcpy(out, arg, before);
    memcpy(out + before, s->key, klen);
    memcpy(out + before + klen, at + plen, after + 1);
    if (strstr(out, s->placeholder) != NULL) die("an argument holds a placeholder twice", s->file_var);
    return out;
}

__attribute__((constructor)) static void put_keys(int argc, char **argv, char **envp) {
    (void)envp;
    for (int i = 1; i < argc; i++) {
        for (size_t k = 0; k < N_SECRETS; k++) {
            const char *at = strstr(argv[i], secrets[k].placeholder);
            if (at != NULL) argv[i] = with_key(&secrets[k], argv[i], at);
        }
    }
    for (size_t k = 0; k < N_SECRETS; k++) unsetenv(secrets[k].file_var);
    const char *preload = getenv(PRELOAD_VAR);
    if (preload != NULL && preload[0] != '\0') setenv("LD_PRELOAD", preload, 1); else unsetenv("LD_PRELOAD");
    unsetenv(PRELOAD_VAR);
}
