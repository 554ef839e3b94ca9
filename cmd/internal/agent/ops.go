package agent

import (
	"cmp"
	"context"
	"expvar"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/gateway/observe"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// metricsMux is the operations port (8444): /metrics, /health, /live,
// /ready, and the management endpoints POST /reload, /debug/vars and
// /debug/pprof/*, which answer only the callers of
// server.metrics.management_allow_from (this host's loopback addresses by
// default) unless server.metrics.allow_remote_management is set, and never
// a browser's cross-site request (management).
func (a *Agent) metricsMux() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET "+a.cfg.Server.Metrics.Path, a.metricsHandler())
	mux.HandleFunc("GET /live", func(w http.ResponseWriter, r *http.Request) {
		if !a.Alive() {
			writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "stopped"})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok"})
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		st := a.cons.RaftStatus()
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "node_id": a.nodeID, "node_name": a.cfg.NodeName,
			"version": version.Version, "raft_state": st.State, "leader_id": st.LeaderID})
	})
	mux.HandleFunc("GET /ready", a.readyHandler)
	mux.Handle("POST /reload", a.management(http.HandlerFunc(a.reloadHandler)))
	mux.Handle("POST /rbac/reset", a.management(loopbackOnly(http.HandlerFunc(a.rbacResetHandler))))
	// Neither shows the command line (it may carry secrets): /debug/vars
	// leaves expvar's cmdline out, and pprof's cmdline is not served.
	mux.Handle("GET /debug/vars", a.management(http.HandlerFunc(debugVars)))
	mux.Handle("/debug/pprof/", a.management(http.HandlerFunc(pprof.Index)))
	mux.Handle("/debug/pprof/cmdline", http.NotFoundHandler())
	mux.Handle("/debug/pprof/profile", a.management(http.HandlerFunc(pprof.Profile)))
	mux.Handle("/debug/pprof/symbol", a.management(http.HandlerFunc(pprof.Symbol)))
	mux.Handle("/debug/pprof/trace", a.management(http.HandlerFunc(pprof.Trace)))
	return mux
}

// loopbackOnly answers only callers on this host (a loopback address),
// whatever server.metrics.management_allow_from and
// allow_remote_management say: they open the port's other management
// endpoints, not this one.
func loopbackOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, err := net.SplitHostPort(r.RemoteAddr)
		ip, perr := netip.ParseAddr(host)
		if err != nil || perr != nil || !ip.Unmap().IsLoopback() {
			writeJSON(w, http.StatusForbidden, map[string]any{"status": "error",
				"error": r.URL.Path + " answers callers on this host only (a loopback address), whatever server.metrics.management_allow_from says"})
			return
		}
		h.ServeHTTP(w, r)
	})
}

// rbacResetHandler is POST /rbac/reset, the break-glass path out of a
// cluster-wide RBAC policy that locks everyone out: it deletes the policy
// (the auth.rbac_policy file of each node applies again) without any RBAC
// check. Whoever reaches this node's operations port from an allowed
// address may; the call is
// audited. It answers loopback callers only (loopbackOnly). It needs a
// leader, like every write.
func (a *Agent) rbacResetHandler(w http.ResponseWriter, r *http.Request) {
	observe.Audit(a.logger, slog.LevelWarn, "audit: break-glass: removing the cluster-wide RBAC policy through the operations port",
		"decision", "allow", "method", "POST /rbac/reset", "resource", RBACResource, "verb", "delete", "remote", r.RemoteAddr)
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	resp, err := a.api.DeleteConfig(ctx, connect.NewRequest(&clusterv1.DeleteConfigRequest{Key: RBACPolicyKey}))
	switch {
	case connect.CodeOf(err) == connect.CodeNotFound:
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "removed": false, "detail": "no cluster-wide RBAC policy is set"})
	case err != nil:
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "error", "error": "the cluster-wide RBAC policy was not removed: " + err.Error()})
	default:
		observe.Audit(a.logger, slog.LevelWarn, "audit: break-glass: cluster-wide RBAC policy removed", "index", resp.Msg.GetIndex(), "remote", r.RemoteAddr)
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "removed": true, "index": resp.Msg.GetIndex(),
			"detail": "each node's auth.rbac_policy file applies again"})
	}
}

func (a *Agent) metricsHandler() http.Handler {
	return promhttp.HandlerFor(a.metrics, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(a.logger.Handler(), slog.LevelWarn)})
}

