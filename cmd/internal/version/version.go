// Package version holds the version every PiVirt binary reports: the release
// (set at link time), the source revision and the Go release it was built
// with (both read from the build information the go command embeds), and the
// protocol agents speak to each other.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

// Version is the release: a semantic version, kept in the repository
// (CHANGELOG.md names each release and the commit it was cut from). The
// cluster version an agent announces is its major.minor (fsm.Version). A
// packaging build may still set it with
//
//	-ldflags "-X pilab.hu/pivirt-agent/cmd/internal/version.Version=1.2.3"
var Version = "0.1.0"

// Revision is the source revision; the Makefile sets it like Version. When
// empty, the revision the go command stamped into the build (when it did)
// is reported.
var Revision = ""

// Protocol is the version of what agents exchange with each other: gossip
// metadata, Raft commands and the internal node API. Agents announce it in
// gossip with Version; an agent announcing a protocol below 2 (or none)
// predates cluster versions and counts as version 0.0. What a release adds
// is used only once the cluster version allows it (fsm.Features), so the
// protocol rises only when the announcement itself changes.
const Protocol = 2

// Info is a binary's version as reported by --version and `version`.
type Info struct {
	Program  string `json:"program"`
	Version  string `json:"version"`
	Revision string `json:"revision,omitempty"`
	Modified bool   `json:"modified,omitempty"`
	Go       string `json:"go"`
	// Protocol is set for pivirt-agent only (Agent).
	Protocol int `json:"protocol,omitempty"`
}

// Get is the version of the running binary, named program.
func Get(program string) Info {
	info := Info{Program: program, Version: Version, Revision: Revision, Go: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok && Revision == "" {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				info.Revision = s.Value
			case "vcs.modified":
				info.Modified = s.Value == "true"
			}
		}
	}
	return info
}

// Agent is the version of pivirt-agent, with the protocol it speaks.
func Agent() Info {
	i := Get("pivirt-agent")
	i.Protocol = Protocol
	return i
}

// String is the one-line form: "pvcli 0.1.0 (revision 1a2b3c4d5e6f,
// modified; go1.26.8; protocol 1)".
func (i Info) String() string {
	var parts []string
	if i.Revision != "" {
		rev := "revision " + i.Revision[:min(12, len(i.Revision))]
		if i.Modified {
			rev += ", modified"
		}
		parts = append(parts, rev)
	}
	parts = append(parts, i.Go)
	if i.Protocol != 0 {
		parts = append(parts, fmt.Sprintf("protocol %d", i.Protocol))
	}
	return fmt.Sprintf("%s %s (%s)", i.Program, i.Version, strings.Join(parts, "; "))
}

// AddFlag gives root a --version flag printing info on one line, as the
// version command does.
func AddFlag(root *cobra.Command, info Info) {
	root.Version = info.String()
	root.SetVersionTemplate("{{.Version}}\n")
}
