/* lane.c: the relay's fast lane, the learner process's relay loop in C (server/lane.py).
 *
 * server/relay.py's RelayLearner runs one Python thread that reads every front's frames,
 * prepares each request, steps it and answers, ≈ 100 µs of host work a request with 8
 * fronts, almost all of it Python (docs/benchmarks.md, round 16).  When that thread has
 * nothing of its own queued, it calls duelq_lane_pump, which runs the same loop here for
 * the common case: PACKED requests of open streams whose batch shape the engine takes and
 * whose key is new to the actor, and ENDs of those streams.  Anything else (a frame of
 * another kind, an unknown stream or actor, an expired deadline, a step that is not
 * finite, a device error) makes the pump hand everything it holds back to Python in order:
 * its queued requests (not prepared) and the bytes not yet framed, which the relay then
 * takes exactly as if it had read them itself.  So each request is answered either here or
 * by the Python path, never half by each, and every refusal is worded by Python.
 *
 * The engine makes the copies and the steps: the CUDA backend's, in C (below), or any
 * backend through Python callbacks (server/lane.py).  Every answer, ENDed stream and the
 * keys applied are logged for Python, which records them (replay guard, metrics,
 * checkpoints) when the pump returns; it holds the service's apply lock meanwhile.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

/* From native.c. */
typedef int CUresult;
typedef void *CUstream, *CUevent, *CUfunction;
typedef unsigned long long CUdeviceptr;
struct duelq_upload {
    CUdeviceptr message;
    CUfunction unpack;
    unsigned blocks, threads;
    void **params;
    CUstream stream;
    CUevent copied;
};
struct duelq_step {
    CUfunction fn;
    unsigned blocks, threads, smem;
    void **params;
    CUstream stream;
    CUevent wait;
    void *out;
    CUdeviceptr out_device;
    size_t out_bytes;
    const float *parts;
    double totals[5];
    double synced_s;
};
int duelq_copy(const struct duelq_upload *u, CUdeviceptr dst, const void *src, size_t nbytes);
int duelq_step(struct duelq_step *s);
int duelq_event_sync(CUevent event);

/* server/relay.py's frames. */
enum { OP_OPEN = 1, OP_REQ, OP_END, OP_REFUSED, OP_PACKED, OP_CALL };
#define FRAME_BYTES 24          /* "<BxxxIiId": op, stream, slot, size, deadline */
#define REPLY_BYTES 16          /* "<IiII": stream, slot, status code, size */
#define DESCRIPTOR_BYTES 10     /* server/packing.py: "<IIBB" B, H, dtype, weights */
#define MAX_ACTOR 128           /* idempotency.MAX_ACTOR_ID_BYTES */
#define MAX_KEY 142             /* a canonical RequestKey: 1 + 2 + 128 + 1 + 10 */
#define AHEAD 1                 /* relay.AHEAD */
#define CODE_OK 0
#define CODE_CANCELLED 1
#define UPLOADS 8
static const char CANCELLED_TEXT[] =
    "the call ended before this request started; it was not applied";

/* ── the engine ─────────────────────────────────────────────────────────────────────── */

struct lane_batch {            /* a packed request's shape, from its descriptor */
    unsigned rows, hidden, kind, weights;
    size_t words;              /* 32-bit words of its packed layout */
    int shape;                 /* the engine's index for (rows, kind), from its shape call */
};

struct lane_outcome {          /* a proposed step's outputs */
    double loss, q_mean, grad_norm, entropy;
    int has_entropy, finite, valid;
    const float *td, *priorities;   /* [rows] each, valid until the next step */
};

/* Return 0, or a nonzero status: the request goes back to Python (which then meets the
 * same failure and words it). */
struct lane_engine {
    void *ctx;
    int (*shape)(void *ctx, const struct lane_batch *b);   /* its index, or -1: not taken */
    int (*copy)(void *ctx, int upload, const void *src, size_t nbytes);
    int (*step)(void *ctx, int upload, const void *src, const struct lane_batch *b,
                struct lane_outcome *out);
    uint64_t (*commit)(void *ctx);   /* makes the step the current state: the steps now */
    void (*release)(void *ctx, int upload, int stepped);
    int uploads;               /* upload slots, ≤ UPLOADS */
};

/* ── the lane ───────────────────────────────────────────────────────────────────────── */

struct buffer { unsigned char *data; size_t len, cap; };

static int reserve(struct buffer *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + more) cap *= 2;
    unsigned char *data = realloc(b->data, cap);
    if (data == NULL) return -1;
    b->data = data, b->cap = cap;
    return 0;
}

