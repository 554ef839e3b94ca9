package netpolicy

import (
	"bytes"
	"errors"
	"os"
	"slices"
	"testing"
)

// FuzzParse feeds arbitrary NetworkPolicy files to Parse: it must not
// panic, must refuse with ErrInvalid, and a set it accepts must
// answer Allows for any identities and port.
func FuzzParse(f *testing.F) {
	spec, err := os.ReadFile("testdata/spec-networkpolicy.yaml")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(spec, "agent.pivirt.internal", "pivirtd.pivirt.internal", 9001)
	f.Add([]byte("kind: NetworkPolicy\nspec:\n  rules:\n    - from: [{service: '*'}]\n      to: [{service: '*.x'}]\n"), "a.x", "b.x", 1)
	f.Add([]byte("---\n---\n"), "", "", 0)
	f.Fuzz(func(t *testing.T, data []byte, from, to string, port int) {
		s, err := Parse(bytes.NewReader(data))
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse error %v wraps no ErrInvalid", err)
			}
			return
		}
		ok, by := s.Allows([]string{from}, []string{to}, port)
		if ok && !slices.ContainsFunc(s.Policies, func(p Policy) bool { return p.Metadata.Name == by }) {
			t.Fatalf("allowed by %q, which is none of the set's policies", by)
		}
	})
}
