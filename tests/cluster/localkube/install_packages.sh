#!/bin/bash
# The Debian packages of the local Kubernetes cluster (tests/cluster/localkube): etcd, the
# container runtime and CNI plugins, iptables for kube-proxy, buildah and mmdebstrap for the
# images, and Go 1.19 to build Kubernetes v1.20.2 from Debian's source. Needs root and apt.
set -euo pipefail
PACKAGES="etcd-server containerd runc containernetworking-plugins iptables conntrack
  buildah mmdebstrap uidmap golang-1.19-go golang-github-modern-go-reflect2-dev make rsync
  gcc libc6-dev"
missing=$(for p in $PACKAGES; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "the cluster tests need these Debian packages (as root: apt-get install): $missing" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends $missing >/dev/null \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $missing >/dev/null; }
echo "installed: $(echo $missing)"
