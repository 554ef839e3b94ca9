package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/hashicorp/go-memdb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// Service checks (cmd/internal/agent/DESIGN.md, "Service checks"): the
// agent runs the check of every instance registered with its node, one
// goroutine per check, started and stopped as the replicated catalog
// changes, and records a change of the result through the normal write
// path (a Heartbeat with the health and output: forwarded to the leader,
// or in etcd mode written here). Only changes are written; every probe
// compares its decision with the stored health, so a write lost to a
// leader change is made again by the next probe.

// checkKey names an instance.
type checkKey struct{ service, id string }

// checkRunner is one running check.
type checkRunner struct {
	check  *clusterv1.HealthCheck
	cancel context.CancelFunc
	done   chan struct{}
}

// checkState is what the agent's state backend offers the runners.
type checkState interface {
	State() *fsm.State
}

// runChecks starts the check runners of this node's instances and follows
// the catalog until the agent stops.
func (a *Agent) runChecks() error {
	var state checkState = a.fsm
	if a.etcdMode() {
		state = a.etcd
	}
	a.wg.Go(func() { a.followChecks(a.ctx, state) })
	return nil
}

// followChecks keeps one runner per instance of this node with a check,
// restarting a runner whose check changed.
func (a *Agent) followChecks(ctx context.Context, state checkState) {
	runners := map[checkKey]*checkRunner{}
	stop := func(k checkKey) {
		r := runners[k]
		r.cancel()
		<-r.done
		delete(runners, k)
	}
	defer func() {
		for k := range runners {
			stop(k)
		}
	}()
	for ctx.Err() == nil {
		if !a.allows(fsm.FeatureHealthChecks) {
			// The agents that predate checks would record a check's
			// result as a passing heartbeat: none runs before every
			// server knows them.
			for k := range runners {
				stop(k)
			}
			if !sleepCtx(ctx, 2*time.Second) {
				return
			}
			continue
		}
		ws := memdb.NewWatchSet()
		// The rows of this node's checked instances: heartbeats and
		// other nodes' writes neither wake this loop nor cost it a scan.
		checks, err := state.State().ChecksByNode(a.cfg.NodeName, ws)
		if err != nil {
			a.logger.Warn("service checks: reading this node's instances failed", "error", err)
			if !sleepCtx(ctx, time.Second) {
				return
			}
			continue
		}
		seen := map[checkKey]bool{}
		for _, c := range checks {
			k := checkKey{c.Service, c.Instance}
			seen[k] = true
			if r, ok := runners[k]; ok {
				if proto.Equal(r.check, c.Check) {
					continue
				}
				stop(k)
			}
			rctx, cancel := context.WithCancel(ctx)
			r := &checkRunner{check: c.Check, cancel: cancel, done: make(chan struct{})}
			runners[k] = r
			go func() {
				defer close(r.done)
				a.runCheck(rctx, state, k, r.check)
			}()
		}
		for k := range runners {
			if !seen[k] {
				stop(k)
			}
		}
		if err := ws.WatchCtx(ctx); err != nil {
			return
		}
	}
}

// runCheck probes one instance every interval (the first probe at once)
// and reports each change of its decision: passing after
// success_before_passing passes in a row, critical after
// failures_before_critical failures in a row.
func (a *Agent) runCheck(ctx context.Context, state checkState, k checkKey, c *clusterv1.HealthCheck) {
	probe, closeProbe := newProbe(c)
	defer closeProbe()
	interval, timeout := c.GetInterval().AsDuration(), c.GetTimeout().AsDuration()
	logger := a.logger.With("service", k.service, "instance", k.id)
	var (
		passes, failures int
		reported         bool // this runner has written a result
	)
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, timeout)
		output, err := probe(pctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			failures, passes = failures+1, 0
			output = err.Error()
		} else {
			passes, failures = passes+1, 0
		}
		t.Reset(interval)
		inst, serr := state.State().Service(k.service, k.id)
		if serr != nil {
			continue // deregistered: followChecks stops this runner
		}
		want := inst.GetHealth()
		switch {
		case passes >= int(max(c.GetSuccessBeforePassing(), 1)):
			want = clusterv1.Health_HEALTH_PASSING
		case failures >= int(max(c.GetFailuresBeforeCritical(), 1)):
			want = clusterv1.Health_HEALTH_CRITICAL
		}
		output = truncateOutput(output)
		// A change of health, or the first decided result of this runner
		// when the stored output says something else ("not checked yet").
		decided := passes >= int(max(c.GetSuccessBeforePassing(), 1)) || failures >= int(max(c.GetFailuresBeforeCritical(), 1))
		if want == inst.GetHealth() && (reported || !decided || output == inst.GetOutput()) {
			continue
		}
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		_, werr := a.api.Heartbeat(wctx, connect.NewRequest(&clusterv1.HeartbeatRequest{
			Service: k.service, InstanceId: k.id, Health: want, Output: output,
		}))
		wcancel()
		if werr != nil {
			if ctx.Err() == nil {
				logger.Info("service check: recording the result failed; the next probe tries again", "health", want, "error", werr)
			}
			continue
		}
		reported = true
		if want != inst.GetHealth() {
			logger.Info("service check changed the instance's health", "from", inst.GetHealth(), "to", want, "output", output)
		}
	}
}

