/*
 * t_regions.c — pools of regions: transfers between a one-allocation pool
 * and pools of a region per layer (vLLM) or a K and a V region per layer
 * (SGLang), every destination byte checked (gaps between the regions
 * too); the registrations the daemon and the library refuse, with their
 * codes and messages; one memfd named by two fds; status.
 */

/* A one-region pool to a region per layer and back, several presets,
 * TP and block size changes on the way. */
TEST_T(regions_transfer_one_and_per_layer, 60)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {
        .inst = "rg-ctx", .tp = 1, .pp = 1, .preset = "vllm-nhd", .tpb = 16};
    side_t g = {.inst = "rg-gen",
                .tp = 1,
                .pp = 1,
                .preset = "vllm-nhd",
                .tpb = 16,
                .split = 1};
    xfer_case(d, &M_SMALL, &c, &g, 6, 45, 0);
    side_t c2 = {.inst = "rg-ctx2",
                 .tp = 2,
                 .pp = 1,
                 .preset = "flashinfer",
                 .tpb = 8,
                 .split = 1};
    side_t g2 = {
        .inst = "rg-gen2", .tp = 1, .pp = 1, .preset = "trtllm", .tpb = 4};
    xfer_case(d, &M_SMALL, &c2, &g2, 4, 37, 5);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* SGLang's pools: a K and a V tensor per layer, one token per page, into
 * and out of other shapes (PP 2 on one side). */
TEST_T(regions_transfer_per_kv_sglang, 60)
{
    daemon_t *d = daemon_start(NULL);
    side_t c = {.inst = "rk-ctx",
                .tp = 1,
                .pp = 1,
                .preset = "sglang",
                .tpb = 1,
                .split = 2};
    side_t g = {
        .inst = "rk-gen", .tp = 2, .pp = 1, .preset = "vllm-hnd", .tpb = 4};
    xfer_case(d, &M_SMALL, &c, &g, 5, 33, 0);
    side_t c2 = {.inst = "rk-ctx2",
                 .tp = 1,
                 .pp = 1,
                 .preset = "vllm-nhd",
                 .tpb = 16,
                 .split = 1};
    side_t g2 = {.inst = "rk-gen2",
                 .tp = 1,
                 .pp = 2,
                 .preset = "sglang",
                 .tpb = 1,
                 .split = 2};
    xfer_case(d, &M_SMALL, &c2, &g2, 5, 40, 3);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* A sealed memfd of n bytes. */
static int rg_memfd(uint64_t n)
{
    int fd = memfd_create("kvx-rg", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0 && ftruncate(fd, (off_t)n) == 0 &&
          fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    return fd;
}

/* What a registration of regions is refused for, through the library:
 * the daemon's code and message naming the region or the part. */
TEST(regions_register_refusals)
{
    daemon_t *d = daemon_start(NULL);
    rank_t r;
    side_t s = {.inst = "rr",
                .role = KVX_ROLE_CONTEXT,
                .tp = 1,
                .pp = 1,
                .preset = "vllm-nhd",
                .tpb = 4};
    rank_hello_only(d, &M_SMALL, &s, 0, &r);
    rank_join(&r);
    kvx_layout_t l;
    rank_layout(&r, 8, &l);
    kvx_layout_part_t parts[8];
    CHECK_EQ(kvx_layout_split(&l, 1, parts, 8), 0); /* 4 layers */
    uint64_t ls = kvx_layout_region_span(&l, 0);
    int fd = rg_memfd(8 * ls);
    kvx_host_region_t g[5];
    for (int i = 0; i < 5; i++)
        g[i] = (kvx_host_region_t){fd, (uint64_t)i * ls, ls};
    uint32_t pool;
    /* a region of 0 bytes */
    g[1].size = 0;
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c,
                KVX_ERR_INVALID, "register_pool.regions[1].size: 0");
    /* a region past its memfd */
    g[1] = (kvx_host_region_t){fd, 7 * ls + 1, ls};
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c,
                KVX_ERR_INVALID, "register_pool.regions[1]: [");
    CHECK_STR_CONTAINS(kvx_last_error(r.c), "runs past the");
    /* two regions over the same bytes */
    g[1] = (kvx_host_region_t){fd, 2 * ls + 8, ls};
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c,
                KVX_ERR_INVALID, "overlap regions[");
    g[1] = g[0];
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c,
                KVX_ERR_INVALID, "overlap regions[");
    /* a part past its region: region 2 one byte short */
    g[1] = (kvx_host_region_t){fd, ls, ls};
    g[2].size = ls - 1;
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c,
                KVX_ERR_LAYOUT, "layout: layer 2 kv 1 ends at byte");
    CHECK_STR_CONTAINS(kvx_last_error(r.c), "of region 2, past its");
    g[2].size = ls;
    /* a region no part lies in */
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 5, &pool, T_MS), r.c,
                KVX_ERR_LAYOUT,
                "register_pool.regions[4]: holds no part of the layout");
    /* a part naming a region the pool does not have */
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 3, &pool, T_MS), r.c,
                KVX_ERR_LAYOUT,
                "layout.parts[6]: layer 3 kv 0 in region 3, but the pool "
                "has 3 regions");
    /* too many regions: the library refuses before sending */
    kvx_host_region_t *many = calloc(KVX_MAX_REGIONS + 1, sizeof(*many));
    CHECK(many != NULL);
    for (uint32_t i = 0; i <= KVX_MAX_REGIONS; i++)
        many[i] = (kvx_host_region_t){fd, i, 1};
    CHECK_FAILS(kvx_pool_register_host_regions(
                    r.c, &l, many, KVX_MAX_REGIONS + 1, &pool, T_MS),
                r.c, KVX_ERR_LIMIT, "4097 regions (at most 4096");
    free(many);
    /* not a sealed memfd */
    int loose = memfd_create("kvx-rg-loose", MFD_CLOEXEC);
    CHECK(loose >= 0 && ftruncate(loose, (off_t)ls) == 0);
    g[3] = (kvx_host_region_t){loose, 0, ls};
    CHECK_FAILS(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c,
                KVX_ERR_INVALID,
                "register_pool.allocations[1]: memfd lacks F_SEAL_SHRINK");
    close(loose);
    /* nothing was left registered, and it all works in the end */
    g[3] = (kvx_host_region_t){fd, 3 * ls, ls};
    char *js = status_json(d);
    CHECK_EQ(json_pool_count(js), 0);
    free(js);
    CHECK_KVX(kvx_pool_register_host_regions(r.c, &l, g, 4, &pool, T_MS), r.c);
    close(fd);
    rank_close(&r);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* Regions in several memfds, one of them named by two fds (the library
 * shares a file once), the same memfd at several offsets: accepted, and
 * status counts the regions. */
