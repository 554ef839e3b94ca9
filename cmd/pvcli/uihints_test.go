package main

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
)

// TestUIHintsMatch keeps the web UI's wording of a refused call and of a
// cluster without a leader equal to pvcli's: an operator sees the same
// sentence in both.
func TestUIHintsMatch(t *testing.T) {
	src, err := os.ReadFile("../../ui/src/api.ts")
	if err != nil {
		t.Fatal(err)
	}
	for name, hint := range map[string]string{"permissionDenied": hintPermissionDenied, "noLeader": hintNoLeader} {
		quoted, _ := json.Marshal(hint)
		if !strings.Contains(string(src), name+":\n    "+string(quoted)) {
			t.Errorf("ui/src/api.ts hints.%s differs from pvcli's:\n  %s", name, quoted)
		}
	}
}