// management guards a management endpoint: the caller's address must be
// one of server.metrics.management_allow_from (unless
// server.metrics.allow_remote_management); the Host header an IP address
// or localhost, so that a web page cannot reach the port through a name
// that resolves to an allowed address (DNS rebinding); and a browser's
// cross-site request that changes something (POST /reload from another
// origin) is refused (net/http's CrossOriginProtection: Sec-Fetch-Site,
// Origin against Host). Tools (curl, scripts) send neither header.
func (a *Agent) management(h http.Handler) http.Handler {
	mc := a.cfg.Server.Metrics
	allowed := mc.ManagementPrefixes()
	forbid := func(w http.ResponseWriter, msg string) {
		writeJSON(w, http.StatusForbidden, map[string]any{"status": "error", "error": msg})
	}
	cop := http.NewCrossOriginProtection()
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		forbid(w, r.URL.Path+" refuses cross-site requests from a browser (Origin "+r.Header.Get("Origin")+")")
	}))
	guarded := cop.Handler(h)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !mc.AllowRemoteManagement && !callerIn(r, allowed) {
			forbid(w, fmt.Sprintf("%s answers callers from %s only (server.metrics.management_allow_from, or allow_remote_management)",
				r.URL.Path, strings.Join(mc.ManagementAllowFrom, ", ")))
			return
		}
		if !localHost(r.Host) {
			forbid(w, fmt.Sprintf("%s needs the address of the port in the URL (an IP address, localhost or this host's name), not %q", r.URL.Path, r.Host))
			return
		}
		// A browser's request from another site, whatever its method (an
		// <img> can start a profile): CrossOriginProtection passes GET.
		if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
			forbid(w, r.URL.Path+" refuses requests a browser makes for another site (Sec-Fetch-Site "+site+")")
			return
		}
		guarded.ServeHTTP(w, r)
	})
}

