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
 * Run:   ./edgenode_client [endpoint] [prompt] [max_tokens]
 *
 * Output (stdout), one request after the other:
 *   generate text: <the reply's text>
 *   generate ok finish_reason=... served_by=... worker=... degraded=0 completion_tokens=N ...
 *   stream partial 0: <piece>          (one line per partial, as it arrives)
 *   stream text: <the final reply's text, the partials joined>
 *   stream ok partials=N finish_reason=... ...
 * An error reply prints "<label> error <code> <name> reason=<reason>: <message>" on
 * stderr and exits 1; no reply in time exits 2; bad usage or a socket error exits 3.
 */
#define _POSIX_C_SOURCE 200809L

#include <msgpack.h>
#include <zmq.h>

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char TAG[] = "EDGE/C1"; /* protocol version 1, client conversation */
#define TAG_LEN 7
#define TIMEOUT_MS 30000      /* the node's budget for each request */
#define SLACK_MS 2000         /* the node answers 504 at the deadline itself */
#define MAX_FRAMES 4          /* a reply has 3; more is not an EDGE/C1 reply */

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
    msgpack_pack_int64(&pk, TIMEOUT_MS);
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

/* Print a str field (nothing when absent, nil or not a str: e.g. "reason"). */
static void print_str(FILE *out, const msgpack_object *map, const char *key) {
    const msgpack_object *v = field(map, key);
    if (v && v->type == MSGPACK_OBJECT_STR)
        fwrite(v->via.str.ptr, 1, v->via.str.size, out);
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

/* Send one generate and read its replies until its final one.
 * Returns 0 on "ok", 1 on "error", 2 when no reply came in time, 3 on a socket error. */
static int run(void *sock, const char *label, const char *id, const char *prompt,
               int64_t max_tokens, bool stream) {
    msgpack_sbuffer body;
    msgpack_sbuffer_init(&body);
    pack_generate(&body, id, prompt, max_tokens, stream);
    int rc = send_request(sock, &body);
    msgpack_sbuffer_destroy(&body);
    if (rc < 0) {
        fprintf(stderr, "%s: send failed: %s\n", label, zmq_strerror(zmq_errno()));
        return 3;
    }
    int partials = 0;
    for (;;) {
        zmq_pollitem_t items[] = {{sock, 0, ZMQ_POLLIN, 0}};
        int ready = zmq_poll(items, 1, TIMEOUT_MS + SLACK_MS);
        if (ready < 0) {
            fprintf(stderr, "%s: poll failed: %s\n", label, zmq_strerror(zmq_errno()));
            return 3;
        }
        if (ready == 0) {
            fprintf(stderr, "%s: no reply within %d ms (is the node running?)\n", label,
                    TIMEOUT_MS + SLACK_MS);
            return 2;
        }
        zmq_msg_t frames[MAX_FRAMES];
        int n = recv_message(sock, frames);
        if (n < 0) {
            fprintf(stderr, "%s: receive failed: %s\n", label, zmq_strerror(zmq_errno()));
            return 3;
        }
        bool framed = n == 3 && zmq_msg_size(&frames[0]) == 0 &&
                      zmq_msg_size(&frames[1]) == TAG_LEN &&
                      memcmp(zmq_msg_data(&frames[1]), TAG, TAG_LEN) == 0;
        int result = -1; /* -1: not final yet */
        if (framed) {
            msgpack_unpacked un;
            msgpack_unpacked_init(&un);
            size_t off = 0;
            if (msgpack_unpack_next(&un, zmq_msg_data(&frames[2]), zmq_msg_size(&frames[2]),
                                    &off) == MSGPACK_UNPACK_SUCCESS) {
                const msgpack_object *reply = &un.data;
                const msgpack_object *rid = field(reply, "id");
                /* Replies are matched by id; nil means the node could not read the
                 * id of a message we sent: with one request in flight, it is ours. */
                bool ours = str_is(reply, "id", id);
                bool nil_id = rid && rid->type == MSGPACK_OBJECT_NIL;
                if ((ours || nil_id) && str_is(reply, "status", "partial")) {
                    printf("%s partial %" PRId64 ": ", label, int_field(reply, "index", -1));
                    print_str(stdout, reply, "text");
                    printf("\n");
                    fflush(stdout);
                    ++partials;
                } else if (ours && str_is(reply, "status", "ok")) {
                    print_ok(label, reply, stream ? partials : -1);
                    result = 0;
                } else if ((ours || nil_id) && str_is(reply, "status", "error")) {
                    fprintf(stderr, "%s error %" PRId64 " ", label, int_field(reply, "code", -1));
                    print_str(stderr, reply, "error");
                    fprintf(stderr, " reason=");
                    print_str(stderr, reply, "reason"); /* e.g. queue_full; empty if none */
                    fprintf(stderr, " retry_after_ms=%" PRId64 ": ",
                            int_field(reply, "retry_after_ms", -1)); /* -1: absent */
                    print_str(stderr, reply, "message");
                    fprintf(stderr, "\n");
                    result = 1;
                } /* else: a late reply to some earlier request: ignore it */
            } else {
                fprintf(stderr, "%s: undecodable reply body ignored\n", label);
            }
            msgpack_unpacked_destroy(&un);
        }
        for (int i = 0; i < n && i < MAX_FRAMES; ++i) zmq_msg_close(&frames[i]);
        if (result >= 0) return result;
    }
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

int main(int argc, char **argv) {
    char endpoint[512];
    if (argc > 1 && *argv[1])
        snprintf(endpoint, sizeof endpoint, "%s", argv[1]);
    else
        default_endpoint(endpoint, sizeof endpoint);
    const char *prompt = argc > 2 ? argv[2] : "Robot arm status:";
    char *end = NULL;
    long long max_tokens = argc > 3 ? strtoll(argv[3], &end, 10) : 16;
    if (argc > 4 || *prompt == '\0' || (end && *end) || max_tokens < 1 || max_tokens > 32768) {
        fprintf(stderr, "usage: %s [endpoint] [prompt, non-empty] [max_tokens 1..32768]\n",
                argv[0]);
        return 3;
    }

    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(sock, endpoint) != 0) {
        fprintf(stderr, "cannot connect to %s: %s\n", endpoint, zmq_strerror(zmq_errno()));
        zmq_close(sock);
        zmq_ctx_term(ctx);
        return 3;
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
