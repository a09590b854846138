/*
 * peer_auth — what proves the cluster secret (peer_int.h): the secret
 * read from peer.secret_file and rotated on SIGHUP (the previous one
 * accepted for peer.secret_previous_ms), the handshake's HMACs, the
 * HELLO's MAC with its time and the nonces kept against replays, and the
 * keys both daemons derive after it (BIND, DATA over a lane) and the
 * instances' capability tokens. The secret never leaves this file, nor
 * goes on the wire.
 */

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "peer_int.h"

/* The cluster secret, the previous one in a rotation's window, and the
 * nonces of HELLOs taken (hello_check()). */
static struct {
    uint8_t secret[SECRET_MAX];
    size_t secret_len;
    /* the secret before the last reload, accepted in handshakes until
     * prev_until (peer.secret_previous_ms after it) */
    uint8_t prev[SECRET_MAX];
    size_t prev_len;
    uint64_t prev_until;
    /* the nonces of the HELLOs taken within HELLO_SKEW_S, the oldest
     * overwritten first; seen_floor: the latest time of one overwritten
     * (a HELLO of that time or before can no longer be told from a
     * replay: it goes on, unprotected) */
    struct {
        uint8_t nonce[NONCE_LEN];
        uint64_t time;
    } seen[SEEN_MAX];
    unsigned seen_next, seen_n;
    uint64_t seen_floor;
} A;

/* The handshake's MACs: HMAC-SHA256(secret, label | nonce_c | nonce_s |
 * server address | "\n" | client address). Binding both daemons'
 * addresses means a MAC made for one pair of daemons proves nothing for
 * another: a man in the middle cannot relay one daemon's handshake into
 * another connection. */
void hmac_with(int prev, const char *label, const uint8_t *nc,
               const uint8_t *ns, const char *server, const char *client,
               uint8_t out[MAC_LEN])
{
    uint8_t msg[32 + 2 * NONCE_LEN + 2 * 192 + 1]; /* labels < 32 */
    size_t l = strlen(label), ls = strnlen(server, 191),
           lc = strnlen(client, 191), n = 0;
    memcpy(msg, label, l);
    n += l;
    memcpy(msg + n, nc, NONCE_LEN);
    n += NONCE_LEN;
    memcpy(msg + n, ns, NONCE_LEN);
    n += NONCE_LEN;
    memcpy(msg + n, server, ls);
    n += ls;
    msg[n++] = '\n';
    memcpy(msg + n, client, lc);
    n += lc;
    unsigned len = MAC_LEN;
    HMAC(EVP_sha256(), prev ? A.prev : A.secret,
         (int)(prev ? A.prev_len : A.secret_len), msg, n, out, &len);
}

/* The current secret's MAC. */
void hmac(const char *label, const uint8_t *nc, const uint8_t *ns,
          const char *server, const char *client, uint8_t out[MAC_LEN])
{
    hmac_with(0, label, nc, ns, server, client, out);
}

/* The HELLO's MAC: HMAC-SHA256(secret, "kvx-h" | nonce_c | server |
 * "\n" | client | "\n" | time as 8 bytes big-endian), server the
 * IP:PORT the client dialled. It binds the listener it was made for and
 * when, so that it proves nothing to another daemon or, past
 * HELLO_SKEW_S, later; the server takes each nonce once. */
void hello_mac(int prev, const uint8_t *nc, const char *server,
               const char *client, uint64_t time_s, uint8_t out[MAC_LEN])
{
    uint8_t msg[8 + NONCE_LEN + 2 * 192 + 2 + 8];
    size_t ls = strnlen(server, 191), lc = strnlen(client, 191), n = 5;
    memcpy(msg, "kvx-h", 5);
    memcpy(msg + n, nc, NONCE_LEN);
    n += NONCE_LEN;
    memcpy(msg + n, server, ls);
    n += ls;
    msg[n++] = '\n';
    memcpy(msg + n, client, lc);
    n += lc;
    msg[n++] = '\n';
    uint64_t be = htobe64(time_s);
    memcpy(msg + n, &be, 8);
    n += 8;
    unsigned len = MAC_LEN;
    HMAC(EVP_sha256(), prev ? A.prev : A.secret,
         (int)(prev ? A.prev_len : A.secret_len), msg, n, out, &len);
}

/* Is the previous secret accepted now (a rotation's window)? */
int prev_open(void)
{
    return A.prev_len && now_ms() < A.prev_until;
}

int ct_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

/* The file peer.secret_file names: an absolute path as it is; a bare
 * name is a credential, the file of that name in $CREDENTIALS_DIRECTORY
 * (systemd's LoadCredential=; conf_keys.c refuses other relative paths). */
static int secret_path(char *out, size_t n, kvx_why_t *why)
{
    const char *f = kvxd.conf.peer_secret_file;
    const char *dir = getenv("CREDENTIALS_DIRECTORY");

    if (f[0] == '/') {
        snprintf(out, n, "%s", f);
        return 0;
    }
    if (!dir || dir[0] != '/') {
        why_set(why,
                "peer.secret_file: \"%s\" names a credential, and "
                "$CREDENTIALS_DIRECTORY is %s (systemd's LoadCredential=%s:"
                "FILE sets it; else give an absolute path)",
                f, dir ? "not an absolute path" : "not set", f);
        return KVX_ERR_INVALID;
    }
    if ((size_t)snprintf(out, n, "%s/%s", dir, f) >= n) {
        why_set(why, "peer.secret_file: $CREDENTIALS_DIRECTORY/%s is too long",
                f);
        return KVX_ERR_INVALID;
    }
    return 0;
}

