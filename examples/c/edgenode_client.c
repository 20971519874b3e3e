/* edgenode_client.c: a generate and a streamed generate to an edgenode, in C.
 *
 * Wire protocol version 1 (docs/PROTOCOL.md): a DEALER socket sends
 * ["", "EDGE/C1", body] where body is one msgpack map with str keys, and reads
 * replies framed the same way: zero or more "partial", then one "ok" or "error"
 * per request id. libzmq and msgpack-c (the C library) only.
 *
 * Build: make -C examples/c      (Debian: apt-get install libzmq3-dev libmsgpack-dev)
 *    or: cc -std=c11 -O2 -Wall -Wextra edgenode_client.c -o edgenode_client \
 *            $(pkg-config --cflags --libs libzmq msgpack)
 * Run:   ./edgenode_client [-s server.key -k client.key_secret] [-t timeout_ms]
 *                          [endpoint] [prompt] [max_tokens]
 *
 * CURVE (a node with [security], PROTOCOL §1.3): -s names the node's public key
 * file (NAME.key) and -k this client's keypair file (NAME.key_secret), both as
 * `edgenode keys generate` writes them; or $EDGENODE_SERVER_KEY_FILE and
 * $EDGENODE_CLIENT_KEY_FILE. -t sets the request budget (ms, default 30000).
 *
 * Output (stdout), one request after the other:
 *   generate text: <the reply's text>
 *   generate ok finish_reason=... served_by=... worker=... degraded=0 completion_tokens=N ...
 *   stream partial 0: <piece>          (one line per partial, as it arrives)
 *   stream text: <the final reply's text, the partials joined>
 *   stream ok partials=N finish_reason=... ...
 * Text from the node is printed as it is (UTF-8, newlines and tabs included) except
 * control characters: the other C0 controls, DEL and the C1 controls (U+0080..U+009F,
 * e.g. ESC or CSI, which a terminal would act on) and bytes that are not UTF-8 are
 * printed as \xHH (C1 as \u00HH).
 * An error reply prints "<label> error <code> <name> reason=<reason>: <message>" on
 * stderr and exits 1; no reply in time exits 2; bad usage, an unreadable key or a
 * socket error exits 3; a reply that breaks the protocol (framing, body, or a field
 * missing or of the wrong type, PROTOCOL §4) exits 4 with "malformed reply: ..." on stderr.
 */
#define _POSIX_C_SOURCE 200809L

#include <msgpack.h>
#include <zmq.h>

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char TAG[] = "EDGE/C1"; /* protocol version 1, client conversation */
#define TAG_LEN 7
#define DEFAULT_TIMEOUT_MS 30000 /* the node's budget for each request */
#define SLACK_MS 2000            /* the node answers 504 at the deadline itself */
#define MAX_FRAMES 4             /* a reply has 3; more is not an EDGE/C1 reply */
#define Z85_KEY_LEN 40           /* a CURVE key in Z85 text (32 bytes raw) */

static int64_t timeout_ms = DEFAULT_TIMEOUT_MS;

/* Exit statuses (also in examples/c/README.md). */
enum { EXIT_OK = 0, EXIT_ERROR_REPLY = 1, EXIT_NO_REPLY = 2, EXIT_USAGE = 3, EXIT_MALFORMED = 4 };

/* ---- packing: text is always msgpack str, never bin (PROTOCOL §2.1) ---------- */

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* A generate request body: {id, op, prompt, max_tokens, timeout_ms[, stream]}. */
static void pack_generate(msgpack_sbuffer *buf, const char *id, const char *prompt,
                          int64_t max_tokens, bool stream) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, stream ? 6 : 5);
    pack_str(&pk, "id");
    pack_str(&pk, id);
    pack_str(&pk, "op");
    pack_str(&pk, "generate");
    pack_str(&pk, "prompt");
    pack_str(&pk, prompt);
    pack_str(&pk, "max_tokens");
    msgpack_pack_int64(&pk, max_tokens); /* an integer type, never a float */
    pack_str(&pk, "timeout_ms");
    msgpack_pack_int64(&pk, timeout_ms);
    if (stream) {
        pack_str(&pk, "stream");
        msgpack_pack_true(&pk); /* msgpack bool, not 0/1 */
    }
}

/* ---- reading a reply map ---------------------------------------------------- */

