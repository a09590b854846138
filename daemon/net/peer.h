/*
 * peer — this daemon's link to other daemons: one UCP context and worker
 * driven by the libuv loop (ucp_worker_get_efd + uv_poll + ucp_worker_arm,
 * so nothing spins while idle), a sockaddr listener, one connection per
 * UCX endpoint with challenge-response authentication on the cluster
 * secret, the keep-alive, and the dispatch of active messages to the
 * handlers the layers above registered (peer_on_msg, peer_on_lost,
 * peer_set_data_ops).
 *
 * Two active messages: CTRL carries one packed PeerMsg as its data; DATA
 * carries a packed PeerMsg (PeerData) as its header and a piece of a
 * staging slot as its data, received straight into its place in the
 * receiver's slot (rendezvous for large pieces). DATA sends go out at most
 * peer.send_window at a time per connection, the rest queued in order;
 * control messages never wait behind them.
 *
 * Owns the UCP objects, the connections and every UCX request it starts.
 * A connection that fails (endpoint error, keep-alive, authentication)
 * is reported once to every loss callback (peer_on_lost) and stays listed as
 * "lost" for status; it is freed when its UCX requests are all back. The
 * next peer_connect() to that address makes a new one.
 */
#ifndef KVX_PEER_H
#define KVX_PEER_H

#include <stddef.h>
#include <stdint.h>

#include "common/why.h"

#include "kvxfer.pb-c.h"

typedef struct peer_conn peer_conn_t;

/* Bring up UCX and the listener of conf.peer.listen, read the secret,
 * and write this daemon's address (kvx://IP:PORT/id) into kvxd.address.
 * Does nothing when peer.listen is empty. 0, or with why KVX_ERR_INVALID
 * (peer.listen, peer.secret_file, peer.lanes' ports) or KVX_ERR_IO (UCX,
 * a syscall). */
int peer_init(kvx_why_t *why);
int peer_enabled(void);
/* SIGHUP: read peer.secret_file again. A new secret MACs the handshakes
 * from now on; the previous one is still accepted for
 * peer.secret_previous_ms (and offered to peers that have not rotated
 * yet), so that a cluster rotates without a restart. Connections made
 * before stay. 1: a new secret; 0: the same (or peers are off); or
 * KVX_ERR_INVALID, logged, the running secret kept. */
int peer_reload_secret(void);
/* Keep-alive and connect deadlines. */
void peer_tick(uint64_t now_ms);
/* At exit: close every connection; then, once nothing registered with
 * UCX is left (remote_cleanup), UCX itself. */
void peer_cleanup(void);
void peer_shutdown(void);

/* The outgoing connection to the daemon at address, made on first use
 * and reused while it lives. NULL with why when the address names no
 * peer listener or peers are off. */
peer_conn_t *peer_connect(const char *address, kvx_why_t *why);
const char *peer_conn_address(const peer_conn_t *c);
/* A connection's name for the layers above, never reused: they keep it
 * instead of the pointer, which a loss frees. */
uint64_t peer_conn_id(const peer_conn_t *c);
/* The protocol minor the other daemon said in the handshake (0: a daemon
 * before 2.6, which does not say it), or -1 while the handshake is not
 * over: which messages it answers. */
int peer_conn_minor(const peer_conn_t *c);
/* The connection named id while peer lists it (lost ones too, until
 * freed: peer_conn_alive() tells), or NULL: it is gone. */
peer_conn_t *peer_conn_find(uint64_t id);
/* Is address this daemon, or one a connection can be made to? 0; or
 * KVX_ERR_INVALID with why, or peer_address_alias()'s refusal. */
int peer_address_check(const char *address, kvx_why_t *why);
/* Does address name this daemon's listener (its IP and port, however
 * spelt) without being this daemon's address? 0 when not; else
 * KVX_ERR_PEER_GONE (another id: an earlier run's address) or
 * KVX_ERR_INVALID (this id, spelt otherwise), with why. Without a peer
 * listener, an address of this host whose id's first half is this
 * daemon's (its socket path) and second half another is an earlier
 * run's too. Every earlier run's address is refused with "issued by an
 * earlier run of this daemon (its id was X, this run is Y)". A daemon
 * never dials itself; a handshake that reaches itself anyway fails too. */
int peer_address_alias(const char *address, kvx_why_t *why);
/* The capability token of a request of an instance spread over daemons:
 * every daemon of it derives the same one from the cluster secret. The
 * owner's uid goes in, so that an instance of the same name made later
 * by another uid never honours params issued to the first. */
void peer_token(const char *instance, uint32_t owner_uid, const char *addr0,
                uint64_t request, uint8_t out[16]);
int peer_conn_alive(const peer_conn_t *c);

