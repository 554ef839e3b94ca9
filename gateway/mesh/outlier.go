package mesh

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// HealthCheck is active grpc.health.v1 checking of a cluster's endpoints
// (load_balancing.health_check).
type HealthCheck struct {
	Enabled            bool
	Interval, Timeout  time.Duration
	HealthyThreshold   int
	UnhealthyThreshold int
}

// Outlier is passive outlier detection with Envoy's consecutive_5xx
// semantics (circuit_breaking).
type Outlier struct {
	Enabled bool
	// Consecutive5xx failures in a row eject an endpoint.
	Consecutive5xx int
	// Interval is the sweep period: ejections that ran out end, and the
	// ejection multiplier of endpoints not ejected decreases by one.
	Interval time.Duration
	// BaseEjectionTime times the number of ejections (capped at
	// MaxEjectionTime) is how long an ejection lasts.
	BaseEjectionTime time.Duration
	MaxEjectionTime  time.Duration
	// MaxEjectionPercent: no ejection that would leave more than this share
	// of the cluster's endpoints ejected.
	MaxEjectionPercent int
}

// endpointState is what health checks and outlier detection know of an
// endpoint. Guarded by its mutex.
type endpointState struct {
	mu sync.Mutex
	// healthy is the active health state; checks move it after
	// HealthyThreshold successes or UnhealthyThreshold failures in a row.
	healthy            bool
	hcSuccess, hcFails int
	// consecutive failures of calls, ejections so far (the multiplier)
	// and the end of the current ejection (zero: not ejected).
	consecutive  int
	ejections    int
	ejectedUntil time.Time
}

// available reports whether picks may choose the endpoint.
func (e *Endpoint) available() bool { return !e.out.Load() }

// syncOut mirrors the state into the lock-free flag picks read; the
// caller holds e.state.mu.
func (e *Endpoint) syncOut() {
	e.out.Store(!e.state.healthy || !e.state.ejectedUntil.IsZero())
}

// Status describes an endpoint for operators: "healthy", "unhealthy" or
// "ejected".
func (e *Endpoint) Status() string {
	e.state.mu.Lock()
	defer e.state.mu.Unlock()
	switch {
	case !e.state.ejectedUntil.IsZero():
		return "ejected"
	case !e.state.healthy:
		return "unhealthy"
	default:
		return "healthy"
	}
}

// isFailure classifies a call's outcome for outlier detection: the gRPC
// codes a failing server produces (the 5xx of the HTTP mapping, apart
// from Unimplemented, which is the caller's mistake); a deadline counts
// only when the attempt's own timeout fired, not the caller's.
func isFailure(code codes.Code, perTryTimeout bool) bool {
	switch code {
	case codes.Unavailable, codes.Internal, codes.Unknown, codes.DataLoss:
		return true
	case codes.DeadlineExceeded:
		return perTryTimeout
	}
	return false
}

// report records the outcome of a call to e: a failure counts towards
// ejection, anything else resets the count. Calls the client cancelled
// say nothing about the endpoint.
func (b *Backend) report(e *Endpoint, code codes.Code, perTryTimeout bool) {
	if code == codes.Canceled || !b.cfg.Outlier.Enabled {
		return
	}
	if !isFailure(code, perTryTimeout) {
		e.state.mu.Lock()
		e.state.consecutive = 0
		e.state.mu.Unlock()
		return
	}
	e.state.mu.Lock()
	e.state.consecutive++
	due := e.state.consecutive >= b.cfg.Outlier.Consecutive5xx && e.state.ejectedUntil.IsZero()
	e.state.mu.Unlock()
	if due {
		b.eject(e, code)
	}
}