/* Append ``n`` bytes (reserved beforehand where a failure must not leave half a record). */
static int append(struct buffer *b, const void *src, size_t n) {
    if (reserve(b, n)) return -1;
    if (n) memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

struct front {
    int fd;                    /* -1: not read by the lane */
    unsigned char *slots;      /* its slot pool */
    size_t slot_size;
    unsigned slot_count;
    struct buffer unread;      /* bytes received, not yet framed */
    size_t at;                 /* framed up to here */
    unsigned long long answered;   /* requests answered here since the last settle */
};

struct stream { uint64_t key; int ended; };          /* key: front << 32 | id, + 1 */
struct actor { uint64_t high; unsigned char len; unsigned char id[MAX_ACTOR]; int used; };

struct item {
    int front;
    uint32_t sid;
    int32_t slot;
    uint32_t size;             /* the payload's bytes */
    double deadline, arrived;
    unsigned char payload[DESCRIPTOR_BYTES + MAX_KEY];
    struct lane_batch batch;
    const unsigned char *actor;   /* into payload; NULL: no key to record */
    unsigned actor_len;
    uint64_t seq;
    unsigned key_at, key_len;     /* the key's bytes in payload */
    int upload;                /* -1: not prepared */
    int cancelled;             /* its stream had ended when it was prepared */
};

enum { EXIT_DRAINED = 0, EXIT_HANDOVER = 1, EXIT_WOKEN = 2, EXIT_FAILED = -1 };

struct duelq_lane {
    struct lane_engine engine;
    struct front *fronts;
    int front_count;
    struct stream *streams;    /* open addressing, stream_cap a power of two */
    size_t stream_cap, stream_used;
    struct actor *actors;
    size_t actor_cap, actor_used;
    struct item *items;        /* a ring: [head, head + prepared) prepared, then received */
    size_t item_cap, head, prepared, received;
    unsigned free_uploads;     /* bit i: upload slot i free */
    int handover, draining, woken;
    int closed;                /* a front whose connection closed (−1: none) */
    int stopped_at;            /* the front whose next frame made the handover (−1: none) */
    struct buffer log;         /* ANSWER and ENDED records, for Python */
    struct buffer handed;      /* the requests given back, for Python */
    size_t log_limit;          /* past this many bytes of log: drain and return */
    struct lane_batch miss;    /* the last shape the engine did not take (rows 0: none) */
    unsigned char response[1 << 16];   /* small answers are encoded here */
    struct buffer big;         /* larger ones here */
};

static double now(void) {      /* time.monotonic() and time.perf_counter() on Linux */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

struct duelq_lane *duelq_lane_new(size_t items, size_t streams, size_t actors) {
    struct duelq_lane *L = calloc(1, sizeof *L);
    if (L == NULL) return NULL;
    size_t s = 16, a = 16;
    while (s < 2 * streams) s *= 2;
    while (a < 2 * actors) a *= 2;
    L->items = calloc(items, sizeof *L->items);
    L->streams = calloc(s, sizeof *L->streams);
    L->actors = calloc(a, sizeof *L->actors);
    L->item_cap = items, L->stream_cap = s, L->actor_cap = a;
    L->log_limit = 1 << 22;
    if (L->items == NULL || L->streams == NULL || L->actors == NULL) {
        free(L->items), free(L->streams), free(L->actors), free(L);
        return NULL;
    }
    return L;
}

void duelq_lane_free(struct duelq_lane *L) {
    if (L == NULL) return;
    for (int i = 0; i < L->front_count; ++i) free(L->fronts[i].unread.data);
    free(L->fronts), free(L->streams), free(L->actors), free(L->items);
    free(L->log.data), free(L->handed.data), free(L->big.data), free(L);
}

void duelq_lane_set_engine(struct duelq_lane *L, const struct lane_engine *engine) {
    L->engine = *engine;
    if (L->engine.uploads > UPLOADS) L->engine.uploads = UPLOADS;
    L->free_uploads = (1u << L->engine.uploads) - 1;
}

void duelq_lane_set_log_limit(struct duelq_lane *L, size_t bytes) { L->log_limit = bytes; }

/* Front ``index``'s socket and slot pool (fd −1: not read here); 0, or −1 out of memory. */
int duelq_lane_front(struct duelq_lane *L, int index, int fd, void *slots, size_t slot_size,
                     unsigned slot_count) {
    if (index < 0) return -1;
    if (index >= L->front_count) {
        struct front *more = realloc(L->fronts, (size_t)(index + 1) * sizeof *more);
        if (more == NULL) return -1;
        memset(more + L->front_count, 0, (size_t)(index + 1 - L->front_count) * sizeof *more);
        for (int i = L->front_count; i <= index; ++i) more[i].fd = -1;
        L->fronts = more, L->front_count = index + 1;
    }
    struct front *f = &L->fronts[index];
    f->fd = fd, f->slots = slots, f->slot_size = slot_size, f->slot_count = slot_count;
    return 0;
}

/* ── streams and actors ─────────────────────────────────────────────────────────────── */

static uint64_t mix(uint64_t x) {
    x ^= x >> 33, x *= 0xff51afd7ed558ccdULL, x ^= x >> 33;
    return x;
}

static struct stream *stream_find(struct duelq_lane *L, int front, uint32_t sid) {
    uint64_t key = ((uint64_t)front << 32 | sid) + 1;
    for (size_t i = mix(key) & (L->stream_cap - 1);; i = (i + 1) & (L->stream_cap - 1)) {
        if (L->streams[i].key == key) return &L->streams[i];
        if (L->streams[i].key == 0) return NULL;
    }
}

static void stream_rehash(struct duelq_lane *L) {
    struct stream *old = L->streams;
    size_t cap = L->stream_cap;
    struct stream *fresh = calloc(cap, sizeof *fresh);
    if (fresh == NULL) return;   /* the tombstones stay; lookups still end */
    L->streams = fresh, L->stream_used = 0;
    for (size_t i = 0; i < cap; ++i) {
        if (old[i].key == 0 || old[i].key == UINT64_MAX) continue;
        size_t j = mix(old[i].key) & (cap - 1);
        while (fresh[j].key != 0) j = (j + 1) & (cap - 1);
        fresh[j] = old[i], ++L->stream_used;
    }
    free(old);
}

/* Stream ``sid`` of ``front`` is open (open = 1: the lane may take its requests) or not
 * (0: forgotten).  0, or −1 when the table is full (the stream is then Python's alone). */
int duelq_lane_stream(struct duelq_lane *L, int front, uint32_t sid, int open) {
    struct stream *s = stream_find(L, front, sid);
    if (!open) {
        if (s != NULL) s->key = UINT64_MAX;   /* a tombstone */
        return 0;
    }
    if (s != NULL) { s->ended = 0; return 0; }
    if (2 * (L->stream_used + 1) > L->stream_cap) {
        stream_rehash(L);
        if (2 * (L->stream_used + 1) > L->stream_cap) return -1;
    }
    uint64_t key = ((uint64_t)front << 32 | sid) + 1;
    size_t i = mix(key) & (L->stream_cap - 1);
    while (L->streams[i].key != 0 && L->streams[i].key != UINT64_MAX)
        i = (i + 1) & (L->stream_cap - 1);
    if (L->streams[i].key == 0) ++L->stream_used;
    L->streams[i].key = key, L->streams[i].ended = 0;
    return 0;
}

static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
    return mix(h);
}

static struct actor *actor_find(struct duelq_lane *L, const unsigned char *id, size_t n) {
    for (size_t i = hash_bytes(id, n) & (L->actor_cap - 1);; i = (i + 1) & (L->actor_cap - 1)) {
        struct actor *a = &L->actors[i];
        if (!a->used) return NULL;
        if (a->len == n && memcmp(a->id, id, n) == 0) return a;
    }
}

void duelq_lane_forget_actors(struct duelq_lane *L) {
    memset(L->actors, 0, L->actor_cap * sizeof *L->actors);
    L->actor_used = 0;
}

/* The highest seq applied for actor ``id`` (as the replay guard knows it): the lane takes
 * that actor's requests with a higher seq.  With the table half full it starts afresh
 * (its actors' requests then go by Python until it sets them again). */
int duelq_lane_actor(struct duelq_lane *L, const char *id, size_t n, uint64_t high) {
    if (n == 0 || n > MAX_ACTOR) return -1;
    struct actor *a = actor_find(L, (const unsigned char *)id, n);
    if (a == NULL) {
        if (2 * (L->actor_used + 1) > L->actor_cap) duelq_lane_forget_actors(L);
        size_t i = hash_bytes((const unsigned char *)id, n) & (L->actor_cap - 1);
        while (L->actors[i].used) i = (i + 1) & (L->actor_cap - 1);
        a = &L->actors[i];
        a->used = 1, a->len = (unsigned char)n;
        memcpy(a->id, id, n);
        ++L->actor_used;
    }
    a->high = high;
    return 0;
}

/* ── frames ─────────────────────────────────────────────────────────────────────────── */

static uint32_t u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static const unsigned char *read_varint(const unsigned char *p, const unsigned char *end,
                                        uint64_t *v) {
    *v = 0;
    for (int shift = 0; p < end && shift < 64; shift += 7) {
        unsigned char b = *p++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return p;
    }
    return NULL;
}

/* A canonical RequestKey (as a front's Packer sends it): [0x0a len id] [0x10 seq]; 0 if
 * it is one the lane takes. */
static int read_key(struct item *it) {
    const unsigned char *p = it->payload + it->key_at, *end = p + it->key_len;
    uint64_t v = 0;
    it->actor = NULL, it->actor_len = 0, it->seq = 0;
    if (p < end && *p == 0x0a) {
        if ((p = read_varint(p + 1, end, &v)) == NULL || v == 0 || v > MAX_ACTOR
            || v > (uint64_t)(end - p)) return -1;
        it->actor = p, it->actor_len = (unsigned)v;
        p += v;
    }
    if (p < end && *p == 0x10) {
        if ((p = read_varint(p + 1, end, &it->seq)) == NULL || it->seq == 0) return -1;
    }
    if (p != end) return -1;
    if (it->actor != NULL && it->seq < 1) return -1;   /* check_key refuses it */
    return 0;
}

/* The PACKED frame at ``p`` (its payload after it) as a queued request; 0, or −1: Python's. */
static int take_packed(struct duelq_lane *L, int fi, const unsigned char *p) {
    struct front *f = &L->fronts[fi];
    uint32_t sid = u32(p + 4), n = u32(p + 12);
    int32_t slot = (int32_t)u32(p + 8);
    if (slot < 0 || (unsigned)slot >= f->slot_count || n < DESCRIPTOR_BYTES
        || n > DESCRIPTOR_BYTES + MAX_KEY || stream_find(L, fi, sid) == NULL
        || L->prepared + L->received >= L->item_cap) return -1;
    struct item *it = &L->items[(L->head + L->prepared + L->received) % L->item_cap];
    memcpy(it->payload, p + FRAME_BYTES, n);
    const unsigned char *d = it->payload;
    struct lane_batch *b = &it->batch;
    b->rows = u32(d), b->hidden = u32(d + 4), b->kind = d[8], b->weights = d[9];
    if (b->rows < 1 || b->hidden < 1 || b->kind > 2 || b->weights > 1) return -1;
    size_t features = (size_t)b->rows * b->hidden * (b->kind ? 2 : 4);
    b->words = 2 * features / 4 + (size_t)(b->weights ? 5 : 4) * b->rows;
    if (4 * b->words > f->slot_size) return -1;
    it->key_at = DESCRIPTOR_BYTES, it->key_len = n - DESCRIPTOR_BYTES;
    if (read_key(it)) return -1;
    b->shape = L->engine.shape(L->engine.ctx, b);
    if (b->shape < 0) { L->miss = *b; return -1; }
    it->front = fi, it->sid = sid, it->slot = slot, it->size = n;
    memcpy(&it->deadline, p + 16, 8);
    it->arrived = now();
    it->upload = -1, it->cancelled = 0;
    ++L->received;
    return 0;
}

struct record {                 /* a log record; lane.py's RECORD */
    uint8_t kind, keyed;        /* kind 1: an answer, 2: a stream ENDed */
    uint16_t actor_len;
    uint32_t front;
    uint64_t seq;               /* an END's: the stream id */
    uint64_t step;
    double loss, arrived, answered;
    uint32_t rows, size;        /* the answer's bytes follow the actor's */
};

static int log_end(struct duelq_lane *L, int front, uint32_t sid) {
    struct record r = {0};
    r.kind = 2, r.front = (uint32_t)front, r.seq = sid;
    return append(&L->log, &r, sizeof r);
}

/* Frame the front's bytes: take PACKED requests and ENDs of the lane's streams; stop at
 * anything else (a handover), or at a request while draining. */
static void parse(struct duelq_lane *L, int fi) {
    struct front *f = &L->fronts[fi];
    const unsigned char *data = f->unread.data;
    while (!L->handover && f->unread.len - f->at >= FRAME_BYTES) {
        const unsigned char *p = data + f->at;
        int op = p[0];
        int32_t slot = (int32_t)u32(p + 8);
        uint32_t n = u32(p + 12);
        int inline_ = op == OP_PACKED || op == OP_REFUSED || op == OP_CALL
                      || (op == OP_REQ && slot < 0);
        if (f->unread.len - f->at < FRAME_BYTES + (inline_ ? (size_t)n : 0)) return;
        if (op == OP_PACKED) {
            if (L->draining) return;
            if (take_packed(L, fi, p)) { L->handover = 1, L->stopped_at = fi; return; }
        } else if (op == OP_END) {
            struct stream *s = stream_find(L, fi, u32(p + 4));
            if (s == NULL || log_end(L, fi, u32(p + 4))) {
                L->handover = 1, L->stopped_at = fi;
                return;
            }
            s->ended = 1;
        } else {
            L->handover = 1, L->stopped_at = fi;
            return;
        }
        f->at += FRAME_BYTES + (inline_ ? n : 0);
    }
}

/* Read what the fronts sent, waiting up to ``timeout_ms`` (−1: no limit) for something. */
static void look(struct duelq_lane *L, int epfd, int wake_fd, int timeout_ms) {
    struct epoll_event events[64];
    int n = epoll_wait(epfd, events, 64, timeout_ms);
    for (int e = 0; e < n; ++e) {
        int fd = events[e].data.fd;
        if (fd == wake_fd) {   /* a front attached: the relay joins it */
            char sink[256];
            while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {}
            L->woken = L->draining = 1;
            continue;
        }
        int fi = 0;
        while (fi < L->front_count && L->fronts[fi].fd != fd) ++fi;
        struct front *f = fi < L->front_count ? &L->fronts[fi] : NULL;
        if (f == NULL || reserve(&f->unread, 1 << 16)) { L->handover = 1; continue; }
        ssize_t got = recv(fd, f->unread.data + f->unread.len, f->unread.cap - f->unread.len,
                           MSG_DONTWAIT);
        if (got > 0) f->unread.len += (size_t)got;
        else if (got == 0 || (errno != EAGAIN && errno != EINTR))   /* closed */
            L->closed = fi, L->handover = 1;
    }
    for (int fi = 0; fi < L->front_count && !L->handover; ++fi) parse(L, fi);
}

/* ── answers ────────────────────────────────────────────────────────────────────────── */

static unsigned char *put_varint(unsigned char *p, uint64_t v) {
    while (v > 0x7f) *p++ = (unsigned char)(v | 0x80), v >>= 7;
    *p++ = (unsigned char)v;
    return p;
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v > 0x7f) v >>= 7, ++n;
    return n;
}

