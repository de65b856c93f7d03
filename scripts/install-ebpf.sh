#!/usr/bin/env bash
# Installs what the eBPF network faults need (chaos/faults/network.py) and links kernel headers into place.
# Idempotent; as root only (prints a one-line note and exits 0 otherwise). Debian 12 packages:
#   python3-bpfcc, bpfcc-tools  bcc 0.26, which compiles the TC classifier at run time
#   python3-pyroute2            attaches it to a clsact qdisc on lo
#   linux-headers-amd64         bcc needs headers; kernels without their own use Debian's, linked below
set -euo pipefail

PACKAGES=(python3-bpfcc bpfcc-tools linux-headers-amd64 python3-pyroute2)

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "note: install-ebpf: not root or no apt-get; eBPF network faults will be skipped"
    exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-ebpf: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "install-ebpf: packages already installed"
fi

modules="/lib/modules/$(uname -r)"
# The newest Debian header set: linux-headers-<ver>-amd64 plus its matching -common.
arch_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$arch_dir" ]; then
    echo "note: install-ebpf: no /usr/src/linux-headers-*-amd64 found; eBPF faults will say unavailable"
    exit 0
fi
common_dir="${arch_dir%-amd64}-common"
mkdir -p "$modules"
link_if_missing() {  # $1 target, $2 link name
    if [ -e "$2" ]; then
        echo "install-ebpf: $2 exists ($(readlink -f "$2")), left as is"
    elif [ -d "$1" ]; then
        ln -sfn "$1" "$2"
        echo "install-ebpf: linked $2 -> $1"
    else
        echo "install-ebpf: $1 missing, $2 not linked" >&2
    fi
}
link_if_missing "$arch_dir" "$modules/build"
link_if_missing "$common_dir" "$modules/source"
echo "install-ebpf: done"
