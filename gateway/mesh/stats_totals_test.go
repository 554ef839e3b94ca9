package mesh

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
)

// Totals reads the request counters back per backend cluster: every
// call, and those whose status was not OK as errors.
func TestStatsTotals(t *testing.T) {
	s := NewStats(prometheus.NewRegistry())
	s.observe("vm", codes.OK, time.Millisecond)
	s.observe("vm", codes.OK, time.Millisecond)
	s.observe("vm", codes.Unavailable, time.Millisecond)
	s.observe("vm", codes.NotFound, time.Millisecond)
	s.observe("storage", codes.DataLoss, time.Millisecond) // beyond the cached children
	got := s.Totals()
	if want := (Totals{Requests: 4, Errors: 2}); got["vm"] != want {
		t.Errorf("vm: %+v, want %+v", got["vm"], want)
	}
	if want := (Totals{Requests: 1, Errors: 1}); got["storage"] != want {
		t.Errorf("storage: %+v, want %+v", got["storage"], want)
	}
}