static unsigned char *put_double(unsigned char *p, unsigned char tag, double v, int always) {
    uint64_t bits;
    memcpy(&bits, &v, 8);
    if (bits == 0 && !always) return p;   /* proto3: +0.0 is left out, −0.0 written */
    *p++ = tag;
    memcpy(p, &v, 8);
    return p + 8;
}

/* A float32 [rows] Tensor as field ``number`` (client.tensors.tensor_head, then the data). */
static unsigned char *put_vector(unsigned char *p, unsigned number, const float *v,
                                 unsigned rows) {
    size_t nbytes = 4 * (size_t)rows, dims = varint_size(rows);
    size_t head = 2 + 1 + varint_size(dims) + dims + 1 + varint_size(nbytes);
    p = put_varint(p, number << 3 | 2);
    p = put_varint(p, head + nbytes);
    *p++ = 0x08, *p++ = 0x01;                       /* dtype FLOAT32 */
    *p++ = 0x12, p = put_varint(p, dims), p = put_varint(p, rows);
    *p++ = 0x1a, p = put_varint(p, nbytes);
    memcpy(p, v, nbytes);
    return p + nbytes;
}

/* service.encoded_train_response's bytes: a TrainResponse in protobuf's canonical form. */
size_t duelq_lane_encode(unsigned char *out, const struct lane_outcome *o, unsigned rows,
                         uint64_t step, const unsigned char *key, size_t key_len) {
    unsigned char *p = put_double(out, 0x09, o->loss, 0);
    p = put_vector(p, 2, o->td, rows);
    p = put_vector(p, 3, o->priorities, rows);
    p = put_double(p, 0x21, o->q_mean, 0);
    p = put_double(p, 0x29, o->grad_norm, 0);
    if (step) *p++ = 0x30, p = put_varint(p, step);
    if (step) *p++ = 0x38, p = put_varint(p, step);   /* version == step */
    if (o->has_entropy) p = put_double(p, 0x41, o->entropy, 1);
    *p++ = 0x4a, p = put_varint(p, key_len);
    memcpy(p, key, key_len);
    return (size_t)(p + key_len - out);
}