int read_secret(kvx_why_t *why)
{
    uint8_t buf[SECRET_MAX + 1];
    char f[4096 + sizeof(kvxd.conf.peer_secret_file)];
    int rc = secret_path(f, sizeof(f), why);
    if (rc)
        return rc;
    int fd = open(f, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
        why_set(why, "peer.secret_file: %s: %s", f, strerror(errno));
        if (fd >= 0)
            close(fd);
        return KVX_ERR_IO;
    }
    ssize_t n = -1;
    if (st.st_mode & 077)
        why_set(why,
                "peer.secret_file: %s gives group or others access (mode "
                "%03o); chmod 600 it",
                f, (unsigned)(st.st_mode & 0777));
    else if ((n = read(fd, buf, sizeof(buf))) < 16 || n > SECRET_MAX)
        why_set(why,
                "peer.secret_file: %s holds %s%zd bytes; the secret needs "
                "16 to %d (head -c 32 /dev/urandom > FILE)",
                f, n > SECRET_MAX ? "over " : "",
                n > SECRET_MAX ? SECRET_MAX : n, SECRET_MAX);
    close(fd);
    if ((st.st_mode & 077) || n < 16 || n > SECRET_MAX) {
        memset(buf, 0, sizeof(buf));
        /* n < 0: read() itself failed; else the file is unfit */
        return n < 0 && !(st.st_mode & 077) ? KVX_ERR_IO : KVX_ERR_INVALID;
    }
    memcpy(A.secret, buf, (size_t)n);
    memset(buf, 0, sizeof(buf));
    A.secret_len = (size_t)n;
    return 0;
}

int peer_reload_secret(void)
{
    if (!P.on)
        return 0;
    uint8_t old[SECRET_MAX];
    size_t old_len = A.secret_len;
    memcpy(old, A.secret, sizeof(old));
    char why[300];
    if (read_secret(KVX_WHY(why))) {
        memcpy(A.secret, old, sizeof(old)); /* the running one stays */
        A.secret_len = old_len;
        memset(old, 0, sizeof(old));
        log_error("peer: reload: %s; keeping the running secret", why);
        return KVX_ERR_INVALID;
    }
    if (old_len == A.secret_len && !memcmp(old, A.secret, old_len)) {
        memset(old, 0, sizeof(old));
        return 0;
    }
    memcpy(A.prev, old, sizeof(old));
    A.prev_len = old_len;
    A.prev_until = now_ms() + kvxd.conf.peer_secret_previous_ms;
    memset(old, 0, sizeof(old));
    log_notice("peer: reload: a new secret from %s; handshakes accept the "
               "previous one too for %u ms (peer.secret_previous_ms)",
               kvxd.conf.peer_secret_file, kvxd.conf.peer_secret_previous_ms);
    return 1;
}

/* The previous secret's window, over at now. */
void auth_tick(uint64_t now)
{
    if (A.prev_len && now >= A.prev_until) {
        memset(A.prev, 0, sizeof(A.prev));
        A.prev_len = 0;
        log_notice("peer: the previous secret's window is over "
                   "(peer.secret_previous_ms): handshakes take only the "
                   "current one");
    }
}

/* The MAC of a DATA header sent over a lane: HMAC-SHA256 (first
 * LANE_MAC_LEN bytes), under the direction's key, of the connection id,
 * every field that places the piece, its length and the lane it goes
 * over (so a header seen on one lane proves nothing on another). */
void lane_mac(const uint8_t key[MAC_LEN], const Kvxfer__PeerData *d,
              uint64_t len, unsigned lane, uint8_t out[LANE_MAC_LEN])
{
    uint64_t v[10] = {htole64(d->lane_conn), htole64(d->stream),
                      htole64(d->slot),      htole64(d->unit_begin),
                      htole64(d->unit_end),  htole64(d->bytes),
                      htole64(d->offset),    htole64(d->piece_bytes),
                      htole64(len),          htole64(lane)};
    uint8_t full[MAC_LEN];
    unsigned n = MAC_LEN;
    HMAC(EVP_sha256(), key, MAC_LEN, (const uint8_t *)v, sizeof(v), full, &n);
    memcpy(out, full, LANE_MAC_LEN);
}

/* The directions' keys, as the handshake's MACs are made (S the listening
 * daemon's address, D the connecting one's): both daemons derive them,
 * neither sends them. They prove BIND and every DATA over a lane. */
void keys_derive(peer_conn_t *c)
{
    const char *sa = c->outgoing ? c->server_addr : kvxd.address;
    const char *da = c->outgoing ? kvxd.address : c->address;
    hmac_with(c->sec_prev, "kvx-lane-s", c->nonce_c, c->nonce_s, sa, da,
              c->outgoing ? c->tx_key : c->rx_key);
    hmac_with(c->sec_prev, "kvx-lane-c", c->nonce_c, c->nonce_s, sa, da,
              c->outgoing ? c->rx_key : c->tx_key);
}