/* The value of `key` in a msgpack map, or NULL when absent (or not a map). */
static const msgpack_object *field(const msgpack_object *map, const char *key) {
    if (map->type != MSGPACK_OBJECT_MAP) return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; ++i) {
        const msgpack_object_kv *kv = &map->via.map.ptr[i];
        if (kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == n &&
            memcmp(kv->key.via.str.ptr, key, n) == 0)
            return &kv->val;
    }
    return NULL;
}

/* True if `key` holds a str equal to `want`. */
static bool str_is(const msgpack_object *map, const char *key, const char *want) {
    const msgpack_object *v = field(map, key);
    size_t n = strlen(want);
    return v && v->type == MSGPACK_OBJECT_STR && v->via.str.size == n &&
           memcmp(v->via.str.ptr, want, n) == 0;
}

/* Write `n` bytes of text from the node, escaping what a terminal would act on:
 * C0 controls but newline and tab, and DEL, as \xHH; C1 controls (U+0080..U+009F)
 * as \u00HH; a byte that does not start a whole, shortest-form UTF-8 sequence as
 * \xHH. Everything else (printable UTF-8, newlines, tabs) is written as it is. */
static void write_text(FILE *out, const char *s, size_t n) {
    const unsigned char *b = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = b[i];
        if (c < 0x80) {
            if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f)
                fprintf(out, "\\x%02x", c);
            else
                fputc((int)c, out);
            ++i;
            continue;
        }
        /* Length and smallest code point of the sequence this lead byte starts. */
        size_t len = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3
                   : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        uint32_t cp = len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        bool whole = len > 0 && i + len <= n;
        for (size_t k = 1; whole && k < len; ++k) {
            if ((b[i + k] & 0xc0) != 0x80) whole = false;
            cp = (cp << 6) | (b[i + k] & 0x3f);
        }
        if (whole && ((len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
                      (len == 4 && (cp < 0x10000 || cp > 0x10ffff))))
            whole = false; /* overlong, a surrogate, or past U+10FFFF */
        if (!whole) {
            fprintf(out, "\\x%02x", c);
            ++i;
        } else if (cp <= 0x9f) { /* len 2, U+0080..U+009F: the C1 controls */
            fprintf(out, "\\u%04" PRIx32, cp);
            i += len;
        } else {
            fwrite(b + i, 1, len, out);
            i += len;
        }
    }
}

/* Print a str field, escaped (nothing when absent, nil or not a str: e.g. "reason"). */
static void print_str(FILE *out, const msgpack_object *map, const char *key) {
    const msgpack_object *v = field(map, key);
    if (v && v->type == MSGPACK_OBJECT_STR) write_text(out, v->via.str.ptr, v->via.str.size);
}

/* ---- checking a reply against PROTOCOL §4 ------------------------------------ */

static bool bool_field(const msgpack_object *map, const char *key);

typedef enum { T_STR, T_UINT, T_BOOL, T_MAP, T_NUMBER, T_STR_OR_NIL } kind_t;

static const char *kind_name(kind_t kind) {
    switch (kind) {
    case T_STR: return "a str";
    case T_UINT: return "a non-negative integer";
    case T_BOOL: return "a bool";
    case T_MAP: return "a map";
    case T_NUMBER: return "a number";
    case T_STR_OR_NIL: return "a str or nil";
    }
    return "?";
}

static bool is_kind(const msgpack_object *v, kind_t kind) {
    switch (kind) {
    case T_STR: return v->type == MSGPACK_OBJECT_STR;
    case T_UINT: return v->type == MSGPACK_OBJECT_POSITIVE_INTEGER && v->via.u64 <= INT64_MAX;
    case T_BOOL: return v->type == MSGPACK_OBJECT_BOOLEAN;
    case T_MAP: return v->type == MSGPACK_OBJECT_MAP;
    case T_NUMBER:
        return v->type == MSGPACK_OBJECT_FLOAT32 || v->type == MSGPACK_OBJECT_FLOAT64 ||
               v->type == MSGPACK_OBJECT_POSITIVE_INTEGER;
    case T_STR_OR_NIL: return v->type == MSGPACK_OBJECT_STR || v->type == MSGPACK_OBJECT_NIL;
    }
    return false;
}

/* Check `key` of `map`: present (if `required`) and of `kind`. On a violation,
 * writes why into `why` and returns false. */
