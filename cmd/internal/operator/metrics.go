package operator

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the operator's Prometheus metrics, served on its metrics
// address beside controller-runtime's own.
type metrics struct {
	readyGauge  *prometheus.GaugeVec
	expiration  *prometheus.GaugeVec
	renewal     *prometheus.GaugeVec
	issuances   *prometheus.CounterVec
	errors      *prometheus.CounterVec
	revocations prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		readyGauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pitrust_operator_certificate_ready",
			Help: "1 when the ManagedCertificate's Secret holds a valid certificate of its spec, else 0.",
		}, []string{"namespace", "name"}),
		expiration: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pitrust_operator_certificate_expiration_timestamp_seconds",
			Help: "When the ManagedCertificate's current certificate expires (Unix time; expiry in seconds is this minus time()).",
		}, []string{"namespace", "name"}),
		renewal: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pitrust_operator_certificate_renewal_timestamp_seconds",
			Help: "When the operator renews the ManagedCertificate's certificate (Unix time).",
		}, []string{"namespace", "name"}),
		issuances: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pitrust_operator_issuances_total",
			Help: "Certificates issued into ManagedCertificates' Secrets.",
		}, []string{"namespace", "name"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pitrust_operator_issuance_errors_total",
			Help: "Failed issuances (and revocations), by the Ready condition's reason.",
		}, []string{"namespace", "name", "reason"}),
		revocations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pitrust_operator_revocations_total",
			Help: "Certificates revoked at the CA server (deleted resources, replaced certificates).",
		}),
	}
	reg.MustRegister(m.readyGauge, m.expiration, m.renewal, m.issuances, m.errors, m.revocations)
	return m
}

func (m *metrics) ready(ns, name string, ok bool, notAfter, renewal time.Time) {
	v := 0.0
	if ok {
		v = 1
	}
	m.readyGauge.WithLabelValues(ns, name).Set(v)
	if !notAfter.IsZero() {
		m.expiration.WithLabelValues(ns, name).Set(float64(notAfter.Unix()))
	}
	if !renewal.IsZero() {
		m.renewal.WithLabelValues(ns, name).Set(float64(renewal.Unix()))
	}
}

func (m *metrics) issued(ns, name string) { m.issuances.WithLabelValues(ns, name).Inc() }

func (m *metrics) issuanceError(ns, name, reason string) {
	m.errors.WithLabelValues(ns, name, reason).Inc()
}

func (m *metrics) revoked() { m.revocations.Inc() }

// forget drops a deleted resource's series.
func (m *metrics) forget(ns, name string) {
	l := prometheus.Labels{"namespace": ns, "name": name}
	m.readyGauge.Delete(l)
	m.expiration.Delete(l)
	m.renewal.Delete(l)
	m.issuances.Delete(l)
	m.errors.DeletePartialMatch(l)
}
