# A fresh Debian root for the install tests (scripts/test-deb.sh,
# scripts/test-container.sh): sourced, not run. The caller sets root
# (the folder) before calling these.
#   debroot_make LOG      debootstrap --variant=minbase SUITE into $root
#                         from MIRROR: 0 made; 3 the mirror cannot be
#                         reached; 1 another failure (LOG's tail shown)
#   debroot_mount         /proc and a /dev/shm (memfds, POSIX shm) there
#   debroot_umount        both again (lazily: a process may hold them)
#   in_root CMD...        CMD in $root as root, in a clean environment
#   as USER CMD...        CMD in $root as USER with its groups
#   wait_socket PATH      up to 10 s for a socket at PATH: 0 once there
#   wait_exit PID         up to 10 s for PID to exit: 0 once gone
# KVX_DEB_MIRROR (default http://deb.debian.org/debian) and KVX_DEB_SUITE
# (default this machine's codename) choose what debootstrap fetches.
MIRROR=${KVX_DEB_MIRROR:-http://deb.debian.org/debian}
SUITE=${KVX_DEB_SUITE:-$(. /etc/os-release 2>/dev/null; echo "${VERSION_CODENAME:-bookworm}")}

debroot_make() {
    if debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$1" 2>&1; then
        chmod 755 "$root" # the root of the chroot: others must reach /usr
        return 0
    fi
    tail -n 5 "$1"
    grep -qiE 'resolve|connect|download|Release' "$1" && return 3
    return 1
}

debroot_mount() {
    mount -t proc proc "$root/proc"
    mkdir -p "$root/dev/shm" && mount -t tmpfs -o mode=1777 shm "$root/dev/shm"
}

debroot_umount() {
    for m in dev/shm proc; do
        mountpoint -q "$root/$m" 2>/dev/null && umount -l "$root/$m"
    done
    return 0
}

in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"; }
as() { u=$1; shift; in_root setpriv --reuid="$u" --regid="$u" --init-groups "$@"; }

wait_socket() {
    i=0
    while [ ! -S "$1" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    [ -S "$1" ]
}

wait_exit() {
    i=0
    while kill -0 "$1" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    ! kill -0 "$1" 2>/dev/null
}
