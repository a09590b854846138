#!/usr/bin/env python3
"""A copy of a wheel without some of its folders, still installable by pip.

    scripts/wheel-drop.py WHEEL OUTDIR PREFIX [PREFIX ...]

Writes OUTDIR/<the same file name> holding every file of WHEEL except
those whose path starts with a PREFIX, and drops their lines from the
wheel's RECORD so that pip installs the rest. For carrying a large wheel
where space is short: the nixl-cu13 wheel (56 MiB) is 27.6 MiB without its
expert-parallel kernels (nixl_ep_cu13/), its C++ headers (*.data/) and its
telemetry reader (nixl_cu13.scripts/), none of which a KV transfer loads:

    scripts/wheel-drop.py nixl_cu13-1.5.1-cp312-*.whl slim/ \\
        nixl_ep_cu13/ nixl_cu13-1.5.1.data/ nixl_cu13.scripts/
"""
import os
import sys
import zipfile


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, outdir, prefixes = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
    os.makedirs(outdir, exist_ok=True)
    dst = os.path.join(outdir, os.path.basename(src))
    if os.path.abspath(dst) == os.path.abspath(src):
        print("wheel-drop: OUTDIR holds WHEEL already", file=sys.stderr)
        return 2
    dropped = kept = 0
    with zipfile.ZipFile(src) as zin, \
            zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.startswith(prefixes):
                dropped += 1
                continue
            data = zin.read(info)
            if name.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines(keepends=True)
                data = "".join(r for r in rows
                               if not r.startswith(prefixes)).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            kept += 1
    print(f"wheel-drop: {dst}: {kept} files kept, {dropped} dropped, "
          f"{os.path.getsize(src) >> 20} -> {os.path.getsize(dst) >> 20} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