static bool check(const msgpack_object *map, const char *key, kind_t kind, bool required,
                  char *why, size_t size) {
    const msgpack_object *v = field(map, key);
    if (!v) {
        if (required) snprintf(why, size, "\"%s\" is missing", key);
        return !required;
    }
    if (!is_kind(v, kind)) {
        snprintf(why, size, "\"%s\" is not %s", key, kind_name(kind));
        return false;
    }
    return true;
}

/* Whether a reply body to one of our generate requests is well-formed for its
 * status (PROTOCOL §4.1, §4.2, §4.4: the fields this client reads and those always
 * present); if not, why. */
static bool well_formed(const msgpack_object *reply, char *why, size_t size) {
#define NEED(key, kind) check(reply, key, kind, true, why, size)
#define MAY(key, kind) check(reply, key, kind, false, why, size)
    if (str_is(reply, "status", "partial"))
        return NEED("text", T_STR) && NEED("index", T_UINT) && MAY("dropped_partials", T_UINT);
    if (str_is(reply, "status", "error"))
        return NEED("code", T_UINT) && NEED("error", T_STR) && NEED("message", T_STR) &&
               MAY("reason", T_STR_OR_NIL) && MAY("retry_after_ms", T_UINT) &&
               MAY("text", T_STR);
    /* "ok" */
    if (!(NEED("text", T_STR) && NEED("finish_reason", T_STR) && NEED("usage", T_MAP) &&
          NEED("served_by", T_STR) && NEED("worker", T_STR) && NEED("degraded", T_BOOL) &&
          NEED("queue_ms", T_UINT) && NEED("ttft_ms", T_UINT) && NEED("total_ms", T_UINT) &&
          MAY("dropped_partials", T_UINT) && MAY("confidence", T_NUMBER) &&
          MAY("rule", T_STR_OR_NIL)))
        return false;
    if (bool_field(reply, "degraded") && !NEED("degrade_reason", T_STR)) return false;
    const msgpack_object *usage = field(reply, "usage");
    static const char *const counts[] = {"prompt_tokens", "completion_tokens", "cached_tokens"};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; ++i)
        if (!check(usage, counts[i], T_UINT, false, why, size)) {
            size_t used = strlen(why);
            snprintf(why + used, size - used, " (in \"usage\")");
            return false;
        }
    return true;
#undef NEED
#undef MAY
}

/* An integer field as int64 (replies hold non-negative ints), or `dflt`. */
static int64_t int_field(const msgpack_object *map, const char *key, int64_t dflt) {
    const msgpack_object *v = field(map, key);
    if (v && v->type == MSGPACK_OBJECT_POSITIVE_INTEGER && v->via.u64 <= INT64_MAX)
        return (int64_t)v->via.u64;
    if (v && v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) return v->via.i64;
    return dflt;
}

static bool bool_field(const msgpack_object *map, const char *key) {
    const msgpack_object *v = field(map, key);
    return v && v->type == MSGPACK_OBJECT_BOOLEAN && v->via.boolean;
}

/* The summary line of an "ok" reply (PROTOCOL §4.2). */
static void print_ok(const char *label, const msgpack_object *reply, int partials) {
    const msgpack_object *usage = field(reply, "usage");
    printf("%s text: ", label);
    print_str(stdout, reply, "text");
    printf("\n%s ok", label);
    if (partials >= 0) printf(" partials=%d", partials);
    printf(" finish_reason=");
    print_str(stdout, reply, "finish_reason");
    printf(" served_by=");
    print_str(stdout, reply, "served_by"); /* "llm" or "rules" */
    printf(" worker=");
    print_str(stdout, reply, "worker");
    printf(" degraded=%d completion_tokens=%" PRId64 " queue_ms=%" PRId64 " ttft_ms=%" PRId64
           " total_ms=%" PRId64 "\n",
           bool_field(reply, "degraded"), usage ? int_field(usage, "completion_tokens", -1) : -1,
           int_field(reply, "queue_ms", -1), int_field(reply, "ttft_ms", -1),
           int_field(reply, "total_ms", -1));
}

/* ---- the socket ------------------------------------------------------------- */