// callerIn reports whether r's remote address is in one of the prefixes.
func callerIn(r *http.Request, prefixes []netip.Prefix) bool {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip := ap.Addr().Unmap().WithZone("")
	for _, p := range prefixes {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// localHost reports whether a Host header names this host: an IP
// address, localhost (and its usual aliases) or the host's own name (with
// or without a port). A name a web page controls (DNS rebinding) is none
// of these.
func localHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"), ".")
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	names := []string{"localhost", "ip6-localhost", "ip6-loopback"}
	if h, err := os.Hostname(); err == nil {
		names = append(names, h)
	}
	for _, n := range names {
		if strings.EqualFold(host, n) {
			return true
		}
	}
	return false
}

// debugVars is expvar's /debug/vars without the command line.
func debugVars(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	fmt.Fprint(w, "{\n")
	first := true
	expvar.Do(func(kv expvar.KeyValue) {
		if kv.Key == "cmdline" {
			return
		}
		if !first {
			fmt.Fprint(w, ",\n")
		}
		first = false
		fmt.Fprintf(w, "%q: %s", kv.Key, kv.Value)
	})
	fmt.Fprint(w, "\n}\n")
}

// readyHandler is GET /ready: 200 when every check passes, else 503; the
// body names each check and its detail.
func (a *Agent) readyHandler(w http.ResponseWriter, r *http.Request) {
	checks, ready := a.readiness(r.Context(), time.Now())
	code, status := http.StatusOK, "ready"
	if !ready {
		code, status = http.StatusServiceUnavailable, "not ready"
	}
	writeJSON(w, code, map[string]any{"status": status, "checks": checks, "applied_index": a.fsm.AppliedIndex()})
}

// readiness runs the checks of /ready: those of the state backend
// (raftReadiness, etcdReadiness), then commonReadiness.
func (a *Agent) readiness(ctx context.Context, now time.Time) (map[string]string, bool) {
	checks := map[string]string{}
	ready := true
	fail := func(name, format string, args ...any) {
		checks[name] = fmt.Sprintf(format, args...)
		ready = false
	}
	if a.etcdMode() {
		a.etcdReadiness(checks, fail)
	} else {
		a.raftReadiness(ctx, now, checks, fail)
	}
	a.versionReadiness(checks, fail)
	a.commonReadiness(now, checks, fail, &ready)
	return checks, ready
}

// etcdReadiness: etcd answers and the local mirror follows it; some agent
// holds the schedule leadership.
func (a *Agent) etcdReadiness(checks map[string]string, fail func(name, format string, args ...any)) {
	st := a.etcd.Status()
	switch {
	case !st.Healthy:
		fail("etcd", "unreachable: %s; reads marked stale are served from the state as of revision %d", st.LastError, st.Revision)
	case !st.Synced:
		fail("etcd", "reachable, the local state is being loaded")
	default:
		checks["etcd"] = fmt.Sprintf("ok: revision %d", st.Revision)
	}
	if st.LeaderID == "" {
		fail("leader", "no agent holds the schedule leadership")
	} else {
		checks["leader"] = "ok: " + st.LeaderID
	}
}

// raftReadiness: a known leader (and, on the leader, its barrier done); the
// local state caught up with the commit index (and, on a follower, a leader
// heard from recently).
func (a *Agent) raftReadiness(ctx context.Context, now time.Time, checks map[string]string, fail func(name, format string, args ...any)) {
	st := a.store.Status()
	if st.LeaderID == "" {
		fail("leader", "no known leader")
	} else {
		checks["leader"] = "ok: " + st.LeaderID
	}
	if st.State == "Leader" && !a.leaderReady() {
		fail("leader_state", "leader barrier not complete")
	}
	stale := 10 * a.cfg.Cluster.Raft.HeartbeatTimeout.Std()
	if h := a.fsm.Halted(); h != nil {
		fail("fsm", "%v", h)
		return
	}
	if st.State == "Follower" && st.LeaderID != "" {
		if behind := a.behindLeader(ctx); behind != "" {
			fail("fsm", "%s", behind)
			return
		}
	}
	if detail, ok := a.replicaReadiness(); ok && st.State == "Leader" {
		checks["replicas"] = detail
	}
	switch {
	case st.AppliedIndex < st.CommitIndex:
		fail("fsm", "applied index %d behind the commit index %d", st.AppliedIndex, st.CommitIndex)
	case st.State == "Follower" && (st.LastContact.IsZero() || now.Sub(st.LastContact) > stale):
		fail("fsm", "no contact with the leader for over %s: the local state may be stale", stale)
	default:
		checks["fsm"] = fmt.Sprintf("ok: applied index %d", st.AppliedIndex)
	}
}

// commonReadiness: the TLS material valid; the required backends each with
// an available endpoint.
func (a *Agent) commonReadiness(now time.Time, checks map[string]string, fail func(name, format string, args ...any), ready *bool) {
	if a.tls != nil {
		detail, ok := a.tls.check(now)
		checks["tls"] = detail
		*ready = *ready && ok
	}
	if len(a.renewers) > 0 {
		// A failing renewal is reported, not failed: the certificates in
		// use stay valid until the tls check says otherwise.
		var parts []string
		for _, r := range a.renewers {
			st := r.Status()
			switch {
			case st.LastError != nil:
				parts = append(parts, fmt.Sprintf("%s: renewal failing, retry at %s: %v", r.Name, st.Next.UTC().Format(time.RFC3339), st.LastError))
			case !st.Next.IsZero():
				parts = append(parts, fmt.Sprintf("%s: renewal at %s", r.Name, st.Next.UTC().Format(time.RFC3339)))
			}
		}
		checks["tls_renewal"] = cmp.Or(strings.Join(parts, "; "), "ok")
	}
	for _, b := range a.currentBackends() {
		eps := b.Endpoints()
		avail := 0
		for _, e := range eps {
			if e.Status() == "healthy" {
				avail++
			}
		}
		name := "backend:" + b.Name()
		required := a.cfg.Backends[b.Name()].Required
		switch {
		case b.Healthy():
			checks[name] = fmt.Sprintf("ok: %d of %d endpoints available", avail, len(eps))
		case required:
			fail(name, "no endpoint available (%d configured); the backend is required", len(eps))
		default:
			checks[name] = fmt.Sprintf("degraded: no endpoint available (%d configured); not required", len(eps))
		}
	}
	// The cluster settings: a node that cannot apply them keeps serving
	// with the last good ones, so this check reports without failing.
	switch st := a.SettingsStatus(); {
	case st.Error != "":
		checks["config"] = fmt.Sprintf("degraded: cluster settings of revision %d not applied, serving with revision %d: %s", st.FailedRevision, st.Revision, st.Error)
	case len(st.Keys) == 0:
		checks["config"] = "ok: no cluster settings"
	default:
		checks["config"] = fmt.Sprintf("ok: cluster settings of revision %d applied (%s)", st.Revision, strings.Join(st.Keys, ", "))
	}
}