void bind_mac(const uint8_t key[MAC_LEN], uint64_t conn, uint8_t out[MAC_LEN])
{
    uint8_t msg[8 + 8] = "kvx-bind";
    uint64_t le = htole64(conn);
    memcpy(msg + 8, &le, 8);
    unsigned n = MAC_LEN;
    HMAC(EVP_sha256(), key, MAC_LEN, msg, sizeof(msg), out, &n);
}

/* Was this nonce in a HELLO taken before (within HELLO_SKEW_S, or
 * since seen_floor)? */
static int seen_has(const uint8_t nc[NONCE_LEN])
{
    for (unsigned i = 0; i < A.seen_n; i++)
        if (!memcmp(A.seen[i].nonce, nc, NONCE_LEN))
            return 1;
    return 0;
}

static void seen_add(const uint8_t nc[NONCE_LEN], uint64_t time_s)
{
    unsigned i = A.seen_next;
    if (A.seen_n == SEEN_MAX && A.seen[i].time > A.seen_floor)
        A.seen_floor = A.seen[i].time;
    memcpy(A.seen[i].nonce, nc, NONCE_LEN);
    A.seen[i].time = time_s;
    A.seen_next = (i + 1) % SEEN_MAX;
    if (A.seen_n < SEEN_MAX)
        A.seen_n++;
}

/* c's HELLO h (version and nonce checked): its MAC under either of our
 * secrets (the previous one in a rotation's window) against either of
 * its MACs, made for our listener, not seen before. 0 to go on, with
 * c->hello_ok if it is fresh too (its time within HELLO_SKEW_S of ours
 * and after seen_floor, and fewer than HS_PROVEN_MAX proved open): then
 * the caps never close it. Else refused (-1). */
int hello_check(peer_conn_t *c, const Kvxfer__PeerHello *h)
{
    const char *server = h->server ? h->server : "";
    size_t sl = strlen(server);
    uint8_t mac[MAC_LEN];
    int proved = 0;
    for (int k = 0; k < 2 && !proved; k++) {
        if (k && !prev_open())
            break;
        hello_mac(k, h->nonce.data, server, c->address, h->time, mac);
        proved =
            (h->mac.len == MAC_LEN && ct_equal(mac, h->mac.data, MAC_LEN)) ||
            (h->mac_previous.len == MAC_LEN &&
             ct_equal(mac, h->mac_previous.data, MAC_LEN));
    }
    if (!proved) {
        hello_refuse(c, "wrong cluster secret (%s)",
                     h->mac.len ? "its hello's MAC" : "its hello has no MAC");
        return -1;
    }
    char a[200], w[8];
    struct sockaddr_storage ss;
    socklen_t al;
    snprintf(a, sizeof(a), "kvx://%.160s/x", server);
    if (sl > 159 || strchr(server, '/') ||
        parse_address(a, &ss, &al, KVX_WHY(w)) ||
        !same_sockaddr(&ss, &P.bound)) {
        hello_refuse(c,
                     "this daemon does not listen there (hello made for "
                     "%.160s)",
                     server);
        return -1;
    }
    if (seen_has(h->nonce.data)) {
        hello_refuse(c, "a hello replayed (its nonce came before)");
        return -1;
    }
    uint64_t now = (uint64_t)time(NULL);
    uint64_t skew = h->time > now ? h->time - now : now - h->time;
    if (skew > HELLO_SKEW_S) {
        static uint64_t last;
        if (now_ms() >= last + 1000) { /* at most once a second */
            last = now_ms();
            log_warn("peer %s: its clock is %llu s %s this daemon's (at most "
                     "%d s apart): its handshake goes on, but the handshake "
                     "caps may close it for another; synchronise the clocks",
                     c->address, (unsigned long long)skew,
                     h->time > now ? "ahead of" : "behind", HELLO_SKEW_S);
        }
        return 0;
    }
    seen_add(h->nonce.data, h->time);
    unsigned proven = 0;
    for (peer_conn_t *o = conn_next(NULL); o; o = conn_next(o))
        proven += !o->outgoing && o->state == CONN_AUTH && o->hello_ok;
    c->hello_ok = h->time > A.seen_floor && proven < HS_PROVEN_MAX;
    return 0;
}

void peer_token(const char *instance, uint32_t owner_uid, const char *addr0,
                uint64_t request, uint8_t out[16])
{
    uint8_t buf[512], mac[MAC_LEN];
    int n = snprintf((char *)buf, sizeof(buf), "kvx-token\n%s\n%u\n%s\n%llu",
                     instance, owner_uid, addr0, (unsigned long long)request);
    unsigned ml = MAC_LEN;
    HMAC(EVP_sha256(), A.secret, (int)A.secret_len, buf,
         (size_t)(n < (int)sizeof(buf) ? n : (int)sizeof(buf) - 1), mac, &ml);
    memcpy(out, mac, 16);
}
