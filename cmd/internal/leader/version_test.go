package leader

import (
	"testing"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
)

// TestDowngradeHoldEndsOnlyForAKnownServer: the hold of a downgrade to
// 0.0 ends when a server gossip knows announces 0.0, not when a server is
// unknown to gossip (counted as the oldest, it says nothing of the
// downgrade: a leader that just started has not met every member yet).
func TestDowngradeHoldEndsOnlyForAKnownServer(t *testing.T) {
	sv := func(name string, known bool, v fsm.Version) cluster.ServerVersion {
		return cluster.ServerVersion{Name: name, Known: known, Version: v}
	}
	for _, tc := range []struct {
		name    string
		servers []cluster.ServerVersion
		want    string
	}{
		{"every server at the latest", []cluster.ServerVersion{sv("a", true, fsm.Latest), sv("b", true, fsm.Latest)}, ""},
		{"one unknown to gossip", []cluster.ServerVersion{sv("a", true, fsm.Latest), sv("", false, fsm.Version0_0)}, ""},
		{"one runs 0.0", []cluster.ServerVersion{sv("a", true, fsm.Latest), sv("", false, fsm.Version0_0), sv("c", true, fsm.Version0_0)}, "c"},
	} {
		got := knownAtOrBelow(tc.servers, fsm.Version0_0)
		switch {
		case tc.want == "" && got != nil:
			t.Errorf("%s: the hold ends for %q", tc.name, got.Name)
		case tc.want != "" && (got == nil || got.Name != tc.want):
			t.Errorf("%s: got %v, want the hold to end for %s", tc.name, got, tc.want)
		}
	}
	low, _ := cluster.LowestVersion([]cluster.ServerVersion{sv("a", true, fsm.Latest), sv("", false, fsm.Version0_0)})
	if low != fsm.Version0_0 {
		t.Fatalf("a server unknown to gossip counts as %s, want the oldest", low)
	}
}
