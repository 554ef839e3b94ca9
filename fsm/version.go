package fsm

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Version is a cluster version: the major.minor of a release. The state
// machine applies every command as the release of the state's cluster
// version does (DESIGN.md, "Cluster version"); patch releases never change
// what is replicated, so they are not part of it.
type Version struct {
	Major, Minor uint32
}

// The versions this release knows, oldest first.
var (
	// Version0_0 is the state of the agents that predate cluster versions
	// (they announce none): per-write dedupe records, no placement catalog,
	// none of the commands and fields added since.
	Version0_0 = Version{0, 0}
	// Version0_1 is release 0.1: client sessions, the placement catalog,
	// health checks, the cluster version itself.
	Version0_1 = Version{0, 1}
)

// Latest is the newest cluster version this release applies. A state or a
// command at a later version stops the state machine (ErrNeedsNewerVersion).
var Latest = Version0_1

// knownVersions lists every version this release can run the state at,
// oldest first: the targets of a downgrade.
var knownVersions = []Version{Version0_0, Version0_1}

// Known reports whether this release can run a state at v.
func (v Version) Known() bool {
	for _, k := range knownVersions {
		if k == v {
			return true
		}
	}
	return false
}

// String is "major.minor".
func (v Version) String() string { return fmt.Sprintf("%d.%d", v.Major, v.Minor) }

// Compare returns -1, 0 or 1 as v is older than, equal to or newer than o.
func (v Version) Compare(o Version) int {
	switch {
	case v.Major != o.Major:
		return cmpUint(v.Major, o.Major)
	default:
		return cmpUint(v.Minor, o.Minor)
	}
}

// Less reports whether v is older than o.
func (v Version) Less(o Version) bool { return v.Compare(o) < 0 }

func cmpUint(a, b uint32) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ParseVersion reads "MAJOR.MINOR", "MAJOR.MINOR.PATCH" or a semantic
// version with a pre-release or build suffix ("0.1.0-rc.1+abc"): the
// cluster version of a release is its major.minor.
func ParseVersion(s string) (Version, error) {
	core := strings.TrimPrefix(s, "v")
	if i := strings.IndexAny(core, "-+"); i >= 0 {
		core = core[:i]
	}
	parts := strings.Split(core, ".")
	if len(parts) < 2 || len(parts) > 3 {
		return Version{}, fmt.Errorf("version %q: want MAJOR.MINOR or MAJOR.MINOR.PATCH", s)
	}
	var nums [3]uint32
	for i, p := range parts {
		n, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return Version{}, fmt.Errorf("version %q: %q is not a number", s, p)
		}
		nums[i] = uint32(n)
	}
	return Version{nums[0], nums[1]}, nil
}

// Feature is something a release added to what agents replicate or say to
// each other: it is used only once the cluster version allows it, so that
// every node applies and understands it alike (DESIGN.md, "Cluster
// version").
type Feature struct {
	// Name is short and stable: it is shown to operators and announced.
	Name string
	// Since is the cluster version that enables it.
	Since Version
	// What says what it is, for pvcli operator upgrade status.
	What string
}

// Features lists every feature this release knows, by the version that
// enables it. A new command, table, field with meaning, snapshot format
// or internal RPC is added here, and its users check Enabled.
var Features = []Feature{
	{FeatureSessions, Version0_1, "client sessions instead of a dedupe record per write (snapshot format 4)"},
	{FeaturePlacements, Version0_1, "the placement catalog and routing by object to the node that holds it (set_placements, snapshot format 3)"},
	{FeatureHealthChecks, Version0_1, "health checks run by agents, check results in heartbeats, deregister_critical_after"},
	{FeatureRefuseWrite, Version0_1, "refused schedule updates recorded for their retries (refuse_write)"},
	{FeatureRunDetails, Version0_1, "the host of a run and the reason of a skipped run"},
	{FeatureLogVerification, Version0_1, "log verification checkpoints in the Raft log"},
	{FeatureClusterVersion, Version0_1, "the cluster version in the state (snapshot format 5), state hashes, downgrades"},
	{FeatureNodeRPCs, Version0_1, "agent-to-agent calls added in 0.1: forced leave, config status, monitor, relayed backend calls, restore plans"},
	{FeatureNodeRestriction, Version0_1, "calls between agents carry their caller's credential, and an agent's certificate alone acts only as its node"},
}

// Feature names.
const (
	FeatureSessions        = "sessions"
	FeaturePlacements      = "placements"
	FeatureHealthChecks    = "health-checks"
	FeatureRefuseWrite     = "refuse-write"
	FeatureRunDetails      = "run-details"
	FeatureLogVerification = "log-verification"
	FeatureClusterVersion  = "cluster-version"
	FeatureNodeRPCs        = "node-rpcs"
	FeatureNodeRestriction = "node-restriction"
)

// FeatureSince returns the version that enables the named feature; false
// for a name this release does not know.
func FeatureSince(name string) (Version, bool) {
	for _, f := range Features {
		if f.Name == name {
			return f.Since, true
		}
	}
	return Version{}, false
}

// Enabled reports whether the named feature may be used at cluster version
// v. An unknown name is never enabled.
func (v Version) Enabled(name string) bool {
	since, ok := FeatureSince(name)
	return ok && !v.Less(since)
}

// FeaturesAt lists the names of the features enabled at v.
func FeaturesAt(v Version) []string {
	var out []string
	for _, f := range Features {
		if !v.Less(f.Since) {
			out = append(out, f.Name)
		}
	}
	return out
}

// ErrNeedsNewerVersion: the state machine met a log entry, a command or a
// snapshot that this release cannot apply (a newer release wrote it). It
// stops applying instead of skipping it (DESIGN.md, "Stop, never skip").
var ErrNeedsNewerVersion = errors.New("needs a newer version")

// HaltError says why the state machine stopped applying the log: the entry
// it could not apply and what it needs.
type HaltError struct {
	// Index is the log index of the entry (or snapshot) not applied.
	Index uint64
	// Needs is the version that knows it, when the entry names it (zero
	// when only "newer than this release" is known).
	Needs Version
	// Reason says what was not understood.
	Reason string
}

func (e *HaltError) Error() string {
	need := "a newer release"
	if e.Needs != (Version{}) {
		need = "release " + e.Needs.String() + " or newer"
	}
	return fmt.Sprintf("stopped applying the log at index %d: %s; this agent runs %s and needs %s: upgrade it (the data is kept as it is)",
		e.Index, e.Reason, Latest, need)
}

func (e *HaltError) Unwrap() error { return ErrNeedsNewerVersion }