/* The most bytes duelq_lane_encode writes for ``rows`` and a key of ``key_len``. */
size_t duelq_lane_encoded_max(unsigned rows, size_t key_len) {
    return 2 * (4 * (size_t)rows + 40) + 5 * 9 + 2 * 11 + 12 + key_len;
}

static void reply(struct front *f, uint32_t sid, int32_t slot, uint32_t code,
                  const void *payload, size_t n) {
    unsigned char frame[REPLY_BYTES];
    uint32_t size = (uint32_t)n;
    memcpy(frame, &sid, 4), memcpy(frame + 4, &slot, 4);
    memcpy(frame + 8, &code, 4), memcpy(frame + 12, &size, 4);
    struct iovec iov[2] = {{frame, REPLY_BYTES}, {(void *)payload, n}};
    struct msghdr msg = {0};
    msg.msg_iov = iov, msg.msg_iovlen = n ? 2 : 1;
    while (msg.msg_iovlen) {   /* the rest after a short send; a closed front: dropped */
        ssize_t sent = sendmsg(f->fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            return;
        }
        while (msg.msg_iovlen && (size_t)sent >= msg.msg_iov->iov_len) {
            sent -= (ssize_t)msg.msg_iov->iov_len;
            ++msg.msg_iov, --msg.msg_iovlen;
        }
        if (msg.msg_iovlen) {
            msg.msg_iov->iov_base = (char *)msg.msg_iov->iov_base + sent;
            msg.msg_iov->iov_len -= (size_t)sent;
        }
    }
}