TEST(regions_several_memfds_one_file_twice)
{
    daemon_t *d = daemon_start(NULL);
    rank_t r;
    side_t s = {.inst = "rm",
                .role = KVX_ROLE_CONTEXT,
                .tp = 1,
                .pp = 1,
                .preset = "sglang",
                .tpb = 1};
    rank_hello_only(d, &M_SMALL, &s, 0, &r);
    rank_join(&r);
    kvx_layout_t l;
    rank_layout(&r, 16, &l);
    kvx_layout_part_t parts[8];
    CHECK_EQ(kvx_layout_split(&l, 2, parts, 8), 0); /* K and V per layer */
    uint64_t ps = kvx_layout_region_span(&l, 0);
    int a = rg_memfd(4 * ps), b = rg_memfd(4 * ps + 100);
    int b2 = dup(b);
    CHECK(b2 >= 0);
    kvx_host_region_t g[8];
    for (int i = 0; i < 8; i++) /* K in a, V in b (or b2), reversed */
        g[i] = (kvx_host_region_t){
            i % 2 ? (i % 4 == 1 ? b : b2) : a,
            (uint64_t)(3 - i / 2) * ps + (i % 2 ? 100 : 0), ps};
    uint32_t pool;
    CHECK_KVX(kvx_pool_register_host_regions(r.c, &l, g, 8, &pool, T_MS), r.c);
    char *js = status_json(d);
    CHECK_STR_CONTAINS(js, "\"regions\":8}");
    free(js);
    CHECK(log_wait(d, "bytes in 8 regions", 2000));
    close(a);
    close(b);
    close(b2);
    rank_close(&r);
    daemon_healthy(d);
    daemon_stop_ok(d);
}

/* What only a client that builds its own frames can send: the daemon
 * refuses it at the edge, naming the field. */
