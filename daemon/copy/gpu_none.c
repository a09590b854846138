/* gpu_none — the GPU module of a host-only build; see gpu.h. */
#include <stdio.h>

#include "gpu.h"
#include "kvxfer.h"

#define NO_CUDA "this kvxferd was built without CUDA (host pools only)"

const char *gpu_build_info(void)
{
    return "host-only (no CUDA)";
}

void gpu_status(char *buf, size_t len)
{
    snprintf(buf, len, "host-only");
}

int gpu_import(gpu_import_req_t *req, gpu_import_t **out, uint8_t **ptr,
               int *device, kvx_why_t *why)
{
    (void)out;
    (void)ptr;
    (void)device;
    gpu_import_req_close(req);
    return why_fail(why, KVX_ERR_UNSUPPORTED,
                    "register_pool.kind: GPU pool refused: %s", NO_CUDA);
}

void gpu_import_unref(gpu_import_t *imp)
{
    (void)imp;
}

int gpu_import_ptr(gpu_import_t *imp, int device, uint8_t **base,
                   kvx_why_t *why)
{
    (void)imp;
    (void)device;
    (void)base;
    return why_fail(why, KVX_ERR_UNSUPPORTED, "%s", NO_CUDA);
}

void gpu_env(void) {}

void gpu_counts(gpu_counts_t *c)
{
    *c = (gpu_counts_t){0, 0, 0};
}

int gpu_mps(int device)
{
    (void)device;
    return -1;
}

int gpu_started(void)
{
    return -1;
}

int gpu_pci_id(int device, char *buf, size_t len)
{
    (void)device;
    (void)buf;
    (void)len;
    return KVX_ERR_UNSUPPORTED;
}

int gpu_host_register(void *base, uint64_t size, int device)
{
    (void)base;
    (void)size;
    (void)device;
    return KVX_ERR_UNSUPPORTED;
}

void gpu_host_unregister(void *base)
{
    (void)base;
}

int gpu_mem_alloc(int device, size_t len, void **p, kvx_why_t *why)
{
    (void)device;
    (void)len;
    *p = NULL;
    return why_fail(why, KVX_ERR_UNSUPPORTED, "%s", NO_CUDA);
}

void gpu_mem_free(void *p)
{
    (void)p;
}

int gpu_part_create(const plan_t *p, int device, gpu_part_t **out,
                    kvx_why_t *why)
{
    (void)p;
    (void)device;
    (void)out;
    return why_fail(why, KVX_ERR_UNSUPPORTED, "%s", NO_CUDA);
}

int gpu_part_device(const gpu_part_t *gp)
{
    (void)gp;
    return 0;
}

void gpu_part_free(gpu_part_t *gp)
{
    (void)gp;
}

int gpu_launch(gpu_part_t *gp, const gpu_work_t *w, gpu_done_cb done, void *arg)
{
    (void)gp;
    (void)w;
    (void)done;
    (void)arg;
    return KVX_ERR_UNSUPPORTED;
}

int gpu_event_import(const uint8_t handle[64], int device, uint64_t owner,
                     gpu_event_t **out, kvx_why_t *why)
{
    (void)handle;
    (void)device;
    (void)owner;
    *out = NULL;
    return why_fail(
        why, KVX_ERR_UNSUPPORTED,
        "layers_ready.cuda_event: this kvxferd is built without CUDA");
}

void gpu_event_unref(gpu_event_t *e)
{
    (void)e;
}

gpu_watch_t *gpu_event_watch(gpu_event_t *e, gpu_watch_cb cb, void *arg)
{
    (void)e;
    (void)cb;
    (void)arg;
    return NULL;
}

void gpu_event_unwatch(gpu_watch_t *w)
{
    (void)w;
}

int gpu_events_poll(void)
{
    return 0;
}

void gpu_stop(void) {}
void gpu_cleanup(void) {}

int gpu_part_set_blocks(gpu_part_t *gp, uint32_t slice, uint32_t first,
                        const uint32_t *blocks, uint32_t n)
{
    (void)gp;
    (void)slice;
    (void)first;
    (void)blocks;
    (void)n;
    return KVX_ERR_UNSUPPORTED;
}

void gpu_events_forget(uint64_t owner)
{
    (void)owner;
}