/* Send a control message; queued until the connection is authenticated.
 * 0, or an error (the connection is lost). */
int peer_send(peer_conn_t *c, const Kvxfer__PeerMsg *m);
/* A place data is sent from or received into (UCX's ucp_dt_iov_t, by
 * this name); host memory. */
typedef struct peer_iov {
    void *buf;
    size_t len;
} peer_iov_t;

/* A piece of a slot to send (peer_send_data()). */
typedef struct peer_piece {
    const Kvxfer__PeerMsg *hdr; /* the header: a DATA message (PeerData) */
    const void *buf;            /* the data, buf[0..len) */
    size_t len;
    /* or, when niov > 0, the niov places of iov in host memory (adding
     * up to len, in order; UCX reads them, no copy before) */
    const peer_iov_t *iov;
    size_t niov;
    void (*done)(void *arg, int status);
    void *arg;
    /* the rails its data should go over (peer_gpu_rails() of the GPU
     * its bytes are of); 0: any */
    uint32_t rails;
} peer_piece_t;

/* Send piece p of a slot (p is read before this returns); queued while
 * peer.send_window sends are in flight. 0: then p->done(p->arg, status)
 * runs on the loop once buf (or iov and its places) may be reused
 * (status 0 or a kvx_status_t), always, also when the connection fails
 * (it may run before this returns). p->hdr is a DATA message (else
 * KVX_ERR_INVALID). An error: not sent, done never runs. */
int peer_send_data(peer_conn_t *c, const peer_piece_t *p);
/* Whether a peer_send_data() to c whose done argument is arg still waits
 * in c's queue (peer.send_window full): not handed to UCX, so no byte of
 * it can have reached the other daemon. */
int peer_send_queued(const peer_conn_t *c, const void *arg);
/* Whether UCX may use an RDMA device here (its device list names one,
 * or is every device and there is one): known after peer_init(). */
int peer_rdma(void);
/* The rails (a mask for peer_piece_t.rails) nearest to the GPU whose
 * PCI bus id is busid, as CUDA writes it (peer.topology); 0: any. */
uint32_t peer_gpu_rails(const char *busid);
/* Whether slot data to c goes over lanes now (peer.lanes, both sides). */
int peer_conn_lanes(const peer_conn_t *c);

/* Whether the loaded UCX moves CUDA device memory (its context says
 * so: ucp_context_query()'s memory types), known after peer_init(). */
int peer_cuda(void);
/* Register and unregister memory UCX moves often (staging slots): host
 * memory, or device memory (cuda, only where peer_cuda()). */
void *peer_mem_map(void *addr, size_t len, int cuda);
void peer_mem_unmap(void *memh);

/* For status. */
size_t peer_infos(Kvxfer__PeerInfo ***out);
void peer_free_infos(Kvxfer__PeerInfo **v, size_t n);
void peer_ucx_info(Kvxfer__UcxInfo *info); /* strings are static */

/* ---- what the layers above register ------------------------------------
 * net knows nothing of them: as UCX's active-message handlers, each
 * registers at its init what it takes (remote: transfers and slot data;
 * agree: batches), and net calls back through that alone. */

/* A control message of kind m_case from an authenticated peer (m is
 * freed after). One handler per kind; kinds nobody took are dropped. */
typedef void (*peer_msg_cb)(peer_conn_t *c, const Kvxfer__PeerMsg *m);
void peer_on_msg(int m_case, peer_msg_cb cb);

/* c failed: every transfer on it ends with code; msg says why and names
 * the daemon ("daemon kvx://...: ..."). Each loss callback runs
 * once per loss, in registration order; one that returns KVX_ERR_NOMEM
 * (nothing done yet) is called again at the next tick, and those after it
 * wait (c stays until then). */
typedef int (*peer_lost_cb)(peer_conn_t *c, int code, const char *msg);
void peer_on_lost(peer_lost_cb cb);

/* The slot data path (remote). */
typedef struct peer_data_ops {
    /* where the data of d goes (len bytes): its place in a slot, or NULL
     * to drop it; or, with *niov set, the *niov places of *iov (adding
     * up to len, kept by the caller until arrived()) and any non-NULL
     * return. iov and niov are NULL where places cannot be taken (data
     * on the connection itself, not a lane) */
    void *(*target)(peer_conn_t *c, const Kvxfer__PeerData *d, size_t len,
                    const peer_iov_t **iov, size_t *niov);
    /* the data of d is in its slot (status 0) or will never be (error) */
    void (*arrived)(peer_conn_t *c, const Kvxfer__PeerData *d, int status);
    /* streams (either way) on c, for status */
    uint32_t (*streams)(const peer_conn_t *c);
} peer_data_ops_t;
void peer_set_data_ops(const peer_data_ops_t *ops);

#endif /* KVX_PEER_H */