static int send_request(void *sock, const msgpack_sbuffer *body) {
    /* A DEALER sends the empty delimiter frame itself: ["", "EDGE/C1", body]. */
    if (zmq_send(sock, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(sock, TAG, TAG_LEN, ZMQ_SNDMORE) < 0 ||
        zmq_send(sock, body->data, body->size, 0) < 0)
        return -1;
    return 0;
}

/* Receive one multipart message into frames[] (the extra frames of a longer one
 * are read and dropped); returns how many frames it had, or -1 on a socket error. */
static int recv_message(void *sock, zmq_msg_t frames[MAX_FRAMES]) {
    int count = 0;
    int more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            for (int i = 0; i < count && i < MAX_FRAMES; ++i) zmq_msg_close(&frames[i]);
            return -1;
        }
        more = zmq_msg_more(&part);
        if (count < MAX_FRAMES) { /* kept: closed by the caller */
            zmq_msg_init(&frames[count]);
            zmq_msg_move(&frames[count], &part);
        }
        zmq_msg_close(&part);
        ++count;
    }
    return count;
}

/* A reply that breaks the protocol: say what and where, exit status 4. */
static int malformed(const char *label, const char *why) {
    fprintf(stderr, "%s: malformed reply: %s\n", label, why);
    return EXIT_MALFORMED;
}

/* Send one generate and read its replies until its final one.
 * Returns 0 on "ok", 1 on "error", 2 when no reply came in time, 3 on a socket
 * error, 4 on a malformed reply (bad framing, an undecodable body, a body that is
 * not a map, a missing or ill-typed id or status, or a field of ours of the wrong
 * type: the node never sends one, so something else is talking). */
static int run(void *sock, const char *label, const char *id, const char *prompt,
               int64_t max_tokens, bool stream) {
    msgpack_sbuffer body;
    msgpack_sbuffer_init(&body);
    pack_generate(&body, id, prompt, max_tokens, stream);
    int rc = send_request(sock, &body);
    msgpack_sbuffer_destroy(&body);
    if (rc < 0) {
        fprintf(stderr, "%s: send failed: %s\n", label, zmq_strerror(zmq_errno()));
        return EXIT_USAGE;
    }
    int partials = 0;
    long wait_ms = (long)(timeout_ms + SLACK_MS);
    for (;;) {
        zmq_pollitem_t items[] = {{sock, 0, ZMQ_POLLIN, 0}};
        int ready = zmq_poll(items, 1, wait_ms);
        if (ready < 0) {
            fprintf(stderr, "%s: poll failed: %s\n", label, zmq_strerror(zmq_errno()));
            return EXIT_USAGE;
        }
        if (ready == 0) {
            fprintf(stderr, "%s: no reply within %ld ms (is the node running? its key?)\n",
                    label, wait_ms);
            return EXIT_NO_REPLY;
        }
        zmq_msg_t frames[MAX_FRAMES];
        int n = recv_message(sock, frames);
        if (n < 0) {
            fprintf(stderr, "%s: receive failed: %s\n", label, zmq_strerror(zmq_errno()));
            return EXIT_USAGE;
        }
        bool framed = n == 3 && zmq_msg_size(&frames[0]) == 0 &&
                      zmq_msg_size(&frames[1]) == TAG_LEN &&
                      memcmp(zmq_msg_data(&frames[1]), TAG, TAG_LEN) == 0;
        int result = -1; /* -1: not final yet */
        char why[160] = "";
        msgpack_unpacked un;
        msgpack_unpacked_init(&un);
        size_t off = 0;
        if (!framed) {
            snprintf(why, sizeof why, "%d frames, not [\"\", \"%s\", body]", n, TAG);
            result = malformed(label, why);
        } else if (msgpack_unpack_next(&un, zmq_msg_data(&frames[2]), zmq_msg_size(&frames[2]),
                                       &off) != MSGPACK_UNPACK_SUCCESS ||
                   off != zmq_msg_size(&frames[2])) {
            result = malformed(label, "the body is not one msgpack value");
        } else if (un.data.type != MSGPACK_OBJECT_MAP) {
            result = malformed(label, "the body is not a map");
        } else {
            const msgpack_object *reply = &un.data;
            const msgpack_object *rid = field(reply, "id");
            bool known_status = str_is(reply, "status", "partial") ||
                                str_is(reply, "status", "ok") || str_is(reply, "status", "error");
            /* Replies are matched by id; nil means the node could not read the id of
             * a message we sent: with one request in flight, it is ours. Anything else
             * is a late reply to some earlier request, and is ignored. */
            bool ours = str_is(reply, "id", id);
            bool nil_id = rid && rid->type == MSGPACK_OBJECT_NIL;
            if (!rid || !(rid->type == MSGPACK_OBJECT_STR || nil_id ||
                          rid->type == MSGPACK_OBJECT_POSITIVE_INTEGER)) {
                result = malformed(label, "\"id\" is missing or not a str, int or nil");
            } else if (!known_status) {
                result = malformed(label, "\"status\" is missing or not partial, ok or error");
            } else if ((ours || nil_id) && !well_formed(reply, why, sizeof why)) {
                result = malformed(label, why);
            } else if (nil_id && str_is(reply, "status", "ok")) {
                result = malformed(label, "an \"ok\" reply with a nil id");
            } else if ((ours || nil_id) && str_is(reply, "status", "partial")) {
                printf("%s partial %" PRId64 ": ", label, int_field(reply, "index", -1));
                print_str(stdout, reply, "text");
                printf("\n");
                fflush(stdout);
                ++partials;
            } else if (ours && str_is(reply, "status", "ok")) {
                print_ok(label, reply, stream ? partials : -1);
                result = EXIT_OK;
            } else if ((ours || nil_id) && str_is(reply, "status", "error")) {
                fprintf(stderr, "%s error %" PRId64 " ", label, int_field(reply, "code", -1));
                print_str(stderr, reply, "error");
                fprintf(stderr, " reason=");
                print_str(stderr, reply, "reason"); /* e.g. queue_full; empty if none */
                fprintf(stderr, " retry_after_ms=%" PRId64 ": ",
                        int_field(reply, "retry_after_ms", -1)); /* -1: absent */
                print_str(stderr, reply, "message");
                fprintf(stderr, "\n");
                result = EXIT_ERROR_REPLY;
            }
        }
        msgpack_unpacked_destroy(&un);
        for (int i = 0; i < n && i < MAX_FRAMES; ++i) zmq_msg_close(&frames[i]);
        if (result >= 0) return result;
    }
}