// eject takes e out of the rotation unless the ejected share of the
// cluster would exceed MaxEjectionPercent.
func (b *Backend) eject(e *Endpoint, code codes.Code) {
	b.ejectMu.Lock()
	defer b.ejectMu.Unlock()
	eps := b.Endpoints()
	ejected := 0
	for _, x := range eps {
		x.state.mu.Lock()
		if !x.state.ejectedUntil.IsZero() {
			ejected++
		}
		x.state.mu.Unlock()
	}
	// As Envoy (1.31 on): the share after this ejection may not exceed
	// the maximum, so a cluster of one endpoint is never emptied.
	if len(eps) == 0 || (ejected+1)*100 > b.cfg.Outlier.MaxEjectionPercent*len(eps) {
		b.logger.Warn("endpoint failing but not ejected: circuit_breaking.thresholds.max_ejection_percent reached",
			"endpoint", e.Addr, "ejected", ejected, "endpoints", len(eps), "max_ejection_percent", b.cfg.Outlier.MaxEjectionPercent)
		return
	}
	e.state.mu.Lock()
	if !e.state.ejectedUntil.IsZero() {
		e.state.mu.Unlock()
		return
	}
	e.state.ejections++
	d := b.cfg.Outlier.BaseEjectionTime * time.Duration(e.state.ejections)
	if max := b.cfg.Outlier.MaxEjectionTime; max > 0 && d > max {
		d = max
	}
	e.state.ejectedUntil = b.now().Add(d)
	e.syncOut()
	n := e.state.consecutive
	e.state.mu.Unlock()
	b.logger.Warn("endpoint ejected", "endpoint", e.Addr, "consecutive_failures", n, "last_code", code.String(), "for", d)
	if b.cfg.OnEject != nil {
		b.cfg.OnEject(e.Addr)
	}
}

// sweep ends ejections that ran out and lowers the ejection multiplier of
// endpoints that were not ejected since the last sweep.
func (b *Backend) sweep() {
	now := b.now()
	for _, e := range b.Endpoints() {
		e.state.mu.Lock()
		switch {
		case !e.state.ejectedUntil.IsZero() && !now.Before(e.state.ejectedUntil):
			e.state.ejectedUntil = time.Time{}
			e.state.consecutive = 0
			e.syncOut()
			e.state.mu.Unlock()
			b.logger.Info("endpoint returned after its ejection", "endpoint", e.Addr)
			continue
		case e.state.ejectedUntil.IsZero() && e.state.ejections > 0:
			e.state.ejections--
		}
		e.state.mu.Unlock()
	}
}

func (b *Backend) outlierLoop(ctx context.Context) {
	t := time.NewTicker(b.cfg.Outlier.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			b.sweep()
		}
	}
}

// healthLoop checks every endpoint each interval.
func (b *Backend) healthLoop(ctx context.Context) {
	t := time.NewTicker(b.cfg.HealthCheck.Interval)
	defer t.Stop()
	for {
		var wg sync.WaitGroup
		for _, e := range b.Endpoints() {
			wg.Go(func() { b.check(ctx, e) })
		}
		wg.Wait()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check runs one grpc.health.v1 check of e and moves its state after the
// thresholds.
func (b *Backend) check(ctx context.Context, e *Endpoint) {
	hc := b.cfg.HealthCheck
	cctx, cancel := context.WithTimeout(ctx, hc.Timeout)
	resp, err := healthpb.NewHealthClient(e.conn).Check(cctx, &healthpb.HealthCheckRequest{})
	cancel()
	if ctx.Err() != nil {
		return
	}
	ok := err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	e.state.mu.Lock()
	var changed bool
	var unejected bool
	if ok {
		e.state.hcFails = 0
		e.state.hcSuccess++
		if !e.state.healthy && e.state.hcSuccess >= hc.HealthyThreshold {
			e.state.healthy, changed = true, true
		}
		// A passing active check ends an ejection (Envoy's
		// successful_active_health_check_uneject_host).
		if !e.state.ejectedUntil.IsZero() {
			e.state.ejectedUntil, e.state.consecutive, unejected = time.Time{}, 0, true
		}
	} else {
		e.state.hcSuccess = 0
		e.state.hcFails++
		if e.state.healthy && e.state.hcFails >= hc.UnhealthyThreshold {
			e.state.healthy, changed = false, true
		}
	}
	healthy := e.state.healthy
	e.syncOut()
	e.state.mu.Unlock()
	if unejected {
		b.logger.Info("endpoint returned: an active health check passed", "endpoint", e.Addr)
	}
	if !changed {
		return
	}
	if healthy {
		b.logger.Info("endpoint healthy", "endpoint", e.Addr)
		return
	}
	reason := "status " + resp.GetStatus().String()
	if err != nil {
		reason = err.Error()
	}
	b.logger.Warn("endpoint unhealthy", "endpoint", e.Addr, "failed_checks", hc.UnhealthyThreshold, "reason", reason)
}