static const void *source(struct duelq_lane *L, const struct item *it) {
    const struct front *f = &L->fronts[it->front];
    return f->slots + (size_t)it->slot * f->slot_size;
}

/* Start the copy of the oldest request received (none for one whose stream has ended). */
static void prepare(struct duelq_lane *L) {
    struct item *it = &L->items[(L->head + L->prepared) % L->item_cap];
    struct stream *s = stream_find(L, it->front, it->sid);
    if (s == NULL || s->ended) {
        it->cancelled = 1;
    } else {
        int u = 0;
        while (u < L->engine.uploads && !(L->free_uploads >> u & 1)) ++u;
        if (u == L->engine.uploads) { L->handover = 1; return; }
        if (L->engine.copy(L->engine.ctx, u, source(L, it), 4 * it->batch.words)) {
            L->engine.release(L->engine.ctx, u, 0);
            L->handover = 1;
            return;
        }
        L->free_uploads &= ~(1u << u);
        it->upload = u;
    }
    --L->received, ++L->prepared;
}

static void release(struct duelq_lane *L, struct item *it, int stepped) {
    if (it->upload < 0) return;
    L->engine.release(L->engine.ctx, it->upload, stepped);
    L->free_uploads |= 1u << it->upload;
    it->upload = -1;
}