/* Read the Z85 text of `name = "<40 characters>"` from a key file in the format
 * `edgenode keys generate` (pyzmq's zmq.auth) writes: NAME.key holds public-key,
 * NAME.key_secret both public-key and secret-key. Returns false, with a message on
 * stderr naming the file, when it is unreadable, lacks the key or holds no valid Z85. */
static bool read_key(const char *path, const char *name, char out[Z85_KEY_LEN + 1]) {
    FILE *in = fopen(path, "r");
    if (!in) {
        fprintf(stderr, "cannot read the key file %s: %s\n", path, strerror(errno));
        return false;
    }
    char line[512];
    bool found = false;
    size_t name_len = strlen(name);
    while (!found && fgets(line, sizeof line, in)) {
        char *at = line;
        while (*at == ' ' || *at == '\t') ++at;
        if (strncmp(at, name, name_len) != 0) continue;
        at += name_len;
        while (*at == ' ' || *at == '\t') ++at;
        if (*at++ != '=') continue;
        while (*at == ' ' || *at == '\t') ++at;
        if (*at++ != '"') continue;
        char *end = strchr(at, '"');
        if (!end || end - at != Z85_KEY_LEN) continue;
        memcpy(out, at, Z85_KEY_LEN);
        out[Z85_KEY_LEN] = '\0';
        found = true;
    }
    fclose(in);
    uint8_t raw[32];
    if (!found || !zmq_z85_decode(raw, out)) {
        fprintf(stderr, "the key file %s has no valid %s = \"<40 Z85 characters>\" line\n",
                path, name);
        return false;
    }
    return true;
}

/* Make `sock` a CURVE client of the node whose public key is in `server_file`,
 * proving the keypair in `client_file` (PROTOCOL §1.3). */
static bool set_curve(void *sock, const char *server_file, const char *client_file) {
    char server[Z85_KEY_LEN + 1], public_key[Z85_KEY_LEN + 1], secret[Z85_KEY_LEN + 1];
    if (!read_key(server_file, "public-key", server) ||
        !read_key(client_file, "public-key", public_key) ||
        !read_key(client_file, "secret-key", secret))
        return false;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server, Z85_KEY_LEN) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, public_key, Z85_KEY_LEN) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, secret, Z85_KEY_LEN) != 0) {
        fprintf(stderr, "cannot set the CURVE keys: %s (a libzmq without CURVE?)\n",
                zmq_strerror(zmq_errno()));
        return false;
    }
    memset(secret, 0, sizeof secret);
    return true;
}

