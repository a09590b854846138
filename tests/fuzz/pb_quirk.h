/* pb_quirk.h — shared by the fuzz targets and test_frame. */
#ifndef KVX_PB_QUIRK_H
#define KVX_PB_QUIRK_H

#include <protobuf-c/protobuf-c.h>
#include <stdint.h>

/*
 * protobuf-c 1.4 accepts an unknown field numbered 0 when its tag is
 * written in a non-canonical varint (0x80 0x00), keeps it, re-encodes it
 * canonically (0x00) and then refuses its own output. That is the
 * library's quirk, not kvxfer's (the daemon never re-encodes what it
 * received), so a failed re-decode is tolerated only when such a field
 * is present somewhere in the message.
 */
static int has_field0(const ProtobufCMessage *m)
{
    if (!m)
        return 0;
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0)
            return 1;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *base = (const char *)m;
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *v =
                *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (has_field0(v[k]))
                    return 1;
            continue;
        }
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        if (has_field0(*(ProtobufCMessage *const *)(base + f->offset)))
            return 1;
    }
    return 0;
}

#endif