/* Step and answer the oldest prepared request; a handover (it stays queued) when it is not
 * one the lane can answer. */
static void answer(struct duelq_lane *L) {
    struct item *it = &L->items[L->head % L->item_cap];
    struct front *f = &L->fronts[it->front];
    struct stream *s = stream_find(L, it->front, it->sid);
    if (it->cancelled || s == NULL || s->ended) {   /* ended before its step: not applied */
        release(L, it, 0);
        reply(f, it->sid, it->slot, CODE_CANCELLED, CANCELLED_TEXT, sizeof CANCELLED_TEXT - 1);
        ++f->answered;
        L->head = (L->head + 1) % L->item_cap, --L->prepared;
        return;
    }
    struct actor *a = it->actor ? actor_find(L, it->actor, it->actor_len) : NULL;
    if ((it->deadline != 0 && now() >= it->deadline) || (it->actor && (a == NULL || it->seq <= a->high))) {
        L->handover = 1;   /* expired, or a key only the replay guard can judge */
        return;
    }
    size_t need = duelq_lane_encoded_max(it->batch.rows, it->key_len);
    if ((need > sizeof L->response && reserve(&L->big, need))
        || reserve(&L->log, sizeof(struct record) + it->actor_len + need)) {
        L->handover = 1;   /* out of memory: nothing applied, the relay steps it */
        return;
    }
    unsigned char *out = need > sizeof L->response ? L->big.data : L->response;
    struct lane_outcome o = {0};
    int r = L->engine.step(L->engine.ctx, it->upload, source(L, it), &it->batch, &o);
    if (r || !o.finite || !o.valid) {   /* Python steps it again and words the refusal */
        release(L, it, r == 0);
        L->handover = 1;
        return;
    }
    uint64_t step = L->engine.commit(L->engine.ctx);
    if (a) a->high = it->seq;
    size_t n = duelq_lane_encode(out, &o, it->batch.rows, step, it->payload + it->key_at,
                                 it->key_len);
    reply(f, it->sid, it->slot, CODE_OK, out, n);
    release(L, it, 1);
    ++f->answered;
    struct record rec = {0};
    rec.kind = 1, rec.keyed = it->actor != NULL, rec.actor_len = (uint16_t)it->actor_len;
    rec.front = (uint32_t)it->front, rec.seq = it->seq, rec.step = step, rec.loss = o.loss;
    rec.arrived = it->arrived, rec.answered = now(), rec.rows = it->batch.rows;
    rec.size = rec.keyed ? (uint32_t)n : 0;   /* the response, for the replay guard */
    append(&L->log, &rec, sizeof rec);        /* reserved above: these cannot fail */
    append(&L->log, it->actor, it->actor_len);
    append(&L->log, out, rec.size);
    L->head = (L->head + 1) % L->item_cap, --L->prepared;
}

struct handed {                /* a request given back; lane.py's HANDED */
    uint32_t front, sid;
    int32_t slot;
    uint32_t size;
    double deadline, arrived;
};

/* Give every queued request back (their uploads released); −1 (nothing given back: the
 * relay fails) when out of memory. */
static int hand_over(struct duelq_lane *L) {
    size_t queued = L->prepared + L->received, need = 0;
    for (size_t k = 0; k < queued; ++k)
        need += sizeof(struct handed) + L->items[(L->head + k) % L->item_cap].size;
    int r = reserve(&L->handed, need);
    for (size_t k = 0; k < queued; ++k) {
        struct item *it = &L->items[(L->head + k) % L->item_cap];
        release(L, it, 0);
        struct handed h = {(uint32_t)it->front, it->sid, it->slot, it->size, it->deadline,
                           it->arrived};
        if (r == 0) {
            append(&L->handed, &h, sizeof h);
            append(&L->handed, it->payload, it->size);
        }
    }
    L->head = 0, L->prepared = L->received = 0;
    return r;
}

/* Run the relay loop (server/relay.py's RelayLearner._loop) for about ``budget_s``
 * seconds.  Returns why it stopped:
 * EXIT_DRAINED (its time is up and nothing is queued: the unframed bytes are kept),
 * EXIT_WOKEN (the same, for a front attaching), or EXIT_HANDOVER (a frame or request for
 * Python: the queued requests are in the handed log, and every front's bytes from its
 * first unframed one are left for duelq_lane_unread). */
