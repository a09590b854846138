/* status — the one status type's names and texts, shared by daemon,
 * protocol and library. */
#include "kvxfer.h"

static const struct {
    const char *name;
    const char *text;
} codes[] = {
    [0] = {"OK", "success"},
    [1] = {"INVALID", "invalid argument"},
    [2] = {"NOMEM", "out of memory"},
    [3] = {"IO", "input/output error"},
    [4] = {"TIMEOUT", "call timed out"},
    [5] = {"PROTOCOL", "protocol error"},
    [6] = {"VERSION", "protocol version mismatch"},
    [7] = {"PERM", "permission denied"},
    [8] = {"NOT_FOUND", "not found"},
    [9] = {"EXISTS", "already exists"},
    [10] = {"STATE", "not allowed in this state"},
    [11] = {"AUTH", "capability token mismatch"},
    [12] = {"CANCELLED", "cancelled"},
    [13] = {"TIMED_OUT", "deadline expired"},
    [14] = {"PEER_GONE", "peer disconnected"},
    [15] = {"UNSUPPORTED", "not supported"},
    [16] = {"LIMIT", "limit reached"},
    [17] = {"SHUTDOWN", "daemon shutting down"},
    [18] = {"LAYOUT", "invalid layout"},
    [19] = {"MISMATCH", "configurations do not match"},
    [20] = {"CLOSED", "connection closed"},
    [21] = {"BUSY", "resource busy"},
};

const char *kvx_status_str(int status)
{
    if (status > 0 || status < KVX_ERR_LAST)
        return "unknown error";
    return codes[-status].text;
}

const char *kvx_status_name(int status)
{
    if (status > 0 || status < KVX_ERR_LAST)
        return "UNKNOWN";
    return codes[-status].name;
}