/* The node's default frontend: ipc://<run_dir>/frontend.sock, where run_dir is
 * $EDGENODE_RUN_DIR, else $XDG_RUNTIME_DIR/edgenode, else /tmp/edgenode-<uid>
 * (PROTOCOL §1.1; a run_dir set in the node's config is not visible here). */
static void default_endpoint(char *out, size_t size) {
    const char *run = getenv("EDGENODE_RUN_DIR");
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (run && *run)
        snprintf(out, size, "ipc://%s/frontend.sock", run);
    else if (xdg && *xdg)
        snprintf(out, size, "ipc://%s/edgenode/frontend.sock", xdg);
    else
        snprintf(out, size, "ipc:///tmp/edgenode-%lu/frontend.sock", (unsigned long)getuid());
}

static int usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s [-s server.key -k client.key_secret] [-t timeout_ms 1..3600000]\n"
            "       [endpoint] [prompt, non-empty] [max_tokens 1..32768]\n"
            "  -s, -k: CURVE keys (or $EDGENODE_SERVER_KEY_FILE, $EDGENODE_CLIENT_KEY_FILE)\n",
            argv0);
    return EXIT_USAGE;
}

int main(int argc, char **argv) {
    const char *server_file = getenv("EDGENODE_SERVER_KEY_FILE");
    const char *client_file = getenv("EDGENODE_CLIENT_KEY_FILE");
    char *end = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "s:k:t:")) != -1) {
        switch (opt) {
        case 's': server_file = optarg; break;
        case 'k': client_file = optarg; break;
        case 't':
            timeout_ms = strtoll(optarg, &end, 10);
            if (*end || timeout_ms < 1 || timeout_ms > 3600000) return usage(argv[0]);
            break;
        default: return usage(argv[0]);
        }
    }
    if (server_file && !*server_file) server_file = NULL;
    if (client_file && !*client_file) client_file = NULL;
    if ((server_file == NULL) != (client_file == NULL)) {
        fprintf(stderr, "CURVE needs both keys: -s the node's NAME.key and -k your "
                        "NAME.key_secret\n");
        return EXIT_USAGE;
    }
    int nargs = argc - optind;
    char **args = argv + optind;
    char endpoint[512];
    if (nargs > 0 && *args[0])
        snprintf(endpoint, sizeof endpoint, "%s", args[0]);
    else
        default_endpoint(endpoint, sizeof endpoint);
    const char *prompt = nargs > 1 ? args[1] : "Robot arm status:";
    end = NULL;
    long long max_tokens = nargs > 2 ? strtoll(args[2], &end, 10) : 16;
    if (nargs > 3 || *prompt == '\0' || (end && *end) || max_tokens < 1 || max_tokens > 32768)
        return usage(argv[0]);

    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    /* A DEALER whose connection is gone (a refused CURVE key) blocks on send: bound it. */
    int send_timeout = (int)(timeout_ms + SLACK_MS);
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &send_timeout, sizeof send_timeout);
    if (server_file && !set_curve(sock, server_file, client_file)) {
        zmq_close(sock);
        zmq_ctx_term(ctx);
        return EXIT_USAGE;
    }
    if (zmq_connect(sock, endpoint) != 0) {
        fprintf(stderr, "cannot connect to %s: %s\n", endpoint, zmq_strerror(zmq_errno()));
        zmq_close(sock);
        zmq_ctx_term(ctx);
        return EXIT_USAGE;
    }
    /* Ids are ours to choose, unique among this connection's requests in flight. */
    char id_generate[64], id_stream[64];
    snprintf(id_generate, sizeof id_generate, "c-%ld-1", (long)getpid());
    snprintf(id_stream, sizeof id_stream, "c-%ld-2", (long)getpid());

    int rc = run(sock, "generate", id_generate, prompt, (int64_t)max_tokens, false);
    if (rc == 0) rc = run(sock, "stream", id_stream, prompt, (int64_t)max_tokens, true);

    zmq_close(sock);
    zmq_ctx_term(ctx);
    return rc;
}
