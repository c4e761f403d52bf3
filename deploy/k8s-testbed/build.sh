#!/bin/sh
# Builds the test cluster's control plane (kube-apiserver, kube-controller-manager, kube-scheduler v1.37.2 and
# etcd) from this Go module into DEST (make k8s-testbed: .tools/k8s), through a cache of the finished binaries
# outside the clone, keyed by the Kubernetes version and a hash of this module's files:
#   ${TENPLEX_CACHE:-$HOME/.cache/tenplex}/k8s-v1.37.2-<hash>/
# A fresh clone on a machine that built them once links them from there (no Go work at all); a machine that has
# Go's module and build caches ($HOME/go/pkg/mod, $HOME/.cache/go-build) but not this cache relinks in a minute;
# a new machine builds cold (recorded in benchmarks/RESULTS.md). Without `go` it says so and exits 0: the
# Kubernetes tests then skip, naming the reason.
set -eu

DEST=${1:?usage: build.sh DEST_DIR}
MODULE=$(cd "$(dirname "$0")" && pwd)
VERSION=v1.37.2
BINS="kube-apiserver kube-controller-manager kube-scheduler etcd"

hash=$(cat "$MODULE/go.mod" "$MODULE/go.sum" "$MODULE/etcd/main.go" "$MODULE/build.sh" | sha256sum | cut -c1-12)
key="k8s-$VERSION-$hash"
cache="${TENPLEX_CACHE:-${HOME:-/tmp}/.cache/tenplex}/$key"

have_all() {
	for b in $BINS; do [ -x "$1/$b" ] || return 1; done
}

if [ -f "$DEST/.key" ] && [ "$(cat "$DEST/.key")" = "$key" ] && have_all "$DEST"; then
	exit 0
fi

if ! have_all "$cache"; then
	if ! command -v go >/dev/null 2>&1; then
		echo "note: Go is not installed: the Kubernetes control plane (kube-apiserver $VERSION, etcd) cannot be built" \
			"and tests/k8s will skip (install Go 1.26+ with access to the Go module proxy, then run make k8s-testbed)"
		exit 0
	fi
	echo "building kube-apiserver, kube-controller-manager, kube-scheduler $VERSION and etcd into $cache" \
		"(cold: about 8.5 minutes on 2 cores; with warm Go caches: about a minute)"
	mkdir -p "$(dirname "$cache")"
	tmp="$cache.tmp.$$"
	rm -rf "$tmp"
	mkdir -p "$tmp"
	# The version the binaries report (helm checks the chart's kubeVersion against it); link-time only, so
	# Go's build cache of the compiled packages is reused whatever these say.
	pkg=k8s.io/component-base/version
	ldflags="-X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=37 -X $pkg.gitTreeState=clean"
	ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$VERSION"
	(cd "$MODULE" && go build -ldflags "$ldflags" -o "$tmp/" k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler ./etcd)
	rm -rf "$cache"
	mv "$tmp" "$cache"
fi

mkdir -p "$DEST"
for b in $BINS; do
	# A hard link where the cache and the clone share a file system, else a copy.
	ln -f "$cache/$b" "$DEST/$b" 2>/dev/null || cp -f "$cache/$b" "$DEST/$b"
done
echo "$key" > "$DEST/.key"