int duelq_lane_pump(struct duelq_lane *L, int epfd, int wake_fd, double budget_s) {
    double until = now() + budget_s;
    L->handover = L->draining = L->woken = 0;
    L->closed = L->stopped_at = -1;
    for (int fi = 0; fi < L->front_count && !L->handover; ++fi) parse(L, fi);
    while (!L->handover) {
        if (L->received && L->prepared <= AHEAD) {
            prepare(L);
            if (L->handover) break;
        } else if (!L->prepared && L->draining) {
            break;
        }
        double left = until - now();
        int wait = L->prepared || L->received ? 0 : left > 0 ? (int)(left * 1e3) + 1 : 0;
        look(L, epfd, wake_fd, wait);
        if (L->handover) break;
        if (L->prepared && (L->prepared > AHEAD || !L->received)) answer(L);
        if (now() >= until || L->log.len >= L->log_limit) L->draining = 1;
    }
    if (L->handover) return hand_over(L) ? EXIT_FAILED : EXIT_HANDOVER;
    return L->woken ? EXIT_WOKEN : EXIT_DRAINED;
}

/* Bytes front ``index``'s socket gave the relay that it did not frame, to frame here first
 * (the lane holds none of that front's then); 0, or −1 out of memory. */
int duelq_lane_feed(struct duelq_lane *L, int index, const char *data, size_t n) {
    if (index < 0 || index >= L->front_count) return -1;
    return append(&L->fronts[index].unread, data, n);
}

/* ── what Python reads after a pump, then settles ───────────────────────────────────── */

const unsigned char *duelq_lane_log(struct duelq_lane *L, size_t *n) {
    *n = L->log.len;
    return L->log.data;
}

const unsigned char *duelq_lane_handed(struct duelq_lane *L, size_t *n) {
    *n = L->handed.len;
    return L->handed.data;
}

/* Front ``index``'s bytes not yet framed (after a handover, Python's to frame). */
const unsigned char *duelq_lane_unread(struct duelq_lane *L, int index, size_t *n) {
    *n = 0;
    if (index < 0 || index >= L->front_count) return NULL;
    struct front *f = &L->fronts[index];
    *n = f->unread.len - f->at;
    return f->unread.data + f->at;
}

/* The front whose connection the last pump saw close (−1: none). */
int duelq_lane_closed(struct duelq_lane *L) { return L->closed; }

/* The front whose next unframed frame made the last pump hand over (−1: none). */
int duelq_lane_stopped_at(struct duelq_lane *L) { return L->stopped_at; }

unsigned long long duelq_lane_answered(struct duelq_lane *L, int index) {
    return index >= 0 && index < L->front_count ? L->fronts[index].answered : 0;
}

/* The last batch shape the engine did not take: 1 (rows, hidden, kind, weights written),
 * or 0. */
int duelq_lane_miss(struct duelq_lane *L, unsigned out[4]) {
    if (L->miss.rows == 0) return 0;
    out[0] = L->miss.rows, out[1] = L->miss.hidden, out[2] = L->miss.kind;
    out[3] = L->miss.weights;
    return 1;
}

/* Empty the logs and the answered counts; with ``handed_over``, drop every front's unread
 * bytes (Python took them), else keep those not yet framed. */
void duelq_lane_settle(struct duelq_lane *L, int handed_over) {
    L->log.len = L->handed.len = 0;
    L->miss.rows = 0;
    for (int fi = 0; fi < L->front_count; ++fi) {
        struct front *f = &L->fronts[fi];
        f->answered = 0;
        if (handed_over) {
            f->unread.len = f->at = 0;
        } else if (f->at) {
            memmove(f->unread.data, f->unread.data + f->at, f->unread.len - f->at);
            f->unread.len -= f->at, f->at = 0;
        }
    }
}

/* ── the CUDA engine ────────────────────────────────────────────────────────────────── */

struct step_args {             /* kernels/learner_step.cu's StepArgs (cuda.StepArgs) */
    void *state, *next, *isv, *isv_next, *observed, *observed_next, *in, *out, *part_grad,
         *part_sq, *part_counts, *grad, *arrivals;
    double max_norm;
    unsigned epoch;
    int batch, rows_per_block, has_weights, double_dqn, adam, update_target, isv_size,
        entropy_slot;
    float kappa, priority_eps, lr, beta1, beta2, adam_eps, step_size, sqrt_bc2, tau,
          ent_alpha, ent_keep;
};

#define SHAPES 16
struct duelq_cuda_engine {     /* filled in by cuda.CudaBackend (cuda.LaneEngine) */
    struct step_args *args[2];          /* each state copy's launch arguments */
    void **params[2];                   /* and their kernel parameter arrays */
    struct duelq_step *call;            /* the backend's step call (stream, threads) */
    void *out_host;                     /* the outputs' pinned buffer and device twin */
    CUdeviceptr out_device;
    size_t out_words;
    struct duelq_upload *uploads[UPLOADS];   /* each upload slot's call (stream, event) */
    CUdeviceptr upload_device[UPLOADS];
    size_t upload_words[UPLOADS];
    unsigned shape_rows[SHAPES], shape_kind[SHAPES], shape_blocks[SHAPES],
             shape_rows_per_block[SHAPES], shape_smem[SHAPES];
    CUfunction shape_fn[SHAPES];
    unsigned shapes, hidden;
    int entropy;                        /* the step writes the batch's entropy */
    double lr, beta1, beta2;
    unsigned long long target_period, step;   /* step: steps applied */
    unsigned epoch;                     /* the next launch's (cuda._next_epoch) */
    int cur;
    double synced_s;                    /* the steps' device waits, added up */
};

