#!/usr/bin/env bash
# make package: the Debian packages pivirt-agent, pvcli and pitrust under
# dist/, built with nfpm (pinned in packaging/go.mod) from
# packaging/nfpm/*.yaml: static binaries, the systemd units of
# packaging/systemd (the packaged agent runs as the system user
# pivirt-agent), the commented default configurations as conffiles, man
# pages (docs/man) and shell completions. VERSION defaults to the release
# of cmd/internal/version; ARCH to go env GOARCH.
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
DIST=$PWD/dist # packaging/nfpm/*.yaml name dist/
VERSION=${VERSION:-$(sed -n 's/^var Version = "\(.*\)"$/\1/p' cmd/internal/version/version.go)}
ARCH=${ARCH:-$($GO env GOARCH)}
REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || true)
export VERSION ARCH

rm -rf "$DIST"
mkdir -p "$DIST/bin" "$DIST/man" "$DIST/completion" "$DIST/tools"
ldflags="-s -w -X pilab.hu/pivirt-agent/cmd/internal/version.Version=$VERSION -X pilab.hu/pivirt-agent/cmd/internal/version.Revision=$REVISION"
CGO_ENABLED=0 GOARCH=$ARCH $GO build -trimpath -ldflags "$ldflags" -o "$DIST/bin/" ./cmd/pivirt-agent ./cmd/pvcli ./cmd/pitrust
(cd packaging && $GO build -o "$DIST/tools/" github.com/goreleaser/nfpm/v2/cmd/nfpm)

# The units as packaged: binaries in /usr/bin (the repository's units name
# /usr/local/bin, for an install by hand); the agent as its system user.
for unit in pivirt-agent pitrust; do
  {
    echo "# The systemd unit of $unit, installed by its package; change it with"
    echo "# systemctl edit $unit (the repository's packaging/systemd/$unit.service"
    echo "# with /usr/bin for /usr/local/bin)."
    sed -e '1,/^\[Unit\]$/{/^#/d}' -e 's|/usr/local/bin/|/usr/bin/|g' packaging/systemd/$unit.service
  } >"$DIST/$unit.service"
done
# The agent runs as its system user (made by the package's postinst).
sed -i 's|^\[Service\]$|[Service]\nUser=pivirt-agent\nGroup=pivirt-agent|' "$DIST/pivirt-agent.service"

for page in docs/man/*.1; do
  gzip -9n <"$page" >"$DIST/man/$(basename "$page").gz"
done
for cmd in pivirt-agent pvcli pitrust; do
  for shell in bash zsh fish; do
    "$DIST/bin/$cmd" completion "$shell" >"$DIST/completion/$cmd.$shell"
  done
done
cat >"$DIST/changelog.yml" <<EOF
- semver: $VERSION-1
  date: $(git log -1 --format=%cI 2>/dev/null || date -u +%FT%TZ)
  packager: PiVirt maintainers <maintainers@pilab.hu>
  deb:
    urgency: medium
    distributions: [stable]
  changes:
    - note: Release $VERSION (CHANGELOG.md in the repository).
EOF

for pkg in pivirt-agent pvcli pitrust; do
  "$DIST/tools/nfpm" package --config "packaging/nfpm/$pkg.yaml" --packager deb --target "$DIST/"
done
ls -l "$DIST"/*.deb
