package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
)

// revocationMetrics are the counters of tls.revocation.
type revocationMetrics struct {
	checks, fetches *prometheus.CounterVec
	closed          prometheus.Counter
}

func newRevocationMetrics(reg prometheus.Registerer) *revocationMetrics {
	m := &revocationMetrics{
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_tls_revocation_checks_total",
			Help: "Revocation checks of peer certificates, by result (good, revoked, unavailable, skipped: revocation off or nothing to ask).",
		}, []string{"result"}),
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_tls_crl_fetches_total",
			Help: "CRL fetches, by result (ok, error).",
		}, []string{"result"}),
		closed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pivirt_tls_revoked_connections_closed_total",
			Help: "Open connections closed because a CRL revoked the peer's certificate.",
		}),
	}
	for _, r := range []string{identity.RevocationGood, identity.RevocationRevoked, identity.RevocationUnavailable, identity.RevocationSkipped} {
		m.checks.WithLabelValues(r)
	}
	m.fetches.WithLabelValues("ok")
	m.fetches.WithLabelValues("error")
	reg.MustRegister(m.checks, m.fetches, m.closed)
	return m
}

// revocationConfig is the checker's configuration for tls.revocation.
func (a *Agent) revocationConfig(rc config.RevocationConfig) identity.RevocationConfig {
	m := a.revocationMetrics
	return identity.RevocationConfig{
		Mode: rc.Mode, OnUnavailable: rc.OnUnavailable, Refresh: rc.Refresh.Std(),
		Logger:             a.logger,
		OnCheck:            func(r string) { m.checks.WithLabelValues(r).Inc() },
		OnFetch:            func(r string) { m.fetches.WithLabelValues(r).Inc() },
		OnConnectionClosed: m.closed.Inc,
	}
}

// startRevocation makes the revocation checker every TLS source of the
// agent uses (set on each in startTLS, backendTLS and openEtcd) and runs
// its CRL refreshes.
func (a *Agent) startRevocation() error {
	a.revocationMetrics = newRevocationMetrics(a.metrics)
	rc, err := identity.NewRevocationChecker(a.revocationConfig(a.cfg.TLS.Revocation))
	if err != nil {
		return err
	}
	a.revocation = rc
	a.wg.Go(func() { rc.Run(a.ctx) })
	return nil
}