// maxProbeBody is how much of an HTTP check's answer its output keeps.
const maxProbeBody = 256

// newProbe returns the probe of c (nil error: passing; the output says
// what was seen) and what releases it.
func newProbe(c *clusterv1.HealthCheck) (probe func(ctx context.Context) (string, error), release func()) {
	switch {
	case c.GetHttp() != "":
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: c.GetTlsSkipVerify(), MinVersion: tls.VersionTLS12} //nolint:gosec // the operator's choice for this check
		tr.DisableKeepAlives = true
		client := &http.Client{
			Transport: tr,
			// 3xx passes as it is, as Consul's checks do.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
		url := c.GetHttp()
		return func(ctx context.Context) (string, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			if err != nil {
				return "", err
			}
			req.Header.Set("User-Agent", "pivirt-agent service check")
			resp, err := client.Do(req)
			if err != nil {
				return "", fmt.Errorf("HTTP GET %s: %w", url, unwrapURLError(err))
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(io.LimitReader(resp.Body, maxProbeBody))
			out := fmt.Sprintf("HTTP GET %s: %s", url, resp.Status)
			if s := strings.TrimSpace(string(body)); s != "" {
				out += " Output: " + s
			}
			if resp.StatusCode < 200 || resp.StatusCode >= 400 {
				return "", errors.New(out)
			}
			return out, nil
		}, tr.CloseIdleConnections
	case c.GetTcp() != "":
		addr := c.GetTcp()
		return func(ctx context.Context) (string, error) {
			var d net.Dialer
			conn, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				return "", fmt.Errorf("TCP connect %s: %w", addr, err)
			}
			_ = conn.Close()
			return fmt.Sprintf("TCP connect %s: Success", addr), nil
		}, func() {}
	default:
		target, service := c.GetGrpc(), c.GetGrpcService()
		creds := insecure.NewCredentials()
		if c.GetGrpcUseTls() {
			creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: c.GetTlsSkipVerify(), MinVersion: tls.VersionTLS12}) //nolint:gosec // the operator's choice for this check
		}
		var (
			mu   sync.Mutex
			conn *grpc.ClientConn
		)
		return func(ctx context.Context) (string, error) {
				mu.Lock()
				defer mu.Unlock()
				if conn == nil {
					cc, err := grpc.NewClient("passthrough:///"+target, grpc.WithTransportCredentials(creds))
					if err != nil {
						return "", fmt.Errorf("gRPC check %s: %w", target, err)
					}
					conn = cc
				}
				resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
				if err != nil {
					return "", fmt.Errorf("gRPC check %s: %w", target, err)
				}
				if st := resp.GetStatus(); st != healthpb.HealthCheckResponse_SERVING {
					return "", fmt.Errorf("gRPC check %s: %s", target, st)
				}
				return fmt.Sprintf("gRPC check %s: SERVING", target), nil
			}, func() {
				mu.Lock()
				defer mu.Unlock()
				if conn != nil {
					_ = conn.Close()
				}
			}
	}
}

// unwrapURLError drops net/http's repetition of the method and URL.
func unwrapURLError(err error) error {
	var ue interface{ Unwrap() error }
	if errors.As(err, &ue) && strings.HasPrefix(err.Error(), "Get ") {
		return ue.Unwrap()
	}
	return err
}

// truncateOutput keeps an output within fsm.MaxOutputSize, on a rune
// boundary, valid UTF-8.
func truncateOutput(s string) string {
	s = strings.ToValidUTF8(s, "?")
	if len(s) <= fsm.MaxOutputSize {
		return s
	}
	s = s[:fsm.MaxOutputSize-3]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "..."
}
