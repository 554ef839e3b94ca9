#!/usr/bin/env bash
# Builds kube-apiserver from source (the module kubetest/apiserver, which
# pins k8s.io/kubernetes) into a per-machine cache, and prints the binary's
# path on stdout. The end-to-end tests of the operator run it through
# cmd/internal/kubetest; nothing prebuilt is ever downloaded.
#
# The cache entry is named after the Kubernetes version and a hash of
# kubetest/apiserver/go.sum, so bumping the pin builds a new binary:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/pivirt/kube-apiserver-<version>-<hash>/kube-apiserver
# A present binary is reused. Otherwise it is built into a temporary
# directory next to it and renamed into place (atomic), under an flock on a
# lock file, so concurrent callers build it once and never see a partial
# file. The first build takes several minutes; go's output goes to stderr.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/kubetest/apiserver

version=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v[0-9]/ { print $2; exit }' "$mod/go.mod")
if [ -z "$version" ]; then
	echo "kube-apiserver.sh: no k8s.io/kubernetes requirement in $mod/go.mod" >&2
	exit 1
fi
if command -v sha256sum >/dev/null 2>&1; then
	sum=$(sha256sum "$mod/go.sum")
else
	sum=$(shasum -a 256 "$mod/go.sum")
fi
hash=${sum:0:16}

dir=${XDG_CACHE_HOME:-$HOME/.cache}/pivirt/kube-apiserver-$version-$hash
bin=$dir/kube-apiserver
if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi

mkdir -p "$dir"
if command -v flock >/dev/null 2>&1; then
	exec 9>"$dir/lock"
	flock 9
fi
# Another caller may have built it while this one waited for the lock.
if [ ! -x "$bin" ]; then
	tmp=$(mktemp -d "$dir/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	echo "kube-apiserver.sh: building kube-apiserver $version into $dir (the first build takes several minutes)" >&2
	# The version variables are what Kubernetes' own build sets, so that
	# /version and clients see $version instead of v0.0.0-master.
	minor=${version#v1.}
	minor=${minor%%.*}
	pkg=k8s.io/component-base/version
	ldflags="-X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
	start=$SECONDS
	(cd "$mod" && go build -o "$tmp/kube-apiserver" -ldflags "$ldflags" k8s.io/kubernetes/cmd/kube-apiserver) >&2
	mv -f "$tmp/kube-apiserver" "$bin"
	echo "kube-apiserver.sh: built $bin in $((SECONDS - start))s" >&2
fi
echo "$bin"
