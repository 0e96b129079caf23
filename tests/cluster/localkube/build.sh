#!/bin/bash
# Build the Kubernetes v1.20.2 control plane and node binaries offline from Debian bookworm's
# `kubernetes` source package (the full upstream tree with vendor/) with Debian's Go 1.19, into
# $DEST (default ~/.cache/skiff/k8s/v1.20.2/bin). Only the machine's own Debian mirror is used:
# a private deb-src list derived from its apt sources. Idempotent: a complete $DEST is kept.
#   tests/cluster/localkube/build.sh [DEST]
set -euo pipefail
VERSION=1.20.5+really1.20.2-1.1+deb12u1
TARGETS="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kube-proxy"
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/skiff/k8s/v1.20.2
DEST=${1:-$CACHE/bin}
BINARIES="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"
complete() { for b in $BINARIES; do [ -x "$DEST/$b" ] || return 1; done; }
if complete; then echo "kubernetes v1.20.2 binaries already in $DEST"; exit 0; fi

WORK=$CACHE/src
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/archives/partial"
"$(dirname "$0")/install_packages.sh"
# deb-src lines for the mirrors the machine already uses (deb822 or one-line sources)
: > "$WORK/apt/src.sources"
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" >> "$WORK/apt/src.sources" && echo >> "$WORK/apt/src.sources"
done
: > "$WORK/apt/src.list"
[ -f /etc/apt/sources.list ] && sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > "$WORK/apt/src.list"
APT=(-o Dir::Etc::sourcelist="$WORK/apt/src.list" -o Dir::Etc::sourceparts="$WORK/apt"
     -o Dir::State::Lists="$WORK/apt/lists" -o Dir::Cache::Archives="$WORK/apt/archives")
apt-get "${APT[@]}" update -q >/dev/null
cd "$WORK"
[ -f kubernetes_1.20.5+really1.20.2.orig.tar.gz ] \
  || apt-get "${APT[@]}" source -q --download-only "kubernetes=$VERSION" >/dev/null
[ -d kubernetes-1.20.2 ] || tar xzf kubernetes_1.20.5+really1.20.2.orig.tar.gz
cd kubernetes-1.20.2
# Go >= 1.18 changed the runtime internals that vendored reflect2 v1.0.1 reads; v1.0.2 follows them.
rm -f vendor/github.com/modern-go/reflect2/*.go
cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go vendor/github.com/modern-go/reflect2/
# v1.20 builds in GOPATH mode through its own Makefile (code generators, then the commands);
# the version is stamped from the release tarball's header.
export PATH=/usr/lib/go-1.19/bin:$PATH HOME=$WORK/home GOPROXY=off CGO_ENABLED=0
mkdir -p "$HOME"
# a failed parallel build (it peaks at ~1.5 GB per compile job) is retried on one job
nice -n 10 make WHAT="$TARGETS" || GOFLAGS=-p=1 nice -n 10 make WHAT="$TARGETS"
mkdir -p "$DEST"
for b in $BINARIES; do install -m 0755 "_output/local/bin/linux/amd64/$b" "$DEST/$b.tmp"; mv "$DEST/$b.tmp" "$DEST/$b"; done
cd / && rm -rf "$WORK"
echo "kubernetes v1.20.2 binaries in $DEST"
