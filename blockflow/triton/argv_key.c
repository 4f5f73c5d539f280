/* Puts BlockFlow's admin key into tritonserver's arguments inside the process.
 *
 * Triton takes the key of its restricted APIs only on its command line
 * (--http-restricted-api, --grpc-restricted-protocol), and a process's command line is
 * /proc/<pid>/cmdline, which every local user can read. BlockFlow passes a placeholder
 * there instead and preloads this library (LD_PRELOAD): glibc runs its constructor before
 * tritonserver's main with the same argv array main gets, and the constructor points each
 * argument holding the placeholder at a copy on the heap with the key in its place. The
 * strings /proc shows are never touched, so they keep the placeholder.
 *
 * The key comes from the file named by BLOCKFLOW_ADMIN_KEY_FILE (its first line); without
 * that variable, from 32 random bytes, a key nobody has. A key that cannot be read ends
 * the process (exit 78): Triton must never start with the placeholder, a public string,
 * as its key. The constructor then removes its variables and this library from the
 * environment, so the block processes tritonserver starts do not load it.
 *
 * Built once per user by blockflow.triton.argv_key (cc -shared -fPIC), or ahead of time
 * (the container image) with the same command and named by BLOCKFLOW_ARGV_KEY_LIB. Either
 * way ARGV_KEY_ID is the first 16 hex digits of this file's SHA-256, and BlockFlow
 * preloads only a library that carries the ID of the source it ships.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PLACEHOLDER "@BLOCKFLOW_ADMIN_KEY@"
#define KEY_FILE_VAR "BLOCKFLOW_ADMIN_KEY_FILE"
#define PRELOAD_VAR "BLOCKFLOW_ARGV_KEY_PRELOAD" /* the LD_PRELOAD to give back to children */
#define MAX_KEY 512
#ifndef ARGV_KEY_ID
#define ARGV_KEY_ID "unversioned"
#endif

/* Read back from the file by blockflow.triton.argv_key: a library built from another source
 * (an older BlockFlow's) may spell the placeholder or the variables otherwise. */
__attribute__((used)) static const char build_id[] = "blockflow-argv-key-id:" ARGV_KEY_ID;

static char key[MAX_KEY + 1];

static void die(const char *why) {
    fprintf(stderr, "blockflow argv-key: %s; tritonserver does not start\n", why);
    _exit(78);
}

static void read_key(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) die("cannot open the admin key file named by " KEY_FILE_VAR);
    ssize_t n = read(fd, key, MAX_KEY);
    close(fd);
    if (n < 0) die("cannot read the admin key file");
    key[n] = '\0';
    key[strcspn(key, "\r\n")] = '\0';
    if (key[0] == '\0') die("the admin key file is empty");
    if (strstr(key, PLACEHOLDER) != NULL) die("the admin key file holds the placeholder");
}

static void random_key(void) {
    unsigned char raw[32];
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, raw, sizeof raw) != (ssize_t)sizeof raw) die("cannot read /dev/urandom");
    close(fd);
    for (size_t i = 0; i < sizeof raw; i++) snprintf(key + 2 * i, 3, "%02x", raw[i]);
}

__attribute__((constructor)) static void put_key(int argc, char **argv, char **envp) {
    (void)envp;
    const size_t plen = strlen(PLACEHOLDER);
    for (int i = 1; i < argc; i++) {
        char *at = strstr(argv[i], PLACEHOLDER);
        if (at == NULL) continue;
        if (key[0] == '\0') {
            const char *path = getenv(KEY_FILE_VAR);
            if (path != NULL && path[0] != '\0') read_key(path); else random_key();
        }
        size_t before = (size_t)(at - argv[i]), klen = strlen(key), after = strlen(at + plen);
        char *arg = malloc(before + klen + after + 1);
        if (arg == NULL) die("out of memory");
        memcpy(arg, argv[i], before);
        memcpy(arg + before, key, klen);
        memcpy(arg + before + klen, at + plen, after + 1);
        if (strstr(arg, PLACEHOLDER) != NULL) die("an argument holds the placeholder twice");
        argv[i] = arg;
    }
    unsetenv(KEY_FILE_VAR);
    const char *preload = getenv(PRELOAD_VAR);
    if (preload != NULL && preload[0] != '\0') setenv("LD_PRELOAD", preload, 1); else unsetenv("LD_PRELOAD");
    unsetenv(PRELOAD_VAR);
}