static int cuda_shape(void *ctx, const struct lane_batch *b) {
    struct duelq_cuda_engine *c = ctx;
    if (b->hidden != c->hidden) return -1;
    for (unsigned i = 0; i < c->shapes; ++i)
        if (c->shape_rows[i] == b->rows && c->shape_kind[i] == b->kind) return (int)i;
    return -1;
}

static int cuda_copy(void *ctx, int u, const void *src, size_t nbytes) {
    struct duelq_cuda_engine *c = ctx;
    if (nbytes > 4 * c->upload_words[u]) return -1;
    return duelq_copy(c->uploads[u], c->upload_device[u], src, nbytes);
}

/* cuda.CudaBackend.propose of a packed batch: _fill_args, then _native_step's call. */
static int cuda_step(void *ctx, int u, const void *src, const struct lane_batch *b,
                     struct lane_outcome *o) {
    struct duelq_cuda_engine *c = ctx;
    (void)src;
    unsigned i = (unsigned)b->shape, G = c->shape_blocks[i], B = b->rows;
    size_t words = 2 * (size_t)B + 1 + 5 * (size_t)G;
    if (c->epoch > 0xFFFFFFFFu - 2 || words > c->out_words) return -1;   /* Python's to do */
    unsigned long long t = c->step + 1;
    struct step_args *a = c->args[c->cur];
    a->in = (void *)(uintptr_t)c->upload_device[u], a->out = (void *)(uintptr_t)c->out_device;
    a->epoch = c->epoch, c->epoch += 2;
    a->batch = (int)B, a->rows_per_block = (int)c->shape_rows_per_block[i];
    a->has_weights = (int)b->weights;
    a->update_target = t % c->target_period == 0;
    a->step_size = (float)(c->lr / (1 - pow(c->beta1, (double)t)));
    a->sqrt_bc2 = (float)sqrt(1 - pow(c->beta2, (double)t));
    struct duelq_step *s = c->call;
    s->fn = c->shape_fn[i], s->blocks = G, s->smem = c->shape_smem[i];
    s->params = c->params[c->cur], s->wait = c->uploads[u]->copied;
    s->out = c->out_host, s->out_device = c->out_device, s->out_bytes = 4 * words;
    s->parts = (const float *)c->out_host + 2 * (size_t)B + 1;
    int r = duelq_step(s);
    c->synced_s += s->synced_s;
    if (r) return r;
    const float *out = c->out_host;
    o->loss = s->totals[2] / B, o->q_mean = s->totals[3] / B;
    o->grad_norm = sqrt(s->totals[1]);
    o->finite = s->totals[0] == G && isfinite(o->loss) && isfinite(o->q_mean);
    o->valid = s->totals[4] == G;
    o->has_entropy = c->entropy, o->entropy = c->entropy ? (double)out[2 * B] : 0.0;
    o->td = out, o->priorities = out + B;
    return 0;
}

static uint64_t cuda_commit(void *ctx) {
    struct duelq_cuda_engine *c = ctx;
    c->cur = 1 - c->cur;
    return ++c->step;
}

static void cuda_release(void *ctx, int u, int stepped) {
    struct duelq_cuda_engine *c = ctx;
    if (!stepped) duelq_event_sync(c->uploads[u]->copied);   /* its copy may still read */
}

void duelq_lane_use_cuda(struct duelq_lane *L, struct duelq_cuda_engine *c, int uploads) {
    struct lane_engine e = {c, cuda_shape, cuda_copy, cuda_step, cuda_commit, cuda_release,
                            uploads};
    duelq_lane_set_engine(L, &e);
}

/* For tests: sizes and offsets of the structs Python mirrors (tests/test_lane.py). */
void duelq_lane_layouts(size_t out[12]) {
    out[0] = sizeof(struct step_args), out[1] = offsetof(struct step_args, epoch);
    out[2] = offsetof(struct step_args, kappa), out[3] = sizeof(struct duelq_cuda_engine);
    out[4] = offsetof(struct duelq_cuda_engine, shape_rows);
    out[5] = offsetof(struct duelq_cuda_engine, lr);
    out[6] = offsetof(struct duelq_cuda_engine, synced_s);
    out[7] = sizeof(struct record), out[8] = sizeof(struct handed);
    out[9] = sizeof(struct lane_batch), out[10] = sizeof(struct lane_outcome);
    out[11] = sizeof(struct lane_engine);
}