TEST(regions_raw_refusals)
{
    daemon_t *d = daemon_start(NULL);
    int fd = raw_connect(d);
    Kvxfer__ParallelConfig pc = KVXFER__PARALLEL_CONFIG__INIT;
    pc.tp = pc.pp = pc.cp = 1;
    pc.total_layers = 4;
    pc.total_kv_heads = 4;
    Kvxfer__Hello hm = KVXFER__HELLO__INIT;
    hm.version_major = KVX_PROTOCOL_MAJOR;
    hm.instance_id = "rg-raw";
    hm.role = KVXFER__ROLE__ROLE_CONTEXT;
    hm.parallel = &pc;
    Kvxfer__Request rq = KVXFER__REQUEST__INIT;
    rq.id = 1;
    rq.body_case = KVXFER__REQUEST__BODY_HELLO;
    rq.hello = &hm;
    raw_send_request(fd, &rq);
    Kvxfer__Reply *rp = raw_reply(fd, 2000);
    CHECK(rp && rp->status == 0);
    kvxfer__reply__free_unpacked(rp, NULL);

    Kvxfer__Layout lay = KVXFER__LAYOUT__INIT;
    lay.preset = "mla";
    lay.num_layers = 1;
    lay.kv_factor = 1;
    lay.num_heads = 1;
    lay.head_dim = 8;
    lay.elem_size = 2;
    lay.tokens_per_block = 1;
    lay.num_blocks = 4;
    lay.head_stride = lay.token_stride = 16;
    lay.block_stride = 16;
    Kvxfer__Allocation al[2] = {KVXFER__ALLOCATION__INIT,
                                KVXFER__ALLOCATION__INIT};
    Kvxfer__Allocation *alp[2] = {&al[0], &al[1]};
    enum { NR = KVX_MAX_REGIONS + 1 };
    Kvxfer__Region *rg = calloc(NR, sizeof(*rg));
    Kvxfer__Region **rgp = calloc(NR, sizeof(*rgp));
    CHECK(rg && rgp);
    for (uint32_t i = 0; i < NR; i++) {
        kvxfer__region__init(&rg[i]);
        rg[i].size = 64;
        rgp[i] = &rg[i];
    }
    Kvxfer__RegisterPool m = KVXFER__REGISTER_POOL__INIT;
    m.layout = &lay;
    m.allocations = alp;
    m.regions = rgp;
    rq.body_case = KVXFER__REQUEST__BODY_REGISTER_POOL;
    rq.register_pool = &m;
    static const struct {
        uint32_t nalloc, nreg, second_kind, second_region_alloc;
        int code;
        const char *why;
    } c[] = {
        /* more regions than KVX_MAX_REGIONS */
        {1, NR, 0, 0, KVX_ERR_LIMIT,
         "register_pool.regions: 4097 regions (at most 4096"},
        /* host memory and a GPU allocation in one pool */
        {2, 2, KVXFER__POOL_KIND__POOL_GPU_IPC, 1, KVX_ERR_UNSUPPORTED,
         "register_pool.allocations[1].kind: GPU and host memory in one "
         "pool"},
        /* one memfd listed twice */
        {2, 2, KVXFER__POOL_KIND__POOL_HOST_MEMFD, 1, KVX_ERR_INVALID,
         "register_pool.allocations[1]: the same memfd as allocations[0]"},
        /* an allocation no region lies in */
        {2, 2, KVXFER__POOL_KIND__POOL_HOST_MEMFD, 0, KVX_ERR_INVALID,
         "register_pool.allocations[1]: no region lies in it"},
        /* a region naming an allocation that is not there */
        {1, 2, 0, 5, KVX_ERR_INVALID,
         "register_pool.regions[1].allocation: 5, but there are 1"},
        /* no regions */
        {1, 0, 0, 0, KVX_ERR_INVALID,
         "register_pool: 1 allocations for 0 "
         "regions"},
    };
    int mfd = rg_memfd(1 << 20);
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        al[1].kind = c[i].second_kind;
        uint8_t uuid[16] = {0}, ipc[64] = {0};
        al[1].gpu_uuid.data = uuid;
        al[1].gpu_uuid.len = c[i].second_kind ? 16 : 0;
        al[1].ipc_handle.data = ipc;
        al[1].ipc_handle.len = c[i].second_kind ? 64 : 0;
        m.n_allocations = c[i].nalloc;
        m.n_regions = c[i].nreg;
        if (c[i].nreg > 1)
            rg[1].allocation = c[i].second_region_alloc;
        if (c[i].nreg > 1)
            rg[1].offset = 64;
        int fds[2] = {mfd, mfd};
        int nfd = c[i].nalloc == 2 && !c[i].second_kind ? 2 : 1;
        rq.id = 10 + i;
        raw_send_request_fds(fd, &rq, fds, nfd);
        rp = raw_reply(fd, 2000);
        CHECK(rp != NULL);
        if (rp->status != c[i].code || !strstr(rp->message, c[i].why))
            fprintf(stderr, "case %zu: %d '%s'\n", i, rp->status, rp->message);
        CHECK_EQ(rp->status, c[i].code);
        CHECK_STR_CONTAINS(rp->message, c[i].why);
        kvxfer__reply__free_unpacked(rp, NULL);
        rg[1].allocation = 0;
    }
    close(mfd);
    free(rg);
    free(rgp);
    close(fd);
    /* every fd sent with a refused request is closed */
    char *js = status_json(d);
    CHECK_EQ(json_pool_count(js), 0);
    free(js);
    daemon_healthy(d);
    daemon_stop_ok(d);
}
