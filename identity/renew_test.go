package identity_test

import (
	"crypto/x509"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"
)

// TestRenewBeforeExpiry: a certificate is due when renew_before or less of
// its lifetime remains, less up to a tenth of jitter; one shorter than
// three renew_befores is due with a third of its lifetime left.
func TestRenewBeforeExpiry(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	const day = 24 * time.Hour
	for _, tc := range []struct {
		name           string
		lifetime       time.Duration
		before, window time.Duration
	}{
		{"a year, 30 days before", 365 * day, 30 * day, 30 * day},
		{"30 days, 30 days before", 30 * day, 30 * day, 10 * day},
		{"30 s, 30 days before", 30 * time.Second, 30 * day, 10 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leaf := &x509.Certificate{NotBefore: start, NotAfter: start.Add(tc.lifetime)}
			due := identity.RenewBeforeExpiry(tc.before)
			seen := map[time.Time]bool{}
			for range 50 {
				at := due(leaf)
				seen[at] = true
				latest, earliest := leaf.NotAfter.Add(-tc.window), leaf.NotAfter.Add(-tc.window-tc.window/10)
				if at.After(latest) || at.Before(earliest) {
					t.Fatalf("due at %s, want between %s and %s", at, earliest, latest)
				}
			}
			if len(seen) < 2 {
				t.Errorf("50 draws all due at the same time: no jitter")
			}
		})
	}
}
